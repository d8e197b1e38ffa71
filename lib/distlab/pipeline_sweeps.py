"""The measured pipeline sweeps (chapter 04 and the benchmarks): many pipeline runs through the training loop
in one launch, and their tables.

The bubble sweep: one measured run per schedule and micro-batch count (bubble_sweep), repeated in rounds,
each run's steady-state bubble, per-stage idle time and hand-off read from its recorded timeline
(measure_run), and the median over rounds (over_rounds). The DeepSpeed pipeline study's table: one run
per [micro_bsz, GA, activation checkpointing, dtype] row (study_table, table_row), and the pipeline against
FSDP at the same tokens per step (versus_fsdp). What a timeline's numbers mean (the bubble in theory, the
idle fractions, the hand-off and the cost models) is distlab.measure.bubble. Chapter 04's notebook and
`python -m distlab.bench.pipeline_bubble` and `pipeline_study` call these; the figures drawn from them are
chapter 04's (distlab.chapters.ch04).
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

import pandas as pd

from distlab.launch.local import launch_sweep
from distlab.measure.bubble import (
    aggregate,
    bubble_formula,
    cost_bubble,
    handoff_bubble,
    read_timeline,
    step_summary,
)
from distlab.metrics import read_log
from distlab.paths import RUNS_DIR
from distlab.results import schema

# ---------------------------------------------------------------- the bubble measured


def measure_run(run_dir) -> dict[str, Any]:
    """Steady-state bubble, per-stage idle and communication of one measured run (the schema's
    warm-up steps left out)."""
    records = read_timeline(run_dir)
    steady = [r for r in records if r["step"] > schema.WARMUP_STEPS] or records[-1:]
    summaries = [step_summary(r["events"]) for r in steady]
    agg = aggregate(summaries)
    first = steady[0]
    # v model chunks per rank: v m chunk-sized slots, each 1/v of a micro-batch's compute and hand-off per rank
    v, p, m = first.get("virtual", 1), first["stages"], first["microbatches"]
    agg.update(schedule=first["schedule"], stages=p, virtual=v, microbatches=m,
               theory=bubble_formula(p, m, v))
    agg["diff"] = agg["bubble_fraction"] - agg["theory"]
    t, h = agg["compute_per_mb_s"], statistics.fmean(agg["handoff_per_mb_s"])
    agg["handoff_s"] = h
    agg["model_handoff"] = handoff_bubble(p, v * m, statistics.fmean(t) / v, h / v)
    agg["model_costs"] = cost_bubble([ts / v for ts in t], h / v, v * m)
    return agg


def bubble_sweep(microbatches: Sequence[int] = (1, 2, 4, 8), schedules: Sequence[str] = ("gpipe", "1f1b"),
                 model: str | None = None, micro_batch_size: int = 2, seq_len: int = 256, steps: int = 4,
                 stages: int = 2, runs_dir=None, prefix: str = "bubble",
                 extra: dict | None = None, echo: bool = False, timeout_s: int = 900, rounds: int = 1,
                 also: Sequence[tuple[str, int]] = ()):
    """One measured pipeline run per (schedule, m) through the training loop, all in one launch
    (distlab.launch.local.launch_sweep), repeated `rounds` times (one launch per round, every configuration once in
    each, so a slow spell of the machine touches all of them alike); one row per (round, schedule, m)
    with the measured bubble (mean idle fraction over stages, median over steady steps), per-stage
    idle, the theory, the two cost models and |measured - theory|. `also`: more (schedule, m) runs in the
    same launches (the chapter's few interleaved runs). `over_rounds` summarises."""
    base = {"strategy": "pipeline", "pipeline_stages": stages, "model": model, "micro_batch_size": micro_batch_size,
            "seq_len": seq_len, "max_steps": steps, "warmup_steps": 1, "measure_comm": True, "eval_file": None,
            "save_model": False, "logging_steps": 1, "lora_dropout": 0.0, **(extra or {})}
    rows = []
    for rnd in range(rounds):
        tag = prefix if rounds == 1 else f"{prefix}_r{rnd}"
        # schedules alternate within a launch, in reverse order every other round: a slow spell of the
        # machine falls on neighbouring runs of different schedules, and on each in turn
        order = [(schedule, m) for m in microbatches for schedule in schedules] + list(also)
        variants = {f"{tag}_{schedule}_m{m}": {"pipeline_schedule": schedule, "grad_accum": m}
                    for schedule, m in (order[::-1] if rnd % 2 else order)}
        jobs = launch_sweep(tag, stages, base, variants, runs_dir=runs_dir or RUNS_DIR, echo=False,
                            timeout_s=timeout_s)
        for name, job in jobs.items():
            schedule, m = variants[name]["pipeline_schedule"], variants[name]["grad_accum"]
            rows.append(_sweep_row(job, rnd, schedule, m, stages))
            if echo:
                r = rows[-1]
                idle = " ".join(f"{r[f'idle_stage{s}']:.3f}" for s in range(stages))
                print(f"round {rnd} {schedule:5s} m={m}: bubble measured {r['measured']:.3f} (stages {idle}), "
                      f"theory {r['theory']:.3f}, with hand-off {r['model_handoff']:.3f} "
                      f"(h {r['handoff_ms']:.1f} ms, t {r['compute_ms']:.0f} ms per micro-batch), "
                      f"span {r['pipeline_span_s'] * 1e3:.0f} ms", flush=True)
        if echo:
            print(f"round {rnd}: {len(jobs)} runs in one launch: {next(iter(jobs.values())).result.elapsed_s:.0f} s",
                  flush=True)
    return pd.DataFrame(rows)


def _sweep_row(job, rnd: int, schedule: str, m: int, stages: int) -> dict[str, Any]:
    agg = measure_run(job.output_dir)
    t = agg["compute_per_mb_s"]
    row = {"round": rnd, "schedule": schedule, "schedule_run": agg["schedule"], "m": m, "p": stages,
           "v": agg["virtual"],
           "measured": agg["bubble_fraction"], "theory": agg["theory"], "abs_diff": abs(agg["diff"]),
           "model_handoff": agg["model_handoff"], "model_costs": agg["model_costs"],
           "compute_ms": 1e3 * statistics.fmean(t), "handoff_ms": 1e3 * agg["handoff_s"],
           "imbalance": max(t) / statistics.fmean(t) - 1}
    for s, idle in enumerate(agg["stage_idle"]):
        row[f"idle_stage{s}"] = idle
    for s, ts in enumerate(t):
        row[f"compute_ms_stage{s}"] = 1e3 * ts
    row.update(pipeline_span_s=agg["pipeline_span_s"], comm_time_s=agg["comm_time_s"],
               p2p_blocked_s=agg["p2p_blocked_s"])
    steady = schema.steady(read_log(job.log))  # activation peaks: the most any steady step held, per stage
    for s in range(len(steady[-1].get("stage_activation_peak_bytes", []))):
        row[f"activation_peak_bytes_stage{s}"] = max(r["stage_activation_peak_bytes"][s] for r in steady)
    row["run_dir"] = str(job.output_dir)
    return row


def over_rounds(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (schedule, m): the median over rounds of every number, the min and max of the
    measured bubble (`measured_min`, `measured_max`), |median measured - theory|, and the run folder
    of the median round (to draw)."""
    out = []
    for (schedule, m), g in df.sort_values(["m", "round"], kind="stable").groupby(["schedule", "m"], sort=False):
        row = {"schedule": schedule, "m": m, "rounds": len(g), "schedule_run": g["schedule_run"].iloc[0]}
        for c in g.columns:
            if c not in row and c not in ("round", "run_dir") and pd.api.types.is_numeric_dtype(g[c]):
                row[c] = float(g[c].median())
        row["measured_min"], row["measured_max"] = float(g["measured"].min()), float(g["measured"].max())
        row["abs_diff"] = abs(row["measured"] - row["theory"])
        order = g.sort_values("measured")
        row["run_dir"] = order["run_dir"].iloc[(len(order) - 1) // 2]
        out.append(row)
    return pd.DataFrame(out)


# ---------------------------------------------------------------- the DeepSpeed pipeline study's table


def table_row(job, *, strategy: str, micro: int, ga: int, ckpt: bool, dtype: str, seq_len: int,
              data_parallel: int) -> dict[str, Any]:
    """One row of the DeepSpeed pipeline study's table from a finished run: the study's setup columns (chapter 04's
    extras in distlab.results.schema.CHAPTER_COLUMNS), then the schema's steady-state summary.

    T_eff = S x B_micro x GA x N with N the data-parallel size (a pure pipeline has N = 1: both
    stages work on the same tokens). tokens_per_s counts real (non-padding) tokens of all ranks."""
    summary = schema.summarise_logs(job.log)
    row = {"strategy": strategy, "micro_bsz": micro, "GA": ga, "ckpt": "on" if ckpt else "off", "dtype": dtype,
           "N": data_parallel, "T_eff": seq_len * micro * ga * data_parallel}
    row.update({k: summary[k] for k in ("world_size", "steps_averaged", "step_time_s", "tokens_per_s", "comm_time_s",
                                        "comm_share", "peak_mem_bytes", "peak_mem_bytes_per_rank")})
    steady = schema.steady(read_log(job.log))
    if "bubble_fraction" in steady[0]:
        row["bubble_fraction"] = statistics.median(s["bubble_fraction"] for s in steady)
    return row


def study_table(base: dict, strategy: str, rows: Sequence[Sequence], nproc: int, steps: int, seq_len: int,
                dtypes: dict[str, str | None], lora: bool, timeout_s: int = 900) -> pd.DataFrame:
    """Every [micro_bsz, GA, activation checkpointing, dtype] row as its own run (own step log, warm-up steps
    left out), each in a launch of its own; one table row each (table_row) with the slowest and fastest steady
    step's tokens/s, every rank's peak memory, the hand-off per micro-batch and the bubble the cost model gives
    from it and the stage imbalance (measure_run). `dtypes` maps a row's dtype to the run's (None: the
    device has no native support for it, and the row is left out); `lora` False trains every weight.

    Why not one launch for all rows, as the other sweeps do: on CPU the peak is the process's resident memory,
    and runs that share a process inherit what the runs before them left resident (freed heap the allocator
    keeps, library state): measured here, one launch's peaks grew in launch order whatever the row, GA 1 after
    GA 8 as large as GA 8. The peak columns are the table's point, so each row gets a fresh process."""
    named = {f"04_{strategy}_b{micro}_ga{ga}_{'ckpt' if ckpt else 'nockpt'}_{dt}": (micro, ga, bool(ckpt), dt)
             for micro, ga, ckpt, dt in rows if dtypes.get(dt)}
    shared = {**base, "strategy": strategy, "max_steps": steps, "warmup_steps": 1, "measure_comm": True,
              "eval_file": None, "save_model": False, "lora": lora}
    jobs = {}
    for name, (micro, ga, ckpt, dt) in named.items():
        jobs.update(launch_sweep(name, nproc, shared, {name: {"micro_batch_size": micro, "grad_accum": ga,
                                                              "activation_checkpointing": ckpt, "dtype": dtypes[dt]}},
                                 timeout_s=timeout_s, echo=False))
    table = []
    for name, (micro, ga, ckpt, dt) in named.items():
        row = table_row(jobs[name], strategy=strategy, micro=micro, ga=ga, ckpt=ckpt, dtype=dt, seq_len=seq_len,
                        data_parallel=1)
        row["training"] = "LoRA" if lora else "full"
        steady = schema.steady(schema.merge_ranks({r: read_log(p) for r, p in
                                                    enumerate(schema.rank_log_paths(jobs[name].log))}))
        per_step = [s["tokens"] / s["step_time_s"] for s in steady]
        row["tokens_per_s_min"], row["tokens_per_s_max"] = min(per_step), max(per_step)
        for r, peak in enumerate(schema.parse_per_rank(row.pop("peak_mem_bytes_per_rank"))):
            row[f"peak_mem_bytes_rank{r}"] = peak
        timeline = measure_run(jobs[name].output_dir)  # the bubble's parts, as section 4 measures them
        row["handoff_per_mb_ms"] = timeline["handoff_s"] * 1e3
        row["bubble_model"] = timeline["model_costs"]  # the formula plus the measured hand-off and stage imbalance
        table.append(row)
    return pd.DataFrame(table)


def versus_fsdp(base: dict, pipeline_rows: pd.DataFrame, stages: int, steps: int, seq_len: int,
                dtypes: dict[str, str | None], lora: bool, strategy: str, timeout_s: int = 900) -> pd.DataFrame:
    """For each pipeline row whose GA divides by `stages`: the pipeline again and FSDP on `stages` data-parallel
    ranks at the same tokens per step (FSDP accumulates GA / ranks), in turn in one launch and with the timeline
    instrument off (it serialises communication with compute, so it would distort the throughput it sits
    beside); one row per GA, the two side by side. The pipeline's bubble is the measured table row's."""
    rows = pipeline_rows[pipeline_rows.GA % stages == 0]
    variants, pairs = {}, []
    for r in rows.itertuples():
        row = {"micro_batch_size": int(r.micro_bsz), "activation_checkpointing": r.ckpt == "on",
               "dtype": dtypes[r.dtype]}
        pipe = f"04_vs_{strategy}_b{int(r.micro_bsz)}_ga{int(r.GA)}_{r.dtype}"
        fsdp = f"04_vs_fsdp_b{int(r.micro_bsz)}_ga{int(r.GA) // stages}_{r.dtype}"
        variants[pipe] = {**row, "grad_accum": int(r.GA)}
        variants[fsdp] = {**row, "strategy": "fsdp", "pipeline_stages": None, "stage_layers": None,
                          "grad_accum": int(r.GA) // stages}
        pairs.append((pipe, fsdp, r))
    shared = {**base, "strategy": strategy, "max_steps": steps, "warmup_steps": 1, "measure_comm": False,
              "eval_file": None, "save_model": False, "lora": lora}
    jobs = launch_sweep("04_versus_fsdp", stages, shared, variants, timeout_s=timeout_s, echo=False)
    out = []
    for pipe, fsdp, r in pairs:
        p = table_row(jobs[pipe], strategy=strategy, micro=int(r.micro_bsz), ga=int(r.GA), ckpt=r.ckpt == "on",
                      dtype=r.dtype, seq_len=seq_len, data_parallel=1)
        f = table_row(jobs[fsdp], strategy="fsdp", micro=int(r.micro_bsz), ga=int(r.GA) // stages,
                      ckpt=r.ckpt == "on", dtype=r.dtype, seq_len=seq_len, data_parallel=stages)
        out.append({"T_eff": p["T_eff"], "pipeline GA": r.GA, "FSDP GA x ranks": f"{f['GA']} x {stages}",
                    "FSDP T_eff": f["T_eff"], "pipeline tokens/s": p["tokens_per_s"],
                    "FSDP tokens/s": f["tokens_per_s"], "FSDP / pipeline": f["tokens_per_s"] / p["tokens_per_s"],
                    "pipeline bubble (measured row)": r.bubble_fraction})
    return pd.DataFrame(out)
