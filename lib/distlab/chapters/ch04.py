"""Chapter 04, pipeline training: the plumbing its notebook calls once per cell.

The bubble sweep (one measured pipeline run per schedule and micro-batch count, all in one launch,
repeated in rounds), one row per run and their median over rounds, the DeepSpeed pipeline study's table rows,
and Gantt charts of the recorded timelines. What a timeline's numbers mean (the bubble in theory, the
idle fractions, the hand-off and the cost models) is distlab.measure.bubble; the equal-stage model the
sweep measures by default is distlab.models.balanced_bench_model.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

import pandas as pd

from distlab.launch.local import launch_sweep
from distlab.measure.bubble import (
    COMPUTE_KINDS,
    aggregate,
    cost_bubble,
    handoff_bubble,
    read_timeline,
    shift,
    stage_idle,
    step_summary,
    theoretical_bubble,
    typical_step,
)
from distlab.metrics import read_log
from distlab.paths import RUNS_DIR
from distlab.results import schema


def plot_timeline(ax, events: Sequence[dict], title: str = "", show_comm: bool = False, unit: float = 1e3) -> None:
    """Gantt chart: one row per stage, forward (blue) and backward (orange) boxes labelled by
    micro-batch. Idle gaps are the bubble. `show_comm` adds receive waits as thin grey bars."""
    evs = shift(events)
    stages = sorted({e["stage"] for e in evs if e["kind"] in COMPUTE_KINDS})
    colors = {"F": "#4C72B0", "B": "#DD8452"}
    for e in evs:
        y = e["stage"]
        if e["kind"] in COMPUTE_KINDS:
            w = (e["t1"] - e["t0"]) * unit
            ax.barh(y, w, left=e["t0"] * unit, height=0.6, color=colors[e["kind"]], edgecolor="black", lw=0.4)
            ax.text(e["t0"] * unit + w / 2, y, f"{e['kind']}{e['mb']}", ha="center", va="center", fontsize=6,
                    color="white")
        elif show_comm and e["kind"] == "recv":
            ax.barh(y + 0.38, (e["t1"] - e["t0"]) * unit, left=e["t0"] * unit, height=0.08, color="0.5")
    ax.set_yticks(stages)
    ax.set_yticklabels([f"stage {s}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first forward")
    if title:
        ax.set_title(title, fontsize=9)


def measure_run(run_dir) -> dict[str, Any]:
    """Steady-state bubble, per-stage idle and communication of one measured run (the schema's
    warm-up steps left out)."""
    records = read_timeline(run_dir)
    steady = [r for r in records if r["step"] > schema.WARMUP_STEPS] or records[-1:]
    summaries = [step_summary(r["events"]) for r in steady]
    agg = aggregate(summaries)
    first = steady[0]
    agg.update(schedule=first["schedule"], stages=first["stages"], microbatches=first["microbatches"],
               theory=theoretical_bubble(first["stages"], first["microbatches"]))
    agg["diff"] = agg["bubble_fraction"] - agg["theory"]
    t, h = agg["compute_per_mb_s"], statistics.fmean(agg["handoff_per_mb_s"])
    agg["handoff_s"] = h
    agg["model_handoff"] = handoff_bubble(first["stages"], first["microbatches"], statistics.fmean(t), h)
    agg["model_costs"] = cost_bubble(t, h, first["microbatches"])
    return agg


def bubble_sweep(microbatches: Sequence[int] = (1, 2, 4, 8), schedules: Sequence[str] = ("gpipe", "1f1b"),
                 model: str | None = None, micro_batch_size: int = 2, seq_len: int = 256, steps: int = 4,
                 stages: int = 2, runs_dir=None, prefix: str = "bubble",
                 extra: dict | None = None, echo: bool = False, timeout_s: int = 900, rounds: int = 1):
    """One measured pipeline run per (schedule, m) through the training loop, all in one launch
    (distlab.launch.local.launch_sweep), repeated `rounds` times (one launch per round, every configuration once in
    each, so a slow spell of the machine touches all of them alike); one row per (round, schedule, m)
    with the measured bubble (mean idle fraction over stages, median over steady steps), per-stage
    idle, the theory, the two cost models and |measured - theory|. `over_rounds` summarises."""
    base = {"strategy": "pipeline", "pipeline_stages": stages, "model": model, "micro_batch_size": micro_batch_size,
            "seq_len": seq_len, "max_steps": steps, "warmup_steps": 1, "measure_comm": True, "eval_file": None,
            "save_model": False, "logging_steps": 1, "lora_dropout": 0.0, **(extra or {})}
    rows = []
    for rnd in range(rounds):
        tag = prefix if rounds == 1 else f"{prefix}_r{rnd}"
        variants = {f"{tag}_{schedule}_m{m}": {"pipeline_schedule": schedule, "grad_accum": m}
                    for schedule in schedules for m in microbatches}
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
    for (schedule, m), g in df.groupby(["schedule", "m"], sort=False):
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


def table_row(job, *, strategy: str, micro: int, ga: int, ckpt: bool, dtype: str, seq_len: int,
              data_parallel: int) -> dict[str, Any]:
    """One row of the DeepSpeed pipeline study's table from a finished run: the study's setup columns (chapter 04's
    extras in distlab.results.schema.CHAPTER_COLUMNS), then the schema's steady-state summary.

    T_eff = S x B_micro x GA x N with N the data-parallel size (a pure pipeline has N = 1: both
    stages work on the same tokens). tokens_per_s counts real (non-padding) tokens of all ranks."""
    summary = schema.summarise_logs(job.log)
    row = {"strategy": strategy, "micro_bsz": micro, "GA": ga, "ckpt": "T" if ckpt else "F", "dtype": dtype,
           "N": data_parallel, "T_eff": seq_len * micro * ga * data_parallel}
    row.update({k: summary[k] for k in ("world_size", "steps_averaged", "step_time_s", "tokens_per_s", "comm_time_s",
                                        "comm_share", "peak_mem_bytes", "peak_mem_bytes_per_rank")})
    steady = schema.steady(read_log(job.log))
    if "bubble_fraction" in steady[0]:
        row["bubble_fraction"] = statistics.median(s["bubble_fraction"] for s in steady)
    return row


def plot_timelines(runs: dict[str, Any], step: int | None = None, figsize=(11, 3.4)):
    """Gantt charts side by side, one per labelled run folder, on a common time axis, all showing the
    same step: the given one, or the first run's typical step (median span). Returns the figure."""
    import matplotlib.pyplot as plt  # deferred: plotting is only needed when drawing

    timelines = {label: read_timeline(run_dir) for label, run_dir in runs.items()}
    if step is None:
        step = typical_step(next(iter(timelines.values())))["step"]
    fig, axes = plt.subplots(1, len(runs), figsize=figsize, sharex=True)
    axes = [axes] if len(runs) == 1 else list(axes)
    for ax, (label, records) in zip(axes, timelines.items()):
        rec = next((r for r in records if r["step"] == step), None)
        if rec is None:
            raise ValueError(f"{runs[label]}: no step {step} in its timeline (steps {[r['step'] for r in records]})")
        s = stage_idle(rec["events"])
        theory = theoretical_bubble(rec["stages"], rec["microbatches"])
        plot_timeline(ax, rec["events"], f"{label}: m={rec['microbatches']}, step {rec['step']}, bubble "
                                         f"{s['bubble']:.2f} (theory {theory:.2f})")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#4C72B0", "#DD8452")]
    axes[-1].legend(handles, ["forward", "backward"], fontsize=7, loc="lower right")
    fig.tight_layout(rect=(0, 0.04, 1, 1))  # room for the provenance line
    return fig
