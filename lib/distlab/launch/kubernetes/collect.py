"""A Kubernetes run's results, from its pods' logs: `kubectl logs` of every pod, read by the marker collector.

    python -m distlab.launch.kubernetes collect --namespace distlab-bench --run ddp-2gpu --out build/k8s

A finished pod's files are gone with it; its log stays until the Job is deleted. Every rank printed its
result between DISTLAB_RESULT markers (distlab.results.extract), so the pods' logs are all the collector
needs. The pods are found by the run's label (`distlab.io/run=<run>`); each pod's whole log is read with
its own `kubectl logs` (with a label selector instead, kubectl shows only the last 10 lines of each pod).
When Kubernetes replaced a failed pod, the newest pod of each completion index is read. The records go
through `extract_results`, which fails on a truncated block, a rank reported twice or a missing rank.

With --out, DIR/<run>/pods/<pod>.log keeps each log, DIR/<run>/console.log all of them in node order (so
that `collect.collect_run(DIR/<run>)` reads the run like a local one) and DIR/<run>/results.json the records.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any, Mapping

from distlab.jsonio import strict_json
from distlab.launch.kubernetes.manifests import LABEL_RUN
from distlab.results.extract import ResultLogError, extract_results

INDEX_KEY = "batch.kubernetes.io/job-completion-index"  # annotation (and, since 1.28, label) of Indexed Job pods
KUBECTL_TIMEOUT_S = 120


class KubectlError(RuntimeError):
    """kubectl is missing, or one of its commands failed."""


def kubectl_path() -> str:
    path = shutil.which("kubectl")
    if path is None:
        raise KubectlError("kubectl not found on PATH: install it and point it at the cluster (KUBECONFIG or "
                           "~/.kube/config); the collector runs `kubectl get pods` and `kubectl logs`")
    return path


def _kubectl(*args: str) -> str:
    cmd = [kubectl_path(), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=KUBECTL_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise KubectlError(f"`kubectl {' '.join(args)}` did not answer within {KUBECTL_TIMEOUT_S} s") from e
    if proc.returncode != 0:
        raise KubectlError(f"`kubectl {' '.join(args)}` failed (exit {proc.returncode}): "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def run_pods(namespace: str, run: str) -> list[tuple[int, str, str]]:
    """(completion index, pod name, phase) of the run's pods, the newest pod per index, by index."""
    listing = json.loads(_kubectl("get", "pods", "--namespace", namespace, "--selector", f"{LABEL_RUN}={run}",
                                  "--output", "json"))
    newest: dict[int, dict] = {}
    for pod in listing.get("items", []):
        meta = pod.get("metadata", {})
        index = (meta.get("annotations") or {}).get(INDEX_KEY, (meta.get("labels") or {}).get(INDEX_KEY))
        if index is None or not str(index).isdigit():
            raise KubectlError(f"pod {meta.get('name')} has no {INDEX_KEY}: not a pod of an Indexed Job")
        index = int(index)
        if index not in newest or meta.get("creationTimestamp", "") > newest[index]["metadata"].get(
                "creationTimestamp", ""):
            newest[index] = pod
    if not newest:
        raise KubectlError(f"no pods labelled {LABEL_RUN}={run} in namespace {namespace} (deleted with their Job?)")
    return [(i, p["metadata"]["name"], p.get("status", {}).get("phase", "?")) for i, p in sorted(newest.items())]


def results_from_logs(logs: Mapping[str, str]) -> dict[int, dict[str, Any]]:
    """rank -> record from the pods' logs ({pod name: log text}); every rank of the run's world must
    be there exactly once (the world size is the records' own)."""
    results: dict[int, dict[str, Any]] = {}
    where: dict[int, str] = {}
    for pod, text in logs.items():
        for rank, record in extract_results(text if "\n" in text else text + "\n", name=f"pod {pod}").items():
            if rank in results:
                raise ResultLogError(f"rank {rank} reported twice: in pod {where[rank]} and in pod {pod}")
            results[rank], where[rank] = record, pod
    if not results:
        raise ResultLogError(f"no result markers in the logs of {len(logs)} pod(s): the run failed or is not done "
                             "(a rank prints its result at the end)")
    worlds = {int(r.get("world_size", -1)) for r in results.values()}
    if len(worlds) != 1:
        raise ResultLogError(f"the records disagree on the world size: {sorted(worlds)}")
    return _checked(results, worlds.pop(), where)


def _checked(results: dict[int, dict[str, Any]], world: int, where: dict[int, str]) -> dict[int, dict[str, Any]]:
    missing = [r for r in range(world) if r not in results]
    if missing or len(results) != world:
        raise ResultLogError(f"world size {world}, but results of rank(s) {sorted(results)} (missing: {missing}; "
                             f"pods read: {', '.join(sorted(set(where.values())))})")
    return dict(sorted(results.items()))


def collect_pods(namespace: str, run: str, out: str | Path | None = None,
                 pods: list[tuple[int, str, str]] | None = None) -> dict[int, dict[str, Any]]:
    """The run's results from its pods (see the module docstring); with `out`, the logs and records saved.
    `pods`: run_pods' answer, when the caller already has it."""
    pods = run_pods(namespace, run) if pods is None else pods
    logs = {name: _kubectl("logs", "--namespace", namespace, f"pod/{name}") for _, name, _ in pods}
    if out is not None:
        folder = Path(out) / run
        (folder / "pods").mkdir(parents=True, exist_ok=True)
        for name, text in logs.items():
            (folder / "pods" / f"{name}.log").write_text(text, encoding="utf-8")
        (folder / "console.log").write_text("".join(t if t.endswith("\n") else t + "\n" for t in logs.values()),
                                            encoding="utf-8")
    results = results_from_logs(logs)
    if out is not None:
        (Path(out) / run / "results.json").write_text(strict_json(results, indent=1) + "\n")
    return results


def summary_lines(results: Mapping[int, Mapping[str, Any]]) -> list[str]:
    lines = []
    for rank, rec in results.items():
        own = rec.get("rank_summary") or {}
        lines.append(f"rank {rank}: {rec.get('strategy')} x{rec.get('world_size')} on {rec.get('device_name')}, "
                     f"{len(rec.get('steps') or [])} steps, tokens/s {own.get('tokens_per_s', float('nan')):.4g}, "
                     f"step {own.get('step_time_s', float('nan')):.4g} s, final loss {rec.get('final_loss')}")
    return lines


def main_collect(namespace: str, run: str, out: str | None) -> int:
    try:
        pods = run_pods(namespace, run)
        print(f"{run}: {len(pods)} pod(s) in {namespace}: " + ", ".join(f"{n} ({phase})" for _, n, phase in pods))
        results = collect_pods(namespace, run, out, pods)
    except (KubectlError, ResultLogError) as e:
        print(f"collect: {e}")
        return 1
    print("\n".join(summary_lines(results)))
    if out is not None:
        print(f"logs and results.json in {Path(out) / run}")
    return 0
