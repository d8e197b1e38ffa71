"""This machine's measured limits: matmul FLOP/s, memory bandwidth, all-reduce bus bandwidth.

Notebook 00 measures them and saves `figures/device_limits.csv`; later chapters read it with
`load_device_limits()` to say how close a run came to what the hardware can do (MFU, and how
long a gradient all-reduce must take at best).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

import pandas as pd
import torch

from distlab import device as devmod
from distlab import provenance as prov
from distlab.machine import usable_cores
from distlab.paths import FIGURES_DIR

DEFAULT_SIZES_KIB = (4, 16, 64, 256, 1024, 4096, 16384, 65536)  # 4 KiB .. 64 MiB, as a DDP bucket grows
LIMITS_FILE = "device_limits.csv"
BUSBW_FIGURE = "allreduce_busbw.png"
COLUMNS = ["metric", "dtype", "workers", "worker_kind", "value", "unit", "vendor_peak",
           "fraction_of_peak", "device", "source"]


def resolve_device(device: str = "auto") -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: expected auto, cpu or cuda")
    return device


def vendor_peak(device_name: str, dtype_key: str) -> float | None:
    """Data-sheet FLOP/s from device.KNOWN_PEAKS when the device name contains a known model."""
    for pattern, peaks in devmod.KNOWN_PEAKS.items():
        if pattern in device_name and dtype_key in peaks:
            return peaks[dtype_key]
    return None


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run a block with `n` intra-op threads, then restore the caller's setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _row(metric: str, dtype: str, workers: int, worker_kind: str, value: float, unit: str,
         device_name: str, source: str, peak: float | None = None) -> dict[str, Any]:
    return {"metric": metric, "dtype": dtype, "workers": workers, "worker_kind": worker_kind,
            "value": value, "unit": unit, "vendor_peak": peak,
            "fraction_of_peak": (value / peak) if peak else None, "device": device_name, "source": source}


def _cpu_thread_counts() -> list[int]:
    # One thread is what a CPU rank gets; all usable cores is what a single process could get.
    return sorted({1, usable_cores()})


# ---------------------------------------------------------------- compute

def matmul_rows(device: str = "auto", seconds: float = 1.0) -> list[dict[str, Any]]:
    device = resolve_device(device)
    name = devmod.device_name(device)
    if device == "cpu":
        rows = []
        # bf16 only where it is native: chapter 01 trains in it there (device.choose_device's auto-bf16)
        dtypes = ((torch.float32, "fp32"), (torch.bfloat16, "bf16")) if devmod.native_bf16("cpu") else (
            (torch.float32, "fp32"),)
        for dtype, key in dtypes:
            for threads in _cpu_thread_counts():
                with torch_threads(threads):
                    flops = devmod.measure_matmul_flops("cpu", dtype, seconds=seconds)
                rows.append(_row("matmul", key, threads, "threads", flops / 1e9, "GFLOP/s", name,
                                 "no vendor table, measured"))
        return rows
    rows = []
    for dtype, key in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        flops = devmod.measure_matmul_flops("cuda", dtype, seconds=seconds)
        peak = vendor_peak(name, key)
        rows.append(_row("matmul", key, 1, "gpu", flops / 1e9, "GFLOP/s", name,
                         "measured vs data sheet" if peak else "no vendor table, measured",
                         peak / 1e9 if peak else None))
    return rows


# ---------------------------------------------------------------- memory

def measure_memory_bandwidth(device: str = "cpu", nbytes: int | None = None, repeats: int = 5) -> float:
    """Bytes read + written per second by a large tensor copy, best of `repeats`.

    The buffers must be much larger than the caches, or we would time the cache instead."""
    dev = torch.device(resolve_device(device))
    nbytes = nbytes or (2**30 if dev.type == "cuda" else 256 * 2**20)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)  # ones(): pages really allocated
    dst = torch.zeros_like(src)

    def timed_copy() -> float:
        devmod.synchronize(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        devmod.synchronize(dev)
        return time.perf_counter() - t0

    timed_copy()  # the first copy pays for page faults and clocks ramping up
    best = min(timed_copy() for _ in range(repeats))
    return 2 * src.numel() * src.element_size() / best


def memory_rows(device: str = "auto", nbytes: int | None = None) -> list[dict[str, Any]]:
    device = resolve_device(device)
    name = devmod.device_name(device)
    if device == "cuda":
        bw = measure_memory_bandwidth("cuda", nbytes)
        return [_row("memory_bandwidth", "fp32", 1, "gpu", bw / 1e9, "GB/s", name, "measured tensor copy")]
    rows = []
    for threads in _cpu_thread_counts():
        with torch_threads(threads):
            bw = measure_memory_bandwidth("cpu", nbytes)
        rows.append(_row("memory_bandwidth", "fp32", threads, "threads", bw / 1e9, "GB/s", name,
                         "measured tensor copy"))
    return rows


# ---------------------------------------------------------------- all-reduce

def allreduce_backend(device: str, nproc: int) -> str:
    """The device's backend (distlab.device.backend_for), except that NCCL needs a GPU per rank:
    with fewer GPUs than ranks the ranks run on CPU with gloo (a 1-GPU node still gets a number)."""
    backend = devmod.backend_for(resolve_device(device))
    if backend == "nccl" and torch.cuda.device_count() < nproc:
        return "gloo"
    return backend


def allreduce_rows(sweep) -> list[dict[str, Any]]:
    """Bus bandwidth at the largest message (the bandwidth limit) and time of the smallest (the latency)."""
    largest = sweep.loc[sweep["size_bytes"].idxmax()]
    smallest = sweep.loc[sweep["size_bytes"].idxmin()]
    n, backend = int(largest["world_size"]), largest["backend"]
    name = devmod.device_name("cuda" if backend == "nccl" else "cpu")
    return [
        _row("allreduce_busbw", "fp32", n, "ranks", float(largest["busbw_GBps"]), "GB/s", name,
             f"{backend}, {size_text(largest['size_bytes'])} message"),
        _row("allreduce_latency", "fp32", n, "ranks", float(smallest["time_us"]), "us", name,
             f"{backend}, {size_text(smallest['size_bytes'])} message"),
    ]


def allreduce_seconds(nbytes: float, busbw_GBps: float, world_size: int) -> float:
    """Lower bound on a ring all-reduce of `nbytes` at a measured bus bandwidth (latency ignored)."""
    return nbytes * 2 * (world_size - 1) / world_size / (busbw_GBps * 1e9)


def size_text(nbytes: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{int(nbytes)} B"


# ---------------------------------------------------------------- the table

def measure_device_limits(device: str = "auto", *, allreduce, matmul_seconds: float = 1.0,
                          memory_bytes: int | None = None):
    """All limits in one table: matmul and memory measured here, `allreduce` the sweep that
    distlab.workers.launcher.run_allreduce_bench measured on several ranks."""
    rows = matmul_rows(device, matmul_seconds) + memory_rows(device, memory_bytes) + allreduce_rows(allreduce)
    return pd.DataFrame(rows, columns=COLUMNS)


def limits_path(figures_dir: str | Path | None = None) -> Path:
    return Path(figures_dir or FIGURES_DIR) / LIMITS_FILE


def save_device_limits(df, figures_dir: str | Path | None = None,
                       provenance: Mapping[str, Any] | None = None) -> Path:
    if provenance is None:
        ranks = df.loc[df["worker_kind"] == "ranks", "workers"]
        provenance = prov.stamp(model="none (device benchmark)", world_size=int(ranks.max()) if len(ranks) else 1)
    return prov.save_table(df, limits_path(figures_dir), dict(provenance))


def load_device_limits(figures_dir: str | Path | None = None) -> pd.DataFrame:
    path = limits_path(figures_dir)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist: this machine's limits have not been measured yet. "
            "Run notebooks/00_environment_check.ipynb first (it writes this file).")
    return pd.read_csv(path)


def lookup(df, metric: str, **match: Any) -> float:
    """The one value of `metric` whose other columns equal `match`, e.g.
    lookup(df, "matmul", dtype="fp32", workers=1)."""
    sel = df[df["metric"] == metric]
    for column, value in match.items():
        sel = sel[sel[column] == value]
    if len(sel) != 1:
        raise KeyError(f"{len(sel)} rows for metric={metric!r} {match}; available:\n"
                       f"{df[['metric', 'dtype', 'workers', 'worker_kind']].to_string(index=False)}")
    return float(sel["value"].iloc[0])
