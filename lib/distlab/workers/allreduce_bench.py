"""All-reduce bandwidth over a message-size sweep, reported like nccl-tests.

    torchrun --standalone --nproc-per-node 2 -m distlab.workers.allreduce_bench --out ar.json

For each size every rank all-reduces the same buffer `iters` times between two barriers; the
time of the slowest rank counts (a collective is only done when everyone is). Then

    algbw = bytes / time                  what the caller sees
    busbw = algbw * 2 * (n - 1) / n       what each link carried in a ring all-reduce

busbw does not depend on the number of ranks for an ideal ring, so it can be compared with the
hardware's link bandwidth and across world sizes. gloo on CPU, nccl on GPU (--backend auto:
distlab.device.backend_for; the launcher, distlab.measure.limits, picks gloo when GPUs are too few).

Rank 0 also logs the wall-clock time (time.time()) of its phases, `phases` in the JSON: the process
start, imports done, process group ready, and each size's start and end. Chapter 00 shades them on
the utilisation timeline that UtilizationSampler records around the run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from distlab.cli import finite_float, run_main
from distlab.device import backend_for
from distlab.measure.limits import size_text
from distlab.workers import write_result

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bus_factor(world_size: int) -> float:
    """Bytes a ring all-reduce moves per link, per byte of the message: 2(n-1)/n."""
    return 2 * (world_size - 1) / world_size


class Collective:
    """The process group plus the device and sync that make host timers honest on a GPU."""

    def __init__(self, backend: str):
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.backend = backend_for("auto") if backend == "auto" else backend
        if self.backend == "nccl":
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
        dist.init_process_group(self.backend, timeout=datetime.timedelta(seconds=300))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def sync(self) -> None:
        if self.device.type == "cuda":  # kernels are asynchronous: wait before reading the clock
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        self.sync()
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.local_rank])
        else:
            dist.barrier()

    def slowest(self, seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())


def check_sum(comm: Collective, buf: torch.Tensor) -> None:
    """A wrong result would make every bandwidth number meaningless: verify once per size."""
    buf.fill_(comm.rank + 1)
    dist.all_reduce(buf)
    expected = comm.world * (comm.world + 1) / 2
    if not torch.all(buf == expected):
        raise RuntimeError(f"all_reduce gave {buf[0].item()} on rank {comm.rank}, expected {expected}")
    buf.zero_()  # zeros stay zeros: repeated sums cannot overflow to inf


def time_size(comm: Collective, nbytes: int, dtype: torch.dtype, warmup: int,
              seconds: float, min_iters: int, max_iters: int) -> dict:
    elem = torch.tensor([], dtype=dtype).element_size()
    buf = torch.empty(max(1, nbytes // elem), dtype=dtype, device=comm.device)
    nbytes = buf.numel() * elem
    check_sum(comm, buf)
    dist.all_reduce(buf)  # first use of a size may set up buffers: keep it out of every timing
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(max(1, warmup)):  # the warm-up doubles as the estimate of one op's time
        dist.all_reduce(buf)
    comm.sync()
    one = comm.slowest(time.perf_counter() - t0) / max(1, warmup)
    # Same value on every rank (it was reduced), so every rank runs the same number of ops.
    iters = int(min(max_iters, max(min_iters, seconds / max(one, 1e-7))))
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    comm.sync()
    per_op = comm.slowest(time.perf_counter() - t0) / iters
    algbw = nbytes / per_op
    return {"size_bytes": nbytes, "count": buf.numel(), "iters": iters, "time_us": per_op * 1e6,
            "algbw_GBps": algbw / 1e9, "busbw_GBps": algbw * bus_factor(comm.world) / 1e9}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="JSON written by rank 0")
    ap.add_argument("--sizes-kib", default="4,16,64,256,1024,4096,16384,65536",
                    help="comma-separated message sizes in KiB")
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seconds-per-size", type=finite_float, default=0.25, help="timed budget per size")
    ap.add_argument("--min-iters", type=int, default=3)
    ap.add_argument("--max-iters", type=int, default=1000)
    args = ap.parse_args(argv)

    imported = time.time()  # python started and torch imported: the first seconds of every rank
    comm = Collective(args.backend)
    phases = [{"label": "python, import torch", "start": psutil.Process().create_time(), "end": imported},
              {"label": "rendezvous", "start": imported, "end": time.time()}]
    print(f"allreduce_bench: rank {comm.rank}/{comm.world} pid {os.getpid()} "
          f"backend {comm.backend} device {comm.device}", flush=True)
    try:
        results = []
        if comm.rank == 0:
            print(f"{'size(B)':>12} {'count':>10} {'iters':>6} {'time(us)':>10} "
                  f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12}", flush=True)
        for kib in (float(s) for s in args.sizes_kib.split(",") if s.strip()):
            started = time.time()
            r = time_size(comm, int(kib * 1024), DTYPES[args.dtype], args.warmup,
                          args.seconds_per_size, args.min_iters, args.max_iters)
            results.append(r)
            phases.append({"label": size_text(r["size_bytes"]), "start": started, "end": time.time()})
            if comm.rank == 0:
                print(f"{r['size_bytes']:>12} {r['count']:>10} {r['iters']:>6} {r['time_us']:>10.1f} "
                      f"{r['algbw_GBps']:>12.3f} {r['busbw_GBps']:>12.3f}", flush=True)
        if comm.rank == 0:
            write_result(args.out, {"backend": comm.backend, "world_size": comm.world, "device": str(comm.device),
                                    "dtype": args.dtype, "bus_factor": bus_factor(comm.world), "results": results,
                                    "phases": phases})
        comm.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
