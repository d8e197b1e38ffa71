"""Full fine-tuning throughput and MFU on one device, one optimisation added at a time.

    python -m distlab.bench.mfu_ladder --device cuda --out figures/gpu                 # qwen2.5-0.5b-random
    python -m distlab.bench.mfu_ladder --device cuda --preset-row d20 --out build/d20  # nanochat d20's shape

A rung is one fresh `python -m distlab.train` process: the settings of the rungs above it plus one change, so
the table reads as "what this change bought". Rungs 0-4 are the ladder as first measured (2026-11-26); rung 4,
its best, is the reference of the rungs after it: whole-block compile, chunked cross entropy, a larger step,
bf16 weights with an fp32 master copy. Each rung logs into `<out>/rungN/` as it runs: the training run's
output_dir (train_log.jsonl, one record a step) and stdout.log, the process's stdout and stderr, streamed.
So a rung killed at its time box (`--timeout`) keeps what it logged, and its row says after which step it
stopped. A rung whose box is more than what is left of the ladder's `--budget` is skipped, with a row saying
so. A compiled rung runs with TORCH_LOGS=recompiles and DISTLAB_COMPILE_STRICT=1 (a recompile after the
warm-up is an error): it fails in seconds, and its row names the recompile and the guard that caused it.

Throughput is the median of real (non-pad) tokens per second over the steps after the warm-up. MFU is model
FLOPs (PaLM's count, distlab.metrics) per second over a peak, given twice: the part's data-sheet dense peak
(what papers quote) and the matmul peak measured here a moment before (what this card, as found, can reach).
The LM head counts only at labelled tokens, so each row shows the labelled fraction, the row length and the
tokens of a step beside its MFU: `--labels all` (the d20 row) trains on documents as long as a row with the
loss on every token (TrainConfig labels="all", distlab.data), as pretraining does. A rung that fails (out of
memory, a kernel this PyTorch lacks) is a row with its error, and the ladder goes on.
"""

from __future__ import annotations

import argparse
import math
import re
import shutil
import statistics
import time
from pathlib import Path

import pandas as pd
import torch

from distlab.cli import finite_float, run_main
from distlab.data import LABEL_POLICIES, load_jsonl
from distlab.device import measure_matmul_flops, peak_flops
from distlab.jsonio import strict_json
from distlab.launch.process import python_module_cmd, run
from distlab.metrics import read_log
from distlab.paths import REPO_ROOT, RUNS_DIR
from distlab.provenance import save_table, stamp
from distlab.tiny_base import PRETRAIN_FILE

CONFIG = REPO_ROOT / "lib" / "distlab" / "configs" / "tiny_lora.yaml"
TABLE = "mfu_ladder.csv"
STDOUT_LOG = "stdout.log"  # in each rung's folder, beside the training run's own train_log.jsonl
LONG_DOCUMENTS_FILE = "long_documents.jsonl"  # --labels all: the training rows, written into the output folder
# A compiled rung: each recompile logged (with the guard that failed), and one after the warm-up an error
# (distlab.strategies.base.compile_layers): a block that recompiles at every step would otherwise run out its
# time box compiling, with nothing in its row to say why.
COMPILE_ENV = {"TORCH_LOGS": "recompiles", "DISTLAB_COMPILE_STRICT": "1"}

# (name, the change this rung adds): each rung keeps every change above it
RUNGS = (
    ("baseline: eager attention, padded rows, micro-batch 2",
     {"attn_implementation": "eager", "packing": False, "micro_batch_size": 2}),
    ("+ fused AdamW", {"fused_optimizer": True}),
    ("+ SDPA attention", {"attn_implementation": "sdpa"}),
    ("+ micro-batch 8", {"micro_batch_size": 8}),
    # the best rung of the ladder as it was (49k tokens/s on an H100, 2026-11-26): the reference of those below,
    # with its loss as then (cross_entropy=plain, from rung_settings) and no compile
    ("+ packing, per-document flash attention", {"packing": True, "attn_implementation": "varlen"}),
    ("+ torch.compile, whole blocks (fullgraph)", {"compile": True}),
    # the logits of a slice of labelled rows at a time: the fp32 tokens x vocabulary matrix never exists whole
    ("+ chunked cross entropy", {"cross_entropy": "chunked"}),
    # twice the tokens per optimizer step, in one micro-batch (not two accumulated): the kernels get larger
    # matmuls, and the optimizer's step and the step's fixed costs are spread over twice the tokens
    ("+ micro-batch 16", {"micro_batch_size": 16}),
    # autocast casts every fp32 weight to bf16 at every use; bf16 weights skip those casts, and the optimizer
    # steps an fp32 copy of each, so updates smaller than bf16's resolution still add up
    ("+ bf16 weights, fp32 master copy", {"dtype": "bf16", "master_weights": True}),
)
REFERENCE_RUNG = 4  # where tools/gpu_session.sh starts (--from-rung): the reference and the four changes after it

# --preset-row: a model, its row length and what is labelled, as one name (each field can be given on its own)
PRESET_ROWS = {
    "qwen0.5b": {"model": "qwen2.5-0.5b-random", "seq_len": 1024, "labels": "replies"},
    # nanochat's d20 as it pretrains: 2,048-token rows, the loss at every token
    "d20": {"model": "nanochat-d20-random", "seq_len": 2048, "labels": "all"},
}

COLUMNS = ("rung", "change", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "model_tflops",
           "mfu_data_sheet", "mfu_measured_peak", "hfu_data_sheet", "label_fraction", "seq_len", "tokens_per_step",
           "peak_mem_gib", "timed_steps", "final_loss", "recompiles", "error", "log")


def rung_settings(model: str | None, device: str, dtype: str, seq_len: int, steps: int,
                  upto: int, train_file: str | None = None, labels: str = "replies") -> dict:
    """The TrainConfig overrides of rung `upto` (0-based): the common settings, then every change so far.
    `train_file`: the training rows (None: TrainConfig's, the support set); `labels`: TrainConfig's."""
    settings = {"model": model or "null", "device": device, "dtype": dtype, "lora": False, "seq_len": seq_len,
                "max_steps": steps, "warmup_steps": 2, "lr": 1e-4, "grad_accum": 1, "logging_steps": 1,
                "eval_at_start": False, "eval_at_end": False, "save_model": False, "progress": False,
                "checkpoint_steps": 0, "resume": False, "num_threads": None,
                # the loss as every rung up to the reference measured it (TrainConfig's default is now chunked)
                "cross_entropy": "plain", "labels": labels}
    if train_file is not None:
        settings["train_file"] = train_file
    for _, change in RUNGS[:upto + 1]:
        settings.update(change)
    return settings


def long_documents_file(path: Path, seq_len: int, rows: int = 32) -> Path:
    """Training rows of one document each, as long as a pretraining corpus's and longer than `seq_len` tokens
    (which the trainer truncates them to), written to `path`: a two-word prompt, then helpdesk text (the
    pretraining corpus's replies end to end). Packed support rows would put several short documents in a row,
    so attention would span a fraction of it; here it spans the whole row, as in pretraining."""
    replies = [m["content"] for conv in load_jsonl(PRETRAIN_FILE) for m in conv.messages if m["role"] == "assistant"]
    wanted = 8 * seq_len  # characters: a token of the default tokenizer is ~4.5 of them here: 1.8 times enough
    lines, at = [], 0
    for _ in range(rows):  # 32 rows: two optimizer steps' worth at micro-batch 16
        text: list[str] = []
        while sum(map(len, text)) < wanted:
            text.append(replies[at % len(replies)])
            at += 1
        lines.append(strict_json({"prompt": "Go on.", "response": " ".join(text)}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


# what torch's logging puts before each line of a message: "V1129 20:28:44.941000 19048 torch/_dynamo/guards.py:5396]
# [0/1] [__recompiles] "
TORCH_LOG_PREFIX = re.compile(r"^[DIVWEC]\d{4} [\d:.]+ \d+ \S+\] (?:\[[^\]]*\] )*")


def recompile_reason(text: str) -> str:
    """The first recompile a log names, with the guard that failed (TORCH_LOGS=recompiles prints "Recompiling
    function forward in <file>:<line>", "triggered by the following guard failure(s):", then "- 0/0: <guard>"),
    else the first line that mentions recompiling (a recompile limit hit); "" when none does."""
    lines = [TORCH_LOG_PREFIX.sub("", line).strip() for line in text.splitlines()]
    for i, line in enumerate(lines):
        if line.startswith("Recompiling function"):
            guard = next((g for g in lines[i + 1:i + 4] if re.match(r"- \d+/\d+: ", g)), "")
            return f"{line}; {guard}" if guard else line
    return next((line for line in lines if "recompil" in line.lower()), "")


def stopped_at(steps_logged: list[dict], total: int) -> str:
    """Where a run stopped, by the last step it logged (every step logs, logging_steps=1)."""
    return f"after step {steps_logged[-1]['step']} of {total}" if steps_logged else f"before step 1 of {total}"


def run_rung(settings: dict, rung_dir: Path, timeout_s: float, log_name: str) -> tuple[list[dict], dict, str, int]:
    """(step records, start record, error line or "", recompiles logged) of one training process, which logs
    into `rung_dir` as it runs (`log_name`: how the row names its stdout log)."""
    shutil.rmtree(rung_dir, ignore_errors=True)  # a log left by an earlier ladder would read as this rung's
    rung_dir.mkdir(parents=True)
    overrides = [f"{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}"
                 for k, v in {**settings, "output_dir": rung_dir}.items()]
    cmd = python_module_cmd("distlab.train", "--config", str(CONFIG), *[a for o in overrides for a in ("--set", o)])
    compiled = bool(settings.get("compile"))
    env = {"TOKENIZERS_PARALLELISM": "false", **(COMPILE_ENV if compiled else {})}
    # its own process group, killed as one at the time box; every line streamed to the file as it comes
    result = run(cmd, timeout_s=timeout_s, log_path=rung_dir / STDOUT_LOG, echo=False, check=False, env=env)
    log = rung_dir / "train_log.jsonl"
    steps_log = read_log(log) if log.exists() else []
    starts = read_log(log, "start") if log.exists() else []
    text = (rung_dir / STDOUT_LOG).read_text(errors="replace")
    recompiles = text.count("[__recompiles] Recompiling function")  # TORCH_LOGS' line, once per recompile
    if result.ok:
        return steps_log, starts[0] if starts else {}, "", recompiles
    where = stopped_at(steps_log, settings["max_steps"])
    reason = recompile_reason(text) if compiled else ""
    if result.timed_out:
        last = next((line.strip() for line in reversed(result.tail) if line.strip()), "")
        # before its first step, what it was doing (loading, compiling) is the best clue there is
        why = (f", recompiling: {reason}" if reason else
               f" (last output: {last[:120]})" if last and not steps_log else "")
        error = f"killed at its {timeout_s:g}-s box {where}{why}; log: {log_name}"
    else:
        lines = [line.strip() for line in result.tail if line.strip()]
        errors = [line for line in lines if "Error" in line or "error" in line]
        # the recompile, or the last error line (the cause); without either, the last line and the exit code
        cause = reason or (errors[-1] if errors else f"exited with code {result.returncode}"
                           + (f" ({lines[-1][:200]})" if lines else ""))
        error = f"{cause[:300]} ({where})"
    return steps_log, starts[0] if starts else {}, error, recompiles


def ladder(model: str | None = "qwen2.5-0.5b-random", device: str = "cuda", dtype: str = "bf16-autocast",
           seq_len: int = 1024, steps: int = 30, warmup: int = 10, rungs: int = len(RUNGS),
           timeout_s: float = 120, first: int = 0, save=None, *, out_dir: str | Path | None = None,
           budget_s: float | None = None, labels: str = "replies") -> pd.DataFrame:
    """Run rungs `first` .. `rungs - 1` one after another (each with every change above it); a row per
    rung. Rung N logs into `out_dir`/rungN (default: build/runs/mfu_ladder). `budget_s`: seconds for the
    whole ladder, from this call (the peak measurement included); a rung whose `timeout_s` is more than
    what is left is skipped. `save(table)`, if given, is called after every rung, so a ladder cut short
    keeps what it measured."""
    t0 = time.monotonic()
    if labels not in LABEL_POLICIES:
        raise ValueError(f"labels={labels!r}: one of {', '.join(LABEL_POLICIES)}")
    out_dir = Path(out_dir) if out_dir is not None else RUNS_DIR / "mfu_ladder"
    out_dir.mkdir(parents=True, exist_ok=True)
    train_file = str(long_documents_file(out_dir / LONG_DOCUMENTS_FILE, seq_len)) if labels == "all" else None
    matmul_dtype = torch.bfloat16 if "bf16" in dtype else torch.float32
    measured_peak = measure_matmul_flops(device, matmul_dtype)
    sheet_peak, sheet_source = peak_flops(device, matmul_dtype)
    print(f"matmul peak measured here: {measured_peak / 1e12:.1f} TFLOP/s ({matmul_dtype}); "
          f"MFU denominator of the runs: {sheet_peak / 1e12:.1f} TFLOP/s, {sheet_source}", flush=True)
    rows = []
    table = pd.DataFrame(columns=list(COLUMNS))
    for i, (name, _) in list(enumerate(RUNGS[:rungs]))[first:]:
        row = {"rung": i, "change": name, "error": ""}
        left = budget_s - (time.monotonic() - t0) if budget_s is not None else math.inf
        if timeout_s > left:
            row["error"] = (f"skipped: its {timeout_s:g}-s box is more than the {max(left, 0):.0f} s left of the "
                            f"ladder's {budget_s:g}-s budget")
        else:
            settings = rung_settings(model, device, dtype, seq_len, steps, i, train_file, labels)
            log_name = f"rung{i}/{STDOUT_LOG}"
            steps_log, start, error, recompiles = run_rung(settings, out_dir / f"rung{i}", timeout_s, log_name)
            row.update(error=error, seq_len=seq_len, log=log_name,
                       **({"recompiles": recompiles} if settings.get("compile") else {}))
            if start:  # the run built its data: the labelled share of it
                row["label_fraction"] = start["label_fraction"]
            timed = steps_log[warmup:]
            if timed:  # a rung killed after its warm-up still measured these steps
                tokens_per_s = statistics.median(s["tokens_per_s"] for s in timed)
                achieved = tokens_per_s * start["flops_per_token"]
                row.update(tokens_per_s=tokens_per_s, tokens_per_s_min=min(s["tokens_per_s"] for s in timed),
                           tokens_per_s_max=max(s["tokens_per_s"] for s in timed), model_tflops=achieved / 1e12,
                           mfu_data_sheet=achieved / start["peak_flops"], mfu_measured_peak=achieved / measured_peak,
                           hfu_data_sheet=tokens_per_s * start["executed_flops_per_token"] / start["peak_flops"],
                           tokens_per_step=statistics.median(s["tokens"] for s in timed),
                           peak_mem_gib=max(s["peak_mem_bytes"] for s in timed) / 2**30, timed_steps=len(timed),
                           final_loss=timed[-1]["loss"])
            elif not error:
                row["error"] = f"only {len(steps_log)} steps logged, {warmup} of them warm-up"
        rows.append(row)
        if "tokens_per_s" in row:
            print(f"{name:<48} {row['tokens_per_s']:9.0f} tokens/s  MFU {row['mfu_data_sheet']:.1%} (data sheet), "
                  f"{row['mfu_measured_peak']:.1%} (measured peak), {row['peak_mem_gib']:.1f} GiB", flush=True)
            print(f"{'':<4}{row['seq_len']}-token rows, {row['tokens_per_step']:.0f} tokens a step, "
                  f"{row['label_fraction']:.1%} of them labelled; log: {row['log']}", flush=True)
            if row["error"]:
                print(f"{'':<4}{row['error']}", flush=True)
        else:
            shown = row["error"] if row["error"].startswith("skipped") else f"FAILED: {row['error']}"
            print(f"{name:<48} {shown}", flush=True)
        table = pd.DataFrame(rows).reindex(columns=list(COLUMNS))
        table.attrs.update(measured_peak_flops=measured_peak, data_sheet_peak_flops=sheet_peak,
                           data_sheet_source=sheet_source)
        if save:
            save(table)
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab.bench.mfu_ladder", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset-row", choices=PRESET_ROWS, default="qwen0.5b",
                        help="model, row length and labels as one name: " + "; ".join(
                            f"{k}: {v['model']}, {v['seq_len']}-token rows, labels {v['labels']}"
                            for k, v in PRESET_ROWS.items()))
    parser.add_argument("--model", help="random preset, HF id or folder; 'null' for the offline tiny Qwen2 "
                        "(default: the preset row's)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16-autocast")
    parser.add_argument("--seq-len", type=int, help="tokens a row (default: the preset row's)")
    parser.add_argument("--labels", choices=LABEL_POLICIES, help="replies: the support set, loss on assistant replies "
                        "only; all: documents as long as a row, loss on every token (default: the preset row's)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per rung, warm-up included")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the median (compilation, caches)")
    parser.add_argument("--rungs", type=int, default=len(RUNGS), help="run only the first N rungs")
    parser.add_argument("--from-rung", type=int, default=0, help="start at this rung (0-based; it keeps the changes "
                        f"above it). {REFERENCE_RUNG}: the reference of the newest rungs")
    parser.add_argument("--timeout", type=finite_float, default=120, help="seconds per rung before it is killed")
    parser.add_argument("--budget", type=finite_float, help="seconds for the whole ladder; a rung whose --timeout "
                        "is more than what is left is skipped (default: no limit)")
    parser.add_argument("--out", metavar="DIR", help=f"save {TABLE} here with a provenance sidecar; the rungs log "
                        "into DIR/rungN/ (without --out: build/runs/mfu_ladder/rungN/)")
    args = parser.parse_args(argv)
    preset = PRESET_ROWS[args.preset_row]
    args.model = args.model or preset["model"]
    args.seq_len = args.seq_len or preset["seq_len"]
    args.labels = args.labels or preset["labels"]
    model = None if args.model == "null" else args.model
    arguments = {k: v for k, v in vars(args).items() if k != "out"}

    def save(table):
        provenance = {**stamp(model or "distlab-tiny", 1), "benchmark": "distlab.bench.mfu_ladder",
                      "arguments": arguments, **table.attrs}
        return save_table(table, Path(args.out) / TABLE, provenance)

    table = ladder(model, args.device, args.dtype, args.seq_len, args.steps, args.warmup, args.rungs, args.timeout,
                   first=args.from_rung, save=save if args.out else None, out_dir=args.out, budget_s=args.budget,
                   labels=args.labels)
    print(table.drop(columns=["change", "log"]).round(4).to_string(index=False), flush=True)
    ok = table.dropna(subset=["tokens_per_s"])
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
