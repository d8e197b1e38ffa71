"""Measured pipeline bubble against (p - 1) / (m + p - 1), for GPipe and 1F1B.

    python -m distlab.bench.pipeline_bubble [--ms 1,2,4,8] [--steps 6] [--model balanced|tiny|PATH]

One 2-stage run per (schedule, m) through the training loop (strategy "pipeline", one rank and one
thread per stage, gloo on CPU), with the timeline recorded (measure_comm), all runs in one launch.
Micro-batches of 4 rows by default: every stage-to-stage hand-off costs a few milliseconds that the
theory does not know about (posting the send and receive, the Python between two ops), and with 2
rows those add up to ~0.05 of a step at m = 8; 4 rows halve their share. Per step, every
stage's idle fraction is 1 - (its forward+backward time) / (the step's span, first op start to
last op end over all stages); the bubble is the mean over stages, and the table shows the
median over the steady-state steps (the first `--skip-steps` left out). See
distlab.measure.bubble for the definitions.

The default model ("balanced") is a random-init copy of the tiny Qwen2 with a 4096-wide FFN, so
that the LM head and loss, which only the last stage carries, are a small part of a stage (the last
stage measures ~8% slower per micro-batch) and the two stages are close to the equal stages the theory
assumes. `--model tiny` runs the default tiny model, whose last stage is ~20% heavier: the lighter
stage then idles well above the theory.
The machine's load average is printed before and after: other processes on a 2-core machine
steal time from one stage and show up as extra idle time on the other.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from distlab.cli import run_main
from distlab.measure.bubble import balanced_bench_model, bubble_sweep


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab.bench.pipeline_bubble",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--ms", default="1,2,4,8", help="micro-batches per step to sweep")
    parser.add_argument("--schedules", default="gpipe,1f1b")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--model", default="balanced", help="balanced | tiny | an HF id or folder")
    parser.add_argument("--tolerance", type=float, default=0.05, help="|measured - theory| allowed for m >= 2")
    args = parser.parse_args(argv)
    model = {"balanced": balanced_bench_model, "tiny": lambda: None}.get(args.model, lambda: args.model)()
    ms = [int(x) for x in args.ms.split(",")]
    print(f"model: {model or 'distlab-tiny'}; load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        df = bubble_sweep(ms, args.schedules.split(","), model=model, micro_batch_size=args.micro_batch_size,
                          seq_len=args.seq_len, steps=args.steps, runs_dir=Path(tmp),
                          prefix="bench", echo=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    cols = ["m", "schedule", "schedule_run", "measured", "theory", "abs_diff"] + \
        [c for c in df.columns if c.startswith("idle_stage")] + ["pipeline_span_s", "comm_time_s"]
    print(df[cols].round(3).to_markdown(index=False))
    checked = df[df["m"] >= 2]
    worst = float(checked["abs_diff"].max()) if len(checked) else 0.0
    ok = worst <= args.tolerance
    print(f"largest |measured - theory| for m >= 2: {worst:.3f} (tolerance {args.tolerance}) "
          f"-> {'OK' if ok else 'OVER'}")
    return 0 if ok else 1


if __name__ == "__main__":
    run_main(main)
