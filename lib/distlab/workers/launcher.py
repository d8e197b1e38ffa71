"""Launching the worker programs under torchrun on this machine (or on each node of a cluster, with the
same call), through distlab.launch.process: a hang or a crash is killed as a process group and reported
with the failing rank's last lines. Rank 0 writes the result JSON; this side reads it back.

  run_fingerprint      every rank's software/hardware fingerprint, rank 0's comparison table (ch. 00)
  run_allreduce_bench  all-reduce bus bandwidth over a message-size sweep (ch. 00, the limits table)
  run_worker           any distlab.workers program: `module --out out_json args...`
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Mapping, Sequence

import pandas as pd
import torch

from distlab.launch import process
from distlab.launch.torchrun import torchrun_flags
from distlab.measure.envcheck import fingerprint_table
from distlab.measure.limits import DEFAULT_SIZES_KIB, allreduce_backend, resolve_device
from distlab.paths import RUNS_DIR


def run_fingerprint(nproc: int = 2, timeout_s: float = 120, nnodes: int = 1, node_rank: int = 0,
                    rdzv_endpoint: str | None = None, out_json: str | Path | None = None,
                    backend: str = "gloo", env: Mapping[str, str] | None = None,
                    echo: bool | Callable[[str], None] = True) -> pd.DataFrame | None:
    """Launch the fingerprint worker on `nproc` ranks per node and return rank 0's table.

    One machine (the default): `torchrun --nnodes 1 --nproc-per-node N --standalone -m
    distlab.workers.fingerprint --out F`.

    Several machines: run the same call on every node with the same `nnodes` and
    `rdzv_endpoint` ("host:port" of node 0, reachable from all nodes through the firewall); each
    node then runs

        torchrun --nnodes 2 --nproc-per-node 1 \\
                 --rdzv-backend c10d --rdzv-endpoint 192.168.1.100:29500 --rdzv-id distlab-fp \\
                 -m distlab.workers.fingerprint --out fingerprint.json

    The c10d rendezvous numbers the nodes as they join, so `node_rank` is not passed on (torchrun
    ignores --node-rank there). Pass `env={"GLOO_SOCKET_IFNAME": "eth0"}` to pin the network
    interface. Only global rank 0 writes the JSON, so the other nodes get None back (their launch
    still fails loudly if any rank failed).

    The worker uses gloo by default even on GPU nodes: the point is to compare software before
    trusting NCCL, and gloo needs nothing but TCP.
    """
    out_json = Path(out_json) if out_json else RUNS_DIR / "envcheck" / "fingerprint.json"
    flags = torchrun_flags(nproc, nnodes, rendezvous="standalone" if nnodes == 1 else "c10d",
                           node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, rdzv_id="distlab-fp")
    run_worker("distlab.workers.fingerprint", out_json, ["--backend", backend], flags, timeout_s=timeout_s,
               env=env, echo=echo)
    if not out_json.exists():
        return None  # not node 0: rank 0 lives elsewhere
    return fingerprint_table(json.loads(out_json.read_text())["rows"])


def run_worker(module: str, out_json: Path, worker_args: Sequence[str], flags: Sequence[Sequence[str]], *,
               timeout_s: float, env: Mapping[str, str] | None = None,
               echo: bool | Callable[[str], None] = True) -> process.RunResult:
    """Run a distlab.workers program under torchrun (`flags` from torchrun_flags) through process.run:
    `module --out out_json worker_args...`, its console log beside out_json as .log.

    A stale out_json is removed first, so that only this run's result can be read afterwards."""
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.unlink(missing_ok=True)
    cmd = process.python_module_cmd("torch.distributed.run", *(flag for group in flags for flag in group),
                                   "-m", module, "--out", str(out_json), *worker_args)
    return process.run(cmd, timeout_s=timeout_s, env=worker_env(env), echo=echo, log_path=out_json.with_suffix(".log"))


def worker_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """One OpenMP thread per rank: ranks sharing a few cores slow each other down badly otherwise."""
    env = {"OMP_NUM_THREADS": "1"}
    env.update(extra or {})
    return env


def run_allreduce_bench(nproc: int = 2, sizes_kib: Sequence[float] = DEFAULT_SIZES_KIB, timeout_s: float = 300,
                        device: str = "auto", seconds_per_size: float = 0.25, max_iters: int = 1000,
                        out_json: str | Path | None = None, env: Mapping[str, str] | None = None,
                        echo: bool | Callable[[str], None] = True) -> pd.DataFrame:
    """Launch distlab.workers.allreduce_bench on `nproc` local ranks; one row per message size.

    gloo with one thread per rank on CPU, nccl when there is a GPU per rank (allreduce_backend).
    Columns: size_bytes, count, iters, time_us, algbw_GBps, busbw_GBps, backend, world_size.
    `df.attrs["phases"]`: rank 0's phases as (start, end, label), wall-clock time.time() seconds
    (python start and imports, rendezvous, one per size), to shade on a utilisation timeline."""
    backend = allreduce_backend(device, nproc)
    if echo and backend == "gloo" and resolve_device(device) == "cuda":
        (echo if callable(echo) else print)(
            f"{torch.cuda.device_count()} GPU(s) for {nproc} ranks: NCCL needs one GPU per rank, "
            "so this measures CPU ranks with gloo")
    out_json = Path(out_json) if out_json else RUNS_DIR / "envcheck" / "allreduce.json"
    worker_args = ["--backend", backend, "--sizes-kib", ",".join(str(s) for s in sizes_kib),
                   "--seconds-per-size", str(seconds_per_size), "--max-iters", str(max_iters)]
    run_worker("distlab.workers.allreduce_bench", out_json, worker_args, torchrun_flags(nproc),
               timeout_s=timeout_s, env=env, echo=echo)
    result = json.loads(out_json.read_text())
    df = pd.DataFrame(result["results"])
    df["backend"] = result["backend"]
    df["world_size"] = result["world_size"]
    df.attrs["phases"] = [(p["start"], p["end"], p["label"]) for p in result.get("phases", [])]
    return df
