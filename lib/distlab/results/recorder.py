"""What every rank prints at the end of a run, so that its result survives where only logs do.

On Kubernetes a finished pod's files are gone; its log is not. So at the end of a run every rank
prints its result as one JSON object between two markers on stdout:

    === DISTLAB_RESULT_START rank=1 ===
    {"schema": "distlab.result/2", "strategy": "fsdp", "rank": 1, ...}
    === DISTLAB_RESULT_END rank=1 ===

distlab.train calls `emit_rank_result`; distlab.results.extract reads the records back from any log.
This module is imported by every training rank: it loads no pandas, numpy or matplotlib, whose pages
would count in the rank's measured peak RSS.
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
from pathlib import Path
from typing import Any, Mapping

from distlab.jsonio import strict_json
from distlab.metrics import read_log
from distlab.provenance import device_description, git_commit
from distlab.results import schema
from distlab.results.schema import STATE_COMPONENTS

# The result record's format (its keys; the columns computed from it are distlab.results.schema's).
# 2: per-step comm_bytes, warmup_steps instead of skip_steps, the rank's own numbers in rank_summary.
SCHEMA = "distlab.result/2"
START = "=== DISTLAB_RESULT_START rank={rank} ==="
END = "=== DISTLAB_RESULT_END rank={rank} ==="


def emit_result(record: Mapping[str, Any], rank: int | None = None, stream=None) -> None:
    """Print `record` as one JSON line between this rank's START/END markers, in one write."""
    rank = int(record.get("rank", 0) if rank is None else rank)
    text = strict_json(dict(record), separators=(",", ":"))  # NaN and infinities become null: strict JSON
    stream = stream or sys.stdout
    stream.write(f"{START.format(rank=rank)}\n{text}\n{END.format(rank=rank)}\n")
    stream.flush()


def emit_rank_result(cfg, strategy, log_path, summary, measured_state=None, stream=None):
    """What distlab.train calls on every rank at the end of a run: print this rank's result between
    markers when the run was launched (torchrun, a Kubernetes pod: RANK is set) or when
    DISTLAB_EMIT_RESULT=1; an in-process run (a notebook calling train()) gets its TrainResult instead.
    Returns the record, or None when nothing was printed."""
    if "RANK" not in os.environ and os.environ.get("DISTLAB_EMIT_RESULT") != "1":
        return None
    record = rank_result(cfg, strategy, log_path, summary, measured_state)
    emit_result(record, stream=stream)
    return record


def rank_result(cfg, strategy, log_path: Path | None, summary: Mapping[str, Any],
                measured_state=None) -> dict[str, Any]:
    """This rank's result record, from its own step log (every rank writes one when world > 1).

    The per-step lists (named as in the step log) are what run_metrics summarises over all ranks;
    `rank_summary` holds this rank's own tokens_per_s, step_time_s and comm_share, for a reader of one
    pod's log (NaN for a run no longer than the warm-up). `measured_state`, the MemoryBreakdown the meter
    measured inside a step (with cfg.measure_state; None otherwise), becomes `state_bytes`: the bytes of
    weights, adapters, gradients, optimizer state and buffers this rank owns."""
    steps = read_log(log_path) if log_path is not None and Path(log_path).exists() else []
    dp = strategy.data_parallel_size
    accum = cfg.micro_steps(dp)
    record: dict[str, Any] = {
        "schema": SCHEMA, "run": Path(cfg.output_dir).name, "strategy": strategy.name,
        "mode": "lora" if cfg.lora else "full", "rank": strategy.rank, "world_size": strategy.world_size,
        "data_parallel_size": dp, "model": cfg.model or "distlab-tiny", "device": cfg.device, "dtype": cfg.dtype,
        "micro_batch_size": cfg.micro_batch_size, "grad_accum": accum,
        "global_batch_size": cfg.micro_batch_size * accum * dp, "seq_len": cfg.seq_len, "seed": cfg.seed,
        "lora_r": cfg.lora_r if cfg.lora else None, "vocab_parallel": cfg.vocab_parallel,
        "warmup_steps": schema.WARMUP_STEPS,
        # a step's loss is always measured: NaN here (a diverged step) is written null, extract reads it as NaN
        "steps": [s["step"] for s in steps], "loss": [s["loss"] for s in steps],
        "step_time_s": [s["step_time_s"] for s in steps], "tokens": [s["tokens"] for s in steps],
        "comm_time_s": [s.get("comm_time_s") for s in steps], "comm_bytes": [s.get("comm_bytes") for s in steps],
        "peak_mem_bytes": max([int(summary.get("peak_mem_bytes") or 0)] + [int(s["peak_mem_bytes"]) for s in steps]),
        "host_before_load_bytes": summary.get("host_before_load_bytes"),
        "host_peak_at_load_bytes": summary.get("host_peak_at_load_bytes"),
        "final_loss": summary.get("final_loss"), "eval_loss_before": summary.get("eval_loss_before"),
        "eval_loss_after": summary.get("eval_loss_after"),
        "device_name": device_description(), "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    own = schema.summarise({strategy.rank: steps}) if schema.steady(steps) else {}
    record["rank_summary"] = {k: own.get(k, schema.NAN) for k in ("tokens_per_s", "step_time_s", "comm_share")}
    if measured_state is not None:  # activations are not state a rank owns
        record["state_bytes"] = {k: int(getattr(measured_state, k)) for k in STATE_COMPONENTS if k != "activations"}
    return record
