"""Full fine-tuning throughput and MFU on one device, one optimisation added at a time.

    python -m distlab.bench.mfu_ladder --model qwen2.5-0.5b-random --device cuda --out figures/gpu

Each rung is a fresh `python -m distlab.train` process: the rungs above it plus one change, so the
table reads as "what this change bought". Throughput is the median of real (non-pad) tokens per
second over the steps after the warm-up. MFU is model FLOPs (PaLM's count, distlab.metrics) per
second over a peak, given twice: the part's data-sheet dense peak (what papers quote) and the
matmul peak measured here a moment before (what this card, as found, can reach). A rung that fails
(out of memory, a kernel this PyTorch lacks) is a row with its error, and the ladder goes on.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import pandas as pd
import torch

from distlab.cli import finite_float, run_main
from distlab.device import measure_matmul_flops, peak_flops
from distlab.launch.process import RunFailed, python_module_cmd, run
from distlab.metrics import read_log
from distlab.paths import REPO_ROOT
from distlab.provenance import save_table, stamp

CONFIG = REPO_ROOT / "lib" / "distlab" / "configs" / "tiny_lora.yaml"
TABLE = "mfu_ladder.csv"

# (name, the change this rung adds): each rung keeps every change above it
RUNGS = (
    ("baseline: eager attention, padded rows, micro-batch 2",
     {"attn_implementation": "eager", "packing": False, "micro_batch_size": 2}),
    ("+ fused AdamW", {"fused_optimizer": True}),
    ("+ SDPA attention", {"attn_implementation": "sdpa"}),
    ("+ micro-batch 8", {"micro_batch_size": 8}),
    ("+ packing, per-document flash attention", {"packing": True, "attn_implementation": "varlen"}),
    ("+ activation checkpointing, micro-batch 16", {"activation_checkpointing": True, "micro_batch_size": 16}),
    ("+ torch.compile, block by block", {"compile": True}),
    ("- activation checkpointing (memory allows it)", {"activation_checkpointing": False}),
    # autocast casts every fp32 weight to bf16 at every use; bf16 weights skip those casts (and, here,
    # keep no fp32 master copy: a throughput rung, not a recipe for long runs)
    ("+ bf16 weights, no autocast", {"dtype": "bf16"}),
)


def rung_settings(model: str | None, device: str, dtype: str, seq_len: int, steps: int,
                  upto: int) -> dict:
    """The TrainConfig overrides of rung `upto` (0-based): the common settings, then every change so far."""
    settings = {"model": model or "null", "device": device, "dtype": dtype, "lora": False, "seq_len": seq_len,
                "max_steps": steps, "warmup_steps": 2, "lr": 1e-4, "grad_accum": 1, "logging_steps": 1,
                "eval_at_start": False, "eval_at_end": False, "save_model": False, "progress": False,
                "checkpoint_steps": 0, "resume": False, "num_threads": None}
    for _, change in RUNGS[:upto + 1]:
        settings.update(change)
    return settings


def run_rung(settings: dict, out_dir: Path, timeout_s: float) -> tuple[list[dict], dict, str]:
    """(step records, start record, error line or "") of one training process."""
    overrides = [f"{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}"
                 for k, v in {**settings, "output_dir": out_dir}.items()]
    cmd = python_module_cmd("distlab.train", "--config", str(CONFIG), *[a for o in overrides for a in ("--set", o)])
    try:
        run(cmd, timeout_s=timeout_s, echo=False, env={"TOKENIZERS_PARALLELISM": "false"})
    except RunFailed as failure:
        lines = [line for line in str(failure).splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line or "error" in line]
        # the last error line names the cause; without one (a timeout, a signal) the first line does
        return [], {}, (errors[-1] if errors else lines[0] if lines else "failed").strip()[:300]
    log = out_dir / "train_log.jsonl"
    return read_log(log), read_log(log, "start")[0], ""


def ladder(model: str | None = "qwen2.5-0.5b-random", device: str = "cuda", dtype: str = "bf16-autocast",
           seq_len: int = 1024, steps: int = 30, warmup: int = 10, rungs: int = len(RUNGS),
           timeout_s: float = 300, first: int = 0, save=None) -> pd.DataFrame:
    """Run rungs `first` .. `rungs - 1` one after another (each with every change above it); a row per
    rung. `save(table)`, if given, is called after every rung, so a ladder cut short keeps what it measured."""
    matmul_dtype = torch.bfloat16 if "bf16" in dtype else torch.float32
    measured_peak = measure_matmul_flops(device, matmul_dtype)
    sheet_peak, sheet_source = peak_flops(device, matmul_dtype)
    print(f"matmul peak measured here: {measured_peak / 1e12:.1f} TFLOP/s ({matmul_dtype}); "
          f"MFU denominator of the runs: {sheet_peak / 1e12:.1f} TFLOP/s, {sheet_source}", flush=True)
    rows = []
    for i, (name, _) in list(enumerate(RUNGS[:rungs]))[first:]:
        with tempfile.TemporaryDirectory() as tmp:
            steps_log, start, error = run_rung(rung_settings(model, device, dtype, seq_len, steps, i), Path(tmp),
                                               timeout_s)
        timed = steps_log[warmup:]
        row = {"rung": i, "change": name, "error": error}
        if timed:
            tokens_per_s = statistics.median(s["tokens_per_s"] for s in timed)
            achieved = tokens_per_s * start["flops_per_token"]
            row.update(tokens_per_s=tokens_per_s, tokens_per_s_min=min(s["tokens_per_s"] for s in timed),
                       tokens_per_s_max=max(s["tokens_per_s"] for s in timed), model_tflops=achieved / 1e12,
                       mfu_data_sheet=achieved / start["peak_flops"], mfu_measured_peak=achieved / measured_peak,
                       hfu_data_sheet=tokens_per_s * start["executed_flops_per_token"] / start["peak_flops"],
                       peak_mem_gib=max(s["peak_mem_bytes"] for s in timed) / 2**30, timed_steps=len(timed),
                       final_loss=timed[-1]["loss"])
        elif not error:
            row["error"] = f"only {len(steps_log)} steps logged, {warmup} of them warm-up"
        rows.append(row)
        shown = (f"{row['tokens_per_s']:9.0f} tokens/s  MFU {row['mfu_data_sheet']:.1%} (data sheet), "
                 f"{row['mfu_measured_peak']:.1%} (measured peak), {row['peak_mem_gib']:.1f} GiB"
                 if "tokens_per_s" in row else f"FAILED: {row['error']}")
        print(f"{name:<48} {shown}", flush=True)
        table = pd.DataFrame(rows)
        table.attrs.update(measured_peak_flops=measured_peak, data_sheet_peak_flops=sheet_peak,
                           data_sheet_source=sheet_source)
        if save:
            save(table)
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab.bench.mfu_ladder", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-0.5b-random",
                        help="random preset, HF id or folder; 'null' for the offline tiny Qwen2")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16-autocast")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per rung, warm-up included")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the median (compilation, caches)")
    parser.add_argument("--rungs", type=int, default=len(RUNGS), help="run only the first N rungs")
    parser.add_argument("--from-rung", type=int, default=0, help="start at this rung (0-based; it keeps the changes "
                        "above it)")
    parser.add_argument("--timeout", type=finite_float, default=300, help="seconds per rung before it is killed")
    parser.add_argument("--out", metavar="DIR", help=f"save {TABLE} here with a provenance sidecar")
    args = parser.parse_args(argv)
    model = None if args.model == "null" else args.model
    arguments = {k: v for k, v in vars(args).items() if k != "out"}

    def save(table):
        provenance = {**stamp(model or "distlab-tiny", 1), "benchmark": "distlab.bench.mfu_ladder",
                      "arguments": arguments, **table.attrs}
        return save_table(table, Path(args.out) / TABLE, provenance)

    table = ladder(model, args.device, args.dtype, args.seq_len, args.steps, args.warmup, args.rungs, args.timeout,
                   first=args.from_rung, save=save if args.out else None)
    print(table.drop(columns=["change"]).round(4).to_string(index=False), flush=True)
    ok = table.dropna(subset=["tokens_per_s"]) if "tokens_per_s" in table else table.iloc[:0]
    if len(ok) >= 2:
        first, best = ok.iloc[0], ok.loc[ok["mfu_data_sheet"].idxmax()]
        print(f"best rung: {best['change']}: {best['tokens_per_s'] / first['tokens_per_s']:.2f}x the first rung's "
              f"tokens/s; MFU {best['mfu_data_sheet']:.1%} of the data sheet, {best['mfu_measured_peak']:.1%} of "
              f"the measured matmul peak", flush=True)
    if args.out:
        print(f"saved {save(table)}", flush=True)
    return 0


if __name__ == "__main__":
    run_main(main, sigterm_exits=True)
