"""Measured pipeline bubble against its formula, and against a model with the hand-off cost, for 1F1B
and interleaved 1F1B (and GPipe with `--schedules gpipe,1f1b,interleaved`).

    python -m distlab.bench.pipeline_bubble [--ms 1,2,4,8] [--steps 6] [--rounds 3] [--model balanced|tiny|PATH]

The formulas, for p stages (ranks), m micro-batches and equal stages with free hand-offs:
* GPipe and 1F1B: (p - 1) / (m + p - 1);
* interleaved 1F1B, v model chunks per rank (here v = 2: torch's ScheduleInterleaved1F1B over the model
  cut into 2p chunks, rank r holding chunks r and r + p): (p - 1) / (v m + p - 1). Each chunk's forward
  and backward take 1/v of a stage's, so the fill and the drain (p - 1 chunk slots) shrink v times while
  the work (v m chunk slots) stays; Megatron-LM's paper (Narayanan et al., 2021) writes the same
  bubble as (1/v)(p - 1)/m of the ideal step time.

One 2-rank run per (schedule, m) through the training loop (strategy "pipeline", one rank and one
thread per stage, gloo on CPU), with the timeline recorded (measure_comm), all runs in one launch;
`--rounds` launches repeat the whole sweep (the schedules alternate within a launch, in reverse
order every other round), and the table gives the median over rounds with the min-max spread.
Per step, every stage's idle fraction is 1 - (its forward+backward time) / (the step's span, first
op start to last op end over all stages); the bubble is the mean over stages, the median over the
steady-state steps. See distlab.measure.bubble for the definitions and models, distlab.pipeline_sweeps
for the sweep (the one chapter 04's notebook runs).

Two predictions beside the measurement:
* theory: the formula above, equal stages and free hand-offs;
* hand-off model: 1 - m t / ((m+p-1)(t+h)) (interleaved: m -> v m, t -> t/v, h -> h/v), with t the
  compute and h the hand-off per micro-batch measured from the same timeline (h: a stage's time that
  is neither compute nor waiting for its peer: the receiver's copy of the message, posting send and
  receive, the schedule's Python).
  Its excess over the theory, m h / ((m+p-1)(t+h)), grows with m towards h / (t+h): at large m a
  hand-off a few percent of t is most of the gap to the theory. `cost model` adds the measured
  imbalance (per-stage t).

When the theory applies: equal stages and h small against t. The defaults aim there: the
"balanced" model (a random-init copy of the tiny Qwen2 with a 4096-wide FFN, so that the LM head
and loss, which only the last stage carries, are a small part of a stage) and micro-batches of
`--micro-batch-size` 8 rows (the compute per micro-batch doubles against 4 rows; the Python part of
the hand-off does not). The report prints both conditions as measured (h/(t+h) and the largest
stage imbalance); the check is |median measured - theory| <= tolerance for m >= 2, and the
hand-off model is checked the same way. `--model tiny` runs the default model, whose last stage
is ~20% heavier: there the theory does not apply, and the cost model shows why.
The machine's load average is printed before and after: other processes on a 2-core machine
steal time from one stage and show up as extra idle time on the other.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from distlab import markdown
from distlab.cli import finite_float, run_main
from distlab.measure.bubble import formula_text
from distlab.models import balanced_bench_model
from distlab.pipeline_sweeps import bubble_sweep, over_rounds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab.bench.pipeline_bubble",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--ms", default="1,2,4,8", help="micro-batches per step to sweep")
    parser.add_argument("--schedules", default="1f1b,interleaved")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3, help="launches of the whole sweep; the median is checked")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--model", default="balanced", help="balanced | tiny | an HF id or folder")
    parser.add_argument("--tolerance", type=finite_float, default=0.05, help="|measured - theory| allowed for m >= 2")
    parser.add_argument("--timeout-s", type=int, default=1800, help="per launch (one round)")
    parser.add_argument("--runs-dir", default=None, help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 2:
        parser.error("--rounds must be >= 1 and --steps >= 2 (the first step is warm-up)")
    model = {"balanced": balanced_bench_model, "tiny": lambda: None}.get(args.model, lambda: args.model)()
    ms = [int(x) for x in args.ms.split(",")]
    print(f"model: {model or 'distlab-tiny'}; micro-batch {args.micro_batch_size} x {args.seq_len} tokens; "
          f"{args.rounds} round(s); load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        runs = bubble_sweep(ms, args.schedules.split(","), model=model, micro_batch_size=args.micro_batch_size,
                            seq_len=args.seq_len, steps=args.steps, runs_dir=Path(args.runs_dir or tmp),
                            prefix="bench", echo=True, rounds=args.rounds, timeout_s=args.timeout_s)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    df = over_rounds(runs)
    df["handoff_share"] = df["handoff_ms"] / (df["compute_ms"] + df["handoff_ms"])
    df["formula"] = [formula_text(v) for v in df["v"]]
    cols = ["m", "schedule", "schedule_run", "formula", "rounds", "measured", "measured_min", "measured_max", "theory",
            "model_handoff", "model_costs", "compute_ms", "handoff_ms", "handoff_share", "imbalance"] + \
        [c for c in df.columns if c.startswith("idle_stage")]
    print(markdown.table(df[cols].round(3), floatfmt="g"))
    checked = df[df["m"] >= 2]
    if not len(checked):
        print("no m >= 2 to check")
        return 0
    worst = float(checked["abs_diff"].max())
    worst_model = float((checked["measured"] - checked["model_handoff"]).abs().max())
    worst_costs = float((checked["measured"] - checked["model_costs"]).abs().max())
    print(f"conditions: hand-off h/(t+h) up to {checked['handoff_share'].max():.3f}, stage imbalance "
          f"(slowest / mean - 1) up to {checked['imbalance'].max():.3f}")
    print(f"largest |measured - hand-off model| for m >= 2: {worst_model:.3f}; "
          f"|measured - cost model|: {worst_costs:.3f}")
    for schedule, g in checked.groupby("schedule", sort=False):
        print(f"{schedule}: largest |measured - theory| for m >= 2: {float(g['abs_diff'].max()):.3f}")
    ok = worst <= args.tolerance
    print(f"largest |measured - theory| for m >= 2: {worst:.3f} (tolerance {args.tolerance}, median of "
          f"{args.rounds} round(s)) -> {'OK' if ok else 'OVER'}")
    return 0 if ok else 1


if __name__ == "__main__":
    run_main(main, sigterm_exits=True)  # a SIGTERM kills the launched process groups too
