"""One results schema for a run: the column names every table uses (chapters 02, 03 and 04, the
benchmarks, the report) and the one function that computes them from step records.

The input is the training loop's step records (distlab.metrics.StepLog: one JSON object per logged step
with step, world_size, loss, step_time_s, tokens, peak_mem_bytes and, with measure_comm, comm_time_s
and comm_bytes), one list per rank. Rank 0 writes `train_log.jsonl`, rank r > 0 `train_log.rank{r}.jsonl`;
the collector (distlab.results.extract) carries the same per-step lists in every rank's result record.

Steady state: steps numbered above WARMUP_STEPS, on the steps every rank logged. Per step, a run's time is
its slowest rank's (the step ends for everyone when that rank is done); then the steady steps are averaged.
The definitions of the columns are in COLUMNS below; the report prints them from there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from distlab.metrics import read_log

# Optimizer steps at the start of every run left out of every timing. Two, because the first two steps
# pay one-time costs that later steps do not: step 1 allocates AdamW's moments (lazily, at the first
# optimizer.step), starts the thread pools and kernels, and runs each collective for the first time
# (communicators, DeepSpeed and FSDP buffers are set up then); in step 2 DDP rebuilds its gradient buckets
# in the order gradients became ready in step 1, and the allocator reaches its steady size. From step 3 on
# every step repeats the same work. Two also keeps at least one steady step in the shortest runs the
# test profiles launch (3 steps). Not the learning-rate warm-up (TrainConfig.warmup_steps).
WARMUP_STEPS = 2

# The one vocabulary. Every column of every results table is one of these, or one of its chapter's
# CHAPTER_COLUMNS. Times are seconds, memory bytes, shares and efficiencies fractions (not %).
COLUMNS: dict[str, str] = {
    # which run
    "run": "the run's name (its output folder)",
    "strategy": "how the loop was distributed (single, ddp, fsdp, zero2, zero3, pipeline, ds_pipeline)",
    "mode": "lora or full (fine-tuning)",
    "world_size": "ranks of the run",
    "global_batch_size": "rows per optimizer step, all ranks together",
    # the steady-state summary (summarise)
    "steps_averaged": f"steady-state steps averaged (every step after the first {WARMUP_STEPS} warm-up steps)",
    "tokens_per_s": "real (non-padding) tokens of the global batch per second, all ranks together: "
                    "steady-state tokens / steady-state time of the slowest rank",
    "step_time_s": "seconds per optimizer step: per step the slowest rank's time, then the steady-state mean",
    "comm_time_s": "seconds per step inside communication (mean over ranks; collectives are waited for as "
                   "issued with measure_comm, so this is exposed communication, waiting for other ranks "
                   "included); NaN when the run did not measure it",
    "compute_time_s": "step_time_s - comm_time_s",
    "comm_share": "comm_time_s / step_time_s, a fraction",
    "comm_bytes": "bytes a rank moved through communication per step (mean over ranks and steady steps)",
    "peak_mem_bytes": "peak memory of the largest rank, in bytes: CUDA allocator peak on GPU, peak RSS of the "
                      "process on CPU (which includes the Python runtime and libraries)",
    "peak_mem_bytes_per_rank": "peak_mem_bytes of each rank, rank 0 first, joined by ';'",
    "mfu": "model FLOP utilisation: tokens_per_s x model FLOPs per token / (world_size x peak FLOP/s of one "
           "device), model FLOPs as PaLM counts them (distlab.metrics.train_flops_per_token: the layers at every "
           "real token, the LM head at label tokens, attention within each document); only where the run's log "
           "has its start record",
    "mean_loss": "mean training loss over every logged step (warm-up included: it is a result, not a timing)",
    "final_loss": "training loss of the last step",
    # against the 1-rank run of the same setup (add_scaling)
    "speedup": "tokens_per_s / tokens_per_s of the 1-rank run of the same setup",
    "scaling_efficiency": "speedup / world_size, a fraction (1 = linear scaling); NaN without a 1-rank run",
}

# Columns only one chapter's tables have: what that chapter varies or measures besides the schema.
CHAPTER_COLUMNS: dict[str, dict[str, str]] = {
    "02": {
        "rounds": "alternating rounds measured at this world size (the row is the median round's)",
        "tokens_per_s_min": "the slowest round's tokens_per_s",
        "tokens_per_s_max": "the fastest round's tokens_per_s",
        "scaling_efficiency_min": "tokens_per_s_min / (world_size x the 1-rank tokens_per_s_max): the worst pairing",
        "scaling_efficiency_max": "tokens_per_s_max / (world_size x the 1-rank tokens_per_s_min): the best pairing",
    },
    "03": {},
    "04": {
        "micro_bsz": "rows per micro-batch (the DeepSpeed pipeline study's column)",
        "GA": "micro-batches per optimizer step (gradient accumulation = the pipeline's m)",
        "ckpt": "activation checkpointing, T or F",
        "dtype": "training dtype",
        "N": "data-parallel size (1 for a pure pipeline: every stage works on the same tokens)",
        "T_eff": "tokens per optimizer step: seq_len x micro_bsz x GA x N",
        "bubble_fraction": "median over steady steps of the mean idle fraction of the stages",
    },
}

# What summarise() returns, in table order.
SUMMARY = ("world_size", "steps_averaged", "tokens_per_s", "step_time_s", "comm_time_s", "compute_time_s",
           "comm_share", "comm_bytes", "peak_mem_bytes", "peak_mem_bytes_per_rank", "mean_loss", "final_loss")

NAN = float("nan")


def unknown_columns(columns: Iterable[str], chapter: str) -> list[str]:
    """The columns of one of `chapter`'s tables that are neither in COLUMNS nor its CHAPTER_COLUMNS."""
    if chapter not in CHAPTER_COLUMNS:
        raise KeyError(f"no chapter {chapter!r} in CHAPTER_COLUMNS (have {', '.join(CHAPTER_COLUMNS)})")
    return [c for c in columns if c not in COLUMNS and c not in CHAPTER_COLUMNS[chapter]]


def per_rank(values: Sequence[float]) -> str:
    """The peak_mem_bytes_per_rank text: one integer per rank, rank 0 first."""
    return ";".join(str(int(v)) for v in values)


def parse_per_rank(text: str) -> list[int]:
    return [int(float(v)) for v in str(text).split(";")]


# ----------------------------------------------------------------------------- the summary

def _measured(value) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def merge_ranks(steps_by_rank: Mapping[int, Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """One record per step that every rank logged (after a resume, ranks other than 0 log only the new
    segment): the step's loss and tokens (all-reduced, the same on every rank: rank 0's), its time (the
    slowest rank's) and its communication time and bytes (mean over ranks; None where a rank did not
    measure them)."""
    if not steps_by_rank:
        raise ValueError("no ranks to summarise")
    ranks = sorted(steps_by_rank)
    by_step = {r: {int(s["step"]): s for s in steps_by_rank[r]} for r in ranks}
    common = sorted(set.intersection(*(set(steps) for steps in by_step.values())))
    merged = []
    for step in common:
        recs = [by_step[r][step] for r in ranks]
        comm = [rec.get("comm_time_s") for rec in recs]
        nbytes = [rec.get("comm_bytes") for rec in recs]
        merged.append({
            "step": step, "loss": recs[0]["loss"], "tokens": recs[0]["tokens"],
            "step_time_s": max(rec["step_time_s"] for rec in recs),
            "comm_time_s": sum(comm) / len(comm) if all(map(_measured, comm)) else None,
            "comm_bytes": sum(nbytes) / len(nbytes) if all(map(_measured, nbytes)) else None,
        })
    return merged


def steady(steps: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The steps after the warm-up (by step number, so a log written every few steps works too)."""
    return [s for s in steps if int(s["step"]) > WARMUP_STEPS]


def summarise(steps_by_rank: Mapping[int, Sequence[Mapping[str, Any]]], source: str = "<step records>"
              ) -> dict[str, Any]:
    """The SUMMARY columns of one run from its ranks' step records (rank -> records; see the module
    docstring). `source` names the logs in errors."""
    merged = merge_ranks(steps_by_rank)
    if not merged:
        raise ValueError(f"{source}: the ranks have no logged step in common")
    steps = steady(merged)
    if not steps:
        raise ValueError(f"{source}: no step after the {WARMUP_STEPS} warm-up steps (the last logged step is "
                         f"{merged[-1]['step']}); run at least {WARMUP_STEPS + 1} steps")
    seconds = sum(s["step_time_s"] for s in steps)
    step_time = seconds / len(steps)
    comm = [s["comm_time_s"] for s in steps]
    comm_time = sum(comm) / len(comm) if all(c is not None for c in comm) else NAN
    nbytes = [s["comm_bytes"] for s in steps]
    peaks = [max(int(rec["peak_mem_bytes"]) for rec in steps_by_rank[r]) for r in sorted(steps_by_rank)]
    return {
        "world_size": len(steps_by_rank),
        "steps_averaged": len(steps),
        "tokens_per_s": sum(s["tokens"] for s in steps) / seconds,
        "step_time_s": step_time,
        "comm_time_s": comm_time,
        "compute_time_s": step_time - comm_time,
        "comm_share": comm_time / step_time,
        "comm_bytes": sum(nbytes) / len(nbytes) if all(b is not None for b in nbytes) else NAN,
        "peak_mem_bytes": max(peaks),
        "peak_mem_bytes_per_rank": per_rank(peaks),
        "mean_loss": sum(s["loss"] for s in merged) / len(merged),
        "final_loss": merged[-1]["loss"],
    }


# ----------------------------------------------------------------------------- from step logs

def rank_log_paths(log: str | Path) -> list[Path]:
    """Every rank's step log of a run, rank 0 first, from rank 0's log (or the run's folder). The world
    size comes from rank 0's records, so a stale log of an earlier, larger run in the folder is ignored;
    a missing rank's log is an error."""
    log = Path(log)
    if log.is_dir():
        log = log / "train_log.jsonl"
    if not log.is_file():
        raise FileNotFoundError(f"{log}: no step log")
    records = read_log(log)
    if not records:
        raise ValueError(f"{log}: no step records (did the run log any step?)")
    world = int(records[0]["world_size"])
    paths = [log] + [log.with_name(f"train_log.rank{r}.jsonl") for r in range(1, world)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{log.parent}: a {world}-rank run, but {', '.join(missing)} missing (the slowest "
                                "rank's step time needs every rank's log)")
    return paths


def summarise_logs(log: str | Path) -> dict[str, Any]:
    """The SUMMARY columns of one run, and its `mfu`, from its step logs (rank 0's log or the run's folder)."""
    paths = rank_log_paths(log)
    steps_by_rank = {}
    for rank, path in enumerate(paths):
        steps_by_rank[rank] = read_log(path)
        if not steps_by_rank[rank]:
            raise ValueError(f"{path}: no step records")
    row = summarise(steps_by_rank, source=str(paths[0]))
    start = read_log(paths[0], event="start")
    if start and start[-1].get("flops_per_token") and start[-1].get("peak_flops"):
        info = start[-1]
        row["mfu"] = row["tokens_per_s"] * info["flops_per_token"] / (info["peak_flops"] * row["world_size"])
    else:
        row["mfu"] = NAN
    return row


# ----------------------------------------------------------------------------- against 1 rank

def add_scaling(rows: Sequence[dict[str, Any]], same_setup: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Rows with `speedup` and `scaling_efficiency` against the 1-rank row of the same setup (the rows that
    agree on every key in `same_setup`, e.g. ("mode",)); NaN where the setup has no 1-rank row."""
    base: dict[tuple, float] = {}
    for row in rows:
        key = tuple(row.get(k) for k in same_setup)
        if int(row["world_size"]) == 1 and key not in base:
            base[key] = float(row["tokens_per_s"])
    out = []
    for row in rows:
        one = base.get(tuple(row.get(k) for k in same_setup))
        speedup = row["tokens_per_s"] / one if one else NAN
        out.append({**row, "speedup": speedup, "scaling_efficiency": speedup / int(row["world_size"])})
    return out


# ----------------------------------------------------------------------------- memory per rank

# The parts of a rank's memory, in the order every table lists them (results records, planner tables).
STATE_COMPONENTS = ("weights", "adapter_weights", "gradients", "optimizer_state", "activations", "buffers")


@dataclass
class MemoryBreakdown:
    weights: float = 0.0  # frozen or trained base weights
    adapter_weights: float = 0.0  # LoRA A/B (0 for full fine-tuning)
    gradients: float = 0.0
    optimizer_state: float = 0.0  # AdamW moments, plus DeepSpeed's fp32 master copy of trained weights
    activations: float = 0.0
    buffers: float = 0.0  # communication buffers: DDP buckets, FSDP all-gathers, DeepSpeed reduce buckets
    notes: list[str] = field(default_factory=list, repr=False, compare=False)

    @property
    def state(self) -> float:
        """Weights, adapters, gradients and optimizer state: what sharding divides."""
        return self.weights + self.adapter_weights + self.gradients + self.optimizer_state

    @property
    def total(self) -> float:
        return self.state + self.activations + self.buffers

    def as_dict(self) -> dict[str, float]:
        out = {k: getattr(self, k) for k in STATE_COMPONENTS}
        if not self.buffers:  # the single-device tables of chapters 01/02 have no buffers row
            del out["buffers"]
        return {**out, "total": self.total}
