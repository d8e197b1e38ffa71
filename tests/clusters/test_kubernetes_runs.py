"""The Kubernetes target for real, without a cluster (none can run here): the generated entrypoint run as two
local "pods" to a finished 2-node DDP run whose results the collector reads back, from the captured logs and through
the collector's command with a stand-in kubectl. The manifests, their offline validation, the presets, the
Dockerfile and the collector on captured logs: tests/unit/test_kubernetes.py.
"""

from __future__ import annotations

import socket
import sys
import threading

from distlab.launch import process
from distlab.launch.kubernetes import collect, command, manifests
from distlab.launch.kubernetes.manifests import KubeJob, kube_spec
from distlab.paths import REPO_ROOT
from distlab.results import extract
from helpers import fake_kubectl

TINY_CONFIG = REPO_ROOT / "lib" / "distlab" / "configs" / "tiny_lora.yaml"


# ------------------------------------------------------------------ two local pods, one real DDP run

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_local_pods_run_the_entrypoint_to_a_finished_ddp_run(tmp_path, monkeypatch):
    """The generated entrypoint, run as two processes with JOB_COMPLETION_INDEX=0 and 1 (what Kubernetes
    sets) and MASTER_ADDR=127.0.0.1: a 2-node x 1-process DDP run of the tiny model on gloo, each "pod" in
    its own folder, then the collector reads both ranks from the two captured logs."""
    args = ["--config", str(TINY_CONFIG), "--set", "strategy=ddp", "--set", "max_steps=3", "--set", "seq_len=128",
            "--set", "micro_batch_size=2", "--set", "progress=false", "--set", "eval_file=null",
            "--set", "output_dir=out"]
    spec = kube_spec("ddp-2gpu", module="distlab.train", args=args, nproc_per_node=1, nnodes=2, strategy="ddp",
                     env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}, log_dir="logs", timeout_s=240,
                     kill_after_s=45, python=sys.executable, description="two local pods")
    script = tmp_path / "ddp-2gpu.sh"
    script.write_text(manifests.render_entrypoint(KubeJob("ddp-2gpu", spec, image="i:1")))
    port, results, logs = _free_port(), {}, {}

    def pod(index: int) -> None:
        folder = tmp_path / f"pod{index}"
        folder.mkdir()
        lines: list[str] = []
        results[index] = process.run(["bash", str(script)], timeout_s=300, cwd=folder, echo=lines.append, check=False,
                                    env={"JOB_COMPLETION_INDEX": str(index), "MASTER_ADDR": "127.0.0.1",
                                         "MASTER_PORT": str(port), "PYTHON": sys.executable},
                                    log_path=folder / "pod.log")
        logs[f"ddp-2gpu-{index}-local"] = "\n".join(lines) + "\n"

    threads = [threading.Thread(target=pod, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for index, result in sorted(results.items()):
        print(f"--- pod {index}: exit {result.returncode} in {result.elapsed_s:.1f} s; last lines:")
        print("\n".join(result.tail[-6:]))
        assert result.ok, "\n".join(result.tail[-40:])
    assert "entrypoint: master 127.0.0.1 is an IP address: no DNS lookup" in logs["ddp-2gpu-1-local"]
    assert "entrypoint: node 1 of 2, master 127.0.0.1:" in logs["ddp-2gpu-1-local"]
    records = collect.results_from_logs(logs)
    assert sorted(records) == [0, 1]
    assert {(r["strategy"], r["world_size"], r["steps"][-1]) for r in records.values()} == {("ddp", 2, 3)}
    assert records[0]["loss"] == records[1]["loss"]  # DDP: the same all-reduced loss on both nodes
    # ... and the same logs through the collector's command, with a stand-in kubectl serving them
    fake_kubectl(tmp_path, monkeypatch, logs, [(name, i, "2026-01-06T12:00:00Z", "Succeeded")
                                                for i, name in enumerate(sorted(logs))])
    assert command.main(["collect", "--run", "ddp-2gpu", "--out", str(tmp_path / "collected")]) == 0
    assert sorted(extract.collect_run(tmp_path / "collected" / "ddp-2gpu", expected_ranks=2)) == [0, 1]
