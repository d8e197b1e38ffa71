"""The DeepSpeed pipeline-vs-FSDP study's effective-token sweep, beyond chapter 04's budget.

    python -m distlab.bench.pipeline_study [--gas 2,8,32] [--seq-len 1024] [--micro 2] [--steps 4]
                                           [--strategy ds_pipeline|pipeline] [--train-file FILE]

Chapter 04 regenerates the study's table (full fine-tuning, 2 stages) up to T_eff = 4,096 tokens per step
(sequences of 256 x micro-batches of 2 x GA 8) inside its few minutes. The study went on toward ~100k
tokens per step. This runs the same rows at longer sequences and larger GA (T_eff = seq_len x micro x GA:
65,536 at the defaults' largest), the 2-stage pipeline, then FSDP on the same 2 ranks at the same tokens
per step (GA / 2 each), with the functions chapter 04 runs (distlab.pipeline_sweeps.study_table and
versus_fsdp: the two run in turn with the timeline instrument off), and prints, for each T_eff: the tokens/s of
both and their ratio, and the pipeline's bubble (from the instrumented table run) beside its formula
(p - 1)/(m + p - 1), m = GA. Each row's first steps are warm-up (distlab.results.schema.WARMUP_STEPS) and
left out. Minutes on 2 cores: each step of the largest row runs 32 micro-batches of 2,048 tokens.

The data bounds the sweep: one optimizer step takes micro x GA packed sequences of the training file, so
the bundled data (69 sequences of 1,024 tokens) allows GA <= 34 at micro 2. Larger GA needs a larger
file (--train-file, the chapters' JSONL format); a GA the file cannot fill is refused before any run.
"""

from __future__ import annotations

import argparse

import pandas as pd

from distlab import pipeline_sweeps
from distlab.cli import run_main
from distlab.data import build_sft_data
from distlab.measure.bubble import bubble_formula
from distlab.models import load_tokenizer
from distlab.paths import TRAIN_FILE
from distlab.results import schema

STAGES = 2


def sequences_in(train_file: str, seq_len: int) -> int:
    """How many packed training sequences of seq_len tokens the file gives (as the training run packs it)."""
    return len(build_sft_data(train_file, load_tokenizer(None), seq_len).items)


def sweep(gas, seq_len: int = 1024, micro: int = 2, steps: int = 4, strategy: str = "ds_pipeline",
          timeout_s: int = 3600, train_file: str = str(TRAIN_FILE)) -> pd.DataFrame:
    """One row per GA: T_eff, pipeline and FSDP tokens/s, FSDP / pipeline, the bubble against its formula."""
    base = {"seq_len": seq_len, "lr": 1e-3, "logging_steps": 1, "lora_dropout": 0.0, "eval_at_start": False,
            "pipeline_stages": STAGES, "train_file": train_file}
    dtypes = {"fp32": "fp32"}
    rows = [[micro, ga, False, "fp32"] for ga in gas]
    table = pipeline_sweeps.study_table(base, strategy, rows, STAGES, steps, seq_len, dtypes, lora=False,
                                        timeout_s=timeout_s)
    versus = pipeline_sweeps.versus_fsdp(base, table, STAGES, steps, seq_len, dtypes, lora=False, strategy=strategy,
                                         timeout_s=timeout_s)
    out = versus.set_index("pipeline GA")[["T_eff", "pipeline tokens/s", "FSDP tokens/s", "FSDP / pipeline",
                                          "pipeline bubble (measured row)"]]
    out["bubble formula"] = [bubble_formula(STAGES, int(ga)) for ga in out.index]
    return out.rename_axis("GA")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab.bench.pipeline_study",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--gas", default="2,8,32", help="GA values (even: FSDP takes GA / 2 on each rank)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--strategy", default="ds_pipeline", choices=["ds_pipeline", "pipeline"])
    parser.add_argument("--train-file", default=str(TRAIN_FILE), help="training JSONL (default: the bundled data)")
    args = parser.parse_args(argv)
    gas = [int(g) for g in args.gas.split(",")]
    if any(g % STAGES for g in gas):
        parser.error(f"--gas {args.gas}: every GA must divide by {STAGES} (FSDP runs GA / {STAGES} per rank)")
    if args.steps <= schema.WARMUP_STEPS:
        parser.error(f"--steps {args.steps}: the first {schema.WARMUP_STEPS} steps are warm-up; run more")
    sequences = sequences_in(args.train_file, args.seq_len)
    too_large = [g for g in gas if g * args.micro > sequences]
    if too_large:
        parser.error(f"--gas {args.gas}: {args.train_file} packs into {sequences} sequences of {args.seq_len} "
                     f"tokens, too few for one step at GA {too_large} x micro {args.micro}; use a larger "
                     f"--train-file or GA <= {sequences // args.micro}")
    table = sweep(gas, args.seq_len, args.micro, args.steps, args.strategy, train_file=args.train_file)
    with pd.option_context("display.width", 160):
        print(table.round(3).to_string())
    print(f"{args.strategy}, 2 stages, against FSDP on 2 ranks; full fine-tuning, fp32, sequences of {args.seq_len}, "
          f"micro-batches of {args.micro}, one thread per rank; steady steps only (warm-up left out)")
    return 0


if __name__ == "__main__":
    run_main(main, sigterm_exits=True)  # a SIGTERM kills the launched process groups too
