"""Worker: each rank times forward+backward of the run's model on its own host; rank 0 prints the split.

    torchrun ... -m distlab.lan.calibrate --out shares.json [--rows 4 --iters 4 --set seq_len=128 ...]

No gradient sync: what is measured is each host's compute alone (its CPU share), in rows per second,
after one warm-up pass. The shares (proportional to speed) go to TrainConfig.rank_shares.
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distlab import faults
from distlab.batching import rows_per_rank, shares_from_throughput
from distlab.cli import run_main
from distlab.config import load_config, parse_override
from distlab.data import model_inputs
from distlab.launch.local import TINY_CONFIG
from distlab.prepare import prepare_run
from distlab.strategies.single import SingleDevice
from distlab.workers import write_result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--config", default=str(TINY_CONFIG))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--rows", type=int, default=4, help="rows per timed forward+backward")
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--global-rows", type=int, default=12, help="global batch whose split is printed")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, dict(parse_override(s) for s in args.set))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.collective_timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        torch.set_num_threads(1)
        choice, _, train_data, _, model = prepare_run(cfg, SingleDevice())
        model.train()
        faults.install_slowdown(model)  # an emulated slow device (DISTLAB_SLOWDOWN) is slow here too
        batch = model_inputs(train_data.batch(list(range(args.rows))), choice.device)
        model(**batch).backward()  # warm-up: allocations, first-call overheads
        t0 = time.perf_counter()
        for _ in range(args.iters):
            model(**batch).backward()
        rate = torch.tensor([args.rows * args.iters / (time.perf_counter() - t0)], dtype=torch.float64)
        rates = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(rates, rate)
        speeds = [float(r) for r in rates]
        if rank == 0:
            shares = shares_from_throughput(speeds)
            split = rows_per_rank(args.global_rows, shares, world)
            print("calibration: rows/s per rank " + ", ".join(f"{s:.2f}" for s in speeds), flush=True)
            print(f"calibration: shares {shares}; a global batch of {args.global_rows} rows splits {split} "
                  f"(naive {rows_per_rank(args.global_rows, [1] * world, world)})", flush=True)
            write_result(args.out, {"rows_per_s": speeds, "shares": shares, "global_rows": args.global_rows,
                                    "split": split})
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
