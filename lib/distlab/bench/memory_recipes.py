"""The QLoRA memory ladder: bf16 LoRA -> 4-bit NF4 base -> + 8-bit AdamW -> + activation checkpointing,
each rung's bytes measured against the planner's and its tokens/s against bf16 LoRA, side by side.

    python -m distlab.bench.memory_recipes [--steps 12] [--rounds 3] [--model tiny|<folder>|<preset>]

Memory: one real optimizer step per rung, built as distlab.train builds it (distlab.step_memory.memory_ladder:
weights with bitsandbytes' constants, adapters, gradients, optimizer state, the activations autograd saved), next
to distlab.planning.plan.plan_memory for the same settings (chapter 01 shows the same table).
Throughput: each round runs every rung back to back in one process (distlab.launch.local.launch_sweep, one
thread), the order rotated from round to round so that a slow minute of a shared machine hits every rung
alike; a rung's speed is its tokens/s over bf16 LoRA's in the same round (steady state after
distlab.results.schema.WARMUP_STEPS), the median and the spread over the rounds printed. The first round also
evaluates the held-out loss after its steps.

Two planned components differ from the measurement by definition, not by error: under bf16 storage PEFT's fp32
adapters save fp32 copies of their inputs, which the planner's 2 bytes per activation value leave out, and with
checkpointing the layer recomputed during backward exists only then, while the measurement counts what the
forward saves.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import pandas as pd

from distlab import markdown
from distlab.cli import run_main
from distlab.config import TrainConfig
from distlab.launch.local import launch_sweep
from distlab.metrics import read_log
from distlab.results import scaling_table, schema
from distlab.step_memory import LADDER, memory_ladder

# Each rung adds one change to the previous one (all LoRA, bf16 storage: no autocast on a CPU).
RUNGS = {"bf16 LoRA": {}, **LADDER}
SETUP = {"dtype": "bf16", "device": "cpu", "micro_batch_size": 4, "seq_len": 256, "lora_dropout": 0.0,
         "logging_steps": 1, "eval_at_start": False, "eval_at_end": False, "save_model": False, "num_threads": 1}


def throughput(steps: int = 12, rounds: int = 3, overrides: dict | None = None, rungs=RUNGS,
               runs_dir: Path | None = None, timeout_s: int = 1800, progress=print) -> pd.DataFrame:
    """One row per rung: median tokens/s, its ratio to bf16 LoRA's in the same round (median, min, max over
    rounds), and the held-out loss after `steps` (first round)."""
    if steps <= schema.WARMUP_STEPS:
        raise ValueError(f"--steps {steps}: the first {schema.WARMUP_STEPS} steps are warm-up; run more")
    runs_dir = runs_dir or Path(tempfile.mkdtemp(prefix="memory_recipes_"))
    names = list(rungs)
    slug = {name: f"rung{i}" for i, name in enumerate(names)}
    speed: dict[str, list[float]] = {n: [] for n in names}
    ratio: dict[str, list[float]] = {n: [] for n in names}
    eval_loss: dict[str, float] = {}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # rotated: no rung always first or last
        variants = {f"mem_{slug[n]}_r{r + 1}": {**rungs[n], "eval_at_end": r == 0} for n in order}
        jobs = launch_sweep(f"memory_recipes_r{r + 1}", 1, {**SETUP, **(overrides or {}), "max_steps": steps},
                            variants, timeout_s=timeout_s, runs_dir=runs_dir, echo=False)
        got = {n: scaling_table.run_summary(jobs[f"mem_{slug[n]}_r{r + 1}"].log)["tokens_per_s"] for n in names}
        for n in names:
            speed[n].append(got[n])
            ratio[n].append(got[n] / got[names[0]])
            if r == 0:
                evals = read_log(jobs[f"mem_{slug[n]}_r1"].log, event="eval")
                eval_loss[n] = evals[-1]["eval_loss"] if evals else float("nan")
        if progress:
            progress(f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {got[n]:.0f} tok/s" for n in order))
    return pd.DataFrame([{"rung": n, "tokens_per_s": statistics.median(speed[n]),
                          "vs bf16 LoRA": statistics.median(ratio[n]), "ratio_min": min(ratio[n]),
                          "ratio_max": max(ratio[n]), f"held-out loss after {steps} steps": eval_loss[n]}
                         for n in names]).set_index("rung")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab.bench.memory_recipes",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="tiny (default), a model folder, or a random preset")
    args = parser.parse_args(argv)
    model = None if args.model in (None, "tiny") else args.model
    base = TrainConfig(**{**SETUP, "model": model})
    mem = memory_ladder(base, first_name="bf16 LoRA")
    print(f"memory of one optimizer step, measured vs planned (MiB), {model or 'distlab-tiny'}, micro-batch "
          f"{base.micro_batch_size} x {base.seq_len} tokens")
    print(markdown.table(mem.round(3)))
    with tempfile.TemporaryDirectory() as tmp:
        speed = throughput(args.steps, args.rounds, {"model": model}, runs_dir=Path(tmp))
    print(f"tokens/s relative to bf16 LoRA, median (min-max) over {args.rounds} alternating rounds, one thread")
    print(markdown.table(speed.round(3).reset_index()))
    return 0


if __name__ == "__main__":
    run_main(main, sigterm_exits=True)  # a SIGTERM kills the launched process groups too
