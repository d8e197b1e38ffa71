"""2-rank DDP efficiency against the 1-rank baseline, measured side by side.

    python -m distlab.bench.ddp_scaling [--steps 40] [--rounds 2]

Both runs use one thread per rank (the 1-rank baseline too: two threads on a 2-core machine
would make it a different program), the same global batch (so 1 rank accumulates twice as many
micro-batches), the same data and seed. Rounds alternate 1 and 2 ranks so that machine noise
hits both alike; the median of each one's tokens_per_s is compared. Every number is a column of
distlab.results.schema (steady state after schema.WARMUP_STEPS, the slowest rank's step time):
scaling_efficiency = tokens_per_s(2) / (2 x tokens_per_s(1)).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from distlab.cli import run_main
from distlab.launch.jobs import launch_training
from distlab.results import schema


def measure(steps: int = 40, rounds: int = 2, micro_batch_size: int = 2, global_batch_size: int = 8,
            world_sizes=(1, 2)) -> dict[int, list[float]]:
    """world size -> tokens_per_s of each round."""
    if steps <= schema.WARMUP_STEPS:
        raise ValueError(f"--steps {steps}: the first {schema.WARMUP_STEPS} steps are warm-up; run more")
    overrides = {"strategy": "ddp", "max_steps": steps, "micro_batch_size": micro_batch_size,
                 "global_batch_size": global_batch_size, "logging_steps": 1, "eval_file": None,
                 "save_model": False}
    tps: dict[int, list[float]] = {k: [] for k in world_sizes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for k in world_sizes:
                job = launch_training(f"bench_ws{k}", k, overrides, runs_dir=Path(tmp), echo=False)
                tps[k].append(schema.summarise_logs(job.log)["tokens_per_s"])
                print(f"round {r + 1}/{rounds}  world_size {k}: tokens_per_s {tps[k][-1]:8.0f}", flush=True)
    return tps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab.bench.ddp_scaling", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    tps = measure(args.steps, args.rounds)
    one, two = statistics.median(tps[1]), statistics.median(tps[2])
    print(f"median tokens_per_s: world_size 1 {one:.0f}, world_size 2 {two:.0f} "
          f"(warm-up: first {schema.WARMUP_STEPS} steps left out)")
    print(f"speedup {two / one:.2f}, scaling_efficiency {two / (2 * one):.2f} (target >= 0.90)")
    return 0


if __name__ == "__main__":
    run_main(main)
