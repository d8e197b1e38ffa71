"""Chapter 04, pipeline training: the plumbing its notebook calls once per cell.

The schedules drawn before anything is measured (GPipe, 1F1B and interleaved 1F1B simulated on ideal
stages: simulate_schedule, draw_schedules), the loss-curve comparison, the bubble sweep's tables and
figures (interleaved 1F1B beside 1F1B, the bubble and activation memory against m), the DeepSpeed pipeline
study's GA sweep drawn, and Gantt charts of the recorded timelines. The sweeps themselves (the measured
runs, one row per run, the median over rounds, the study's table and the pipeline against FSDP) are
distlab.pipeline_sweeps, which the benchmarks run too. What a timeline's numbers mean (the bubble in
theory, the idle fractions, the hand-off and the cost models) is distlab.measure.bubble; the equal-stage
model the sweep measures by default is distlab.models.balanced_bench_model. The by-hand scripts run with
distlab.launch.scripts.run_script.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.patches import Patch

from distlab.attention import sdpa_backends
from distlab.launch.local import launch_sweep, launch_training
from distlab.layer_split import describe_split, split_layers
from distlab.measure.bubble import (
    COMPUTE_KINDS,
    bubble_formula,
    formula_text,
    read_timeline,
    shift,
    stage_idle,
    typical_step,
)
from distlab.metrics import read_log
from distlab.models import load_model
from distlab.provenance import save_figure
from distlab.strategies.split import StageModule

# ---------------------------------------------------------------- the schedules, simulated and drawn

SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved 1F1B"}


def schedule_order(kind: str, stages: int, microbatches: int, virtual: int = 1) -> list[list[tuple[str, int, int]]]:
    """Each rank's ops in the order it runs them: (F or B, micro-batch, model chunk).

    gpipe: every forward, then every backward. 1f1b: p - r - 1 forwards to fill the pipeline, then one
    forward and one backward in turn, then the remaining backwards. interleaved (Megatron-LM's order):
    the same with v chunks per rank, micro-batches taken p at a time through each chunk in turn."""
    if kind == "interleaved" and microbatches % stages:
        raise ValueError(f"interleaved 1F1B takes micro-batches {stages} at a time: m={microbatches}")
    v = virtual if kind == "interleaved" else 1
    orders = []
    for r in range(stages):
        total = microbatches * v
        if kind == "gpipe":
            warmup = total
        elif kind == "1f1b":
            warmup = min(stages - r - 1, total)
        elif kind == "interleaved":
            warmup = min((stages - r - 1) * 2 + (v - 1) * stages, total)
        else:
            raise ValueError(f"schedule {kind!r}: expected one of {', '.join(SCHEDULE_NAMES)}")

        def op(name: str, k: int) -> tuple[str, int, int]:
            chunk = (k // stages) % v
            return name, (k // (stages * v)) * stages + k % stages, chunk if name == "F" else v - 1 - chunk

        ops = [op("F", k) for k in range(warmup)]
        for k in range(total - warmup):
            ops += [op("F", warmup + k), op("B", k)]
        ops += [op("B", k) for k in range(total - warmup, total)]
        orders.append(ops)
    return orders


def simulate_schedule(kind: str, stages: int = 2, microbatches: int = 4, virtual: int = 2, forward: float = 1.0,
                      backward: float = 2.0, speed: Sequence[float] | None = None) -> dict[str, Any]:
    """Run a schedule on ideal stages: every op starts as soon as its rank is free and its input exists
    (the previous model chunk's forward, the next one's backward), hand-offs cost nothing. A rank's
    forward takes `forward` x speed[rank] / v (v chunks share a stage's layers), its backward likewise.
    Returns the events (stage, kind, mb, chunk, t0, t1), each stage's idle fraction of the span, the
    bubble (their mean) and each stage's peak of micro-batch chunks whose activations it holds."""
    v = virtual if kind == "interleaved" else 1
    speed = list(speed or [1.0] * stages)
    orders = schedule_order(kind, stages, microbatches, v)
    last = stages * v - 1
    done: dict[tuple[str, int, int], float] = {}
    free, nxt, events = [0.0] * stages, [0] * stages, []
    while any(n < len(o) for n, o in zip(nxt, orders)):
        progressed = False
        for r, order in enumerate(orders):
            if nxt[r] == len(order):
                continue
            name, mb, chunk = order[nxt[r]]
            vs = chunk * stages + r  # the virtual stage: chunk c of rank r holds the model's part c p + r
            need = [("F", mb, vs - 1)] if name == "F" and vs > 0 else []
            if name == "B":
                need = [("F", mb, vs)] + ([("B", mb, vs + 1)] if vs < last else [])
            if not all(n in done for n in need):
                continue
            t0 = max([free[r]] + [done[n] for n in need])
            t1 = t0 + (forward if name == "F" else backward) * speed[r] / v
            done[(name, mb, vs)] = free[r] = t1
            events.append({"stage": r, "kind": name, "mb": mb, "chunk": chunk, "t0": t0, "t1": t1})
            nxt[r] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"{kind}: the order deadlocks at {nxt}")
    span = max(e["t1"] for e in events) - min(e["t0"] for e in events)
    idle = [1 - sum(e["t1"] - e["t0"] for e in events if e["stage"] == r) / span for r in range(stages)]
    held = []
    for r in range(stages):
        level, peak = 0, 0
        for e in sorted((e for e in events if e["stage"] == r), key=lambda e: e["t0"]):
            level += 1 if e["kind"] == "F" else -1
            peak = max(peak, level)
        held.append(peak)
    return {"events": events, "span": span, "stage_idle": idle, "bubble": statistics.fmean(idle), "held": held}


def draw_schedules(path: str | Path, provenance: dict, stages: int = 2, microbatches: int = 4, virtual: int = 2,
                   kinds: Sequence[str] = ("gpipe", "1f1b", "interleaved")) -> pd.DataFrame:
    """The schedules as Gantt charts on ideal stages (backward twice a forward, free hand-offs), one panel
    each on a common time axis; the second model chunk of interleaved 1F1B hatched. Saves the figure;
    returns the simulated bubble beside the formula and the activations each stage holds at most."""
    colors = {"F": "#4C72B0", "B": "#DD8452"}
    fig, axes = plt.subplots(len(kinds), 1, figsize=(10, 1.45 * stages * len(kinds) + 0.6), sharex=True)
    rows = []
    for ax, kind in zip(axes, kinds):
        sim = simulate_schedule(kind, stages, microbatches, virtual)
        v = virtual if kind == "interleaved" else 1
        for e in sim["events"]:
            ax.barh(e["stage"], e["t1"] - e["t0"], left=e["t0"], height=0.62, color=colors[e["kind"]],
                    edgecolor="black", lw=0.5, hatch="//" if e["chunk"] else None)
            ax.text((e["t0"] + e["t1"]) / 2, e["stage"], f"{e['kind']}{e['mb']}", ha="center", va="center",
                    fontsize=7 if v == 1 else 6, color="white", weight="bold")
        formula = bubble_formula(stages, microbatches, v)
        ax.set_title(f"{SCHEDULE_NAMES[kind]}: bubble {sim['bubble']:.3f} = (p-1)/({'v m' if v > 1 else 'm'}+p-1) "
                     f"= {formula:.3f}; stage 0 holds up to {sim['held'][0]} micro-batch"
                     f"{' chunks' if v > 1 else 'es'}", fontsize=9, loc="left")
        ax.set_yticks(range(stages))
        ax.set_yticklabels([f"stage {s}" for s in range(stages)])
        ax.set_ylim(stages - 0.5, -0.5)
        rows.append({"schedule": SCHEDULE_NAMES[kind], "p": stages, "m": microbatches, "v": v,
                     "bubble (simulated)": sim["bubble"], "(p-1)/(v m+p-1)": formula,
                     "stage 0 holds at most": sim["held"][0], "span (forward units)": sim["span"]})
    axes[-1].set_xlabel("time, in units of one micro-batch's forward through a whole stage (backward: 2 units)")
    handles = [Patch(color=colors["F"], label="forward"), Patch(color=colors["B"], label="backward"),
               Patch(facecolor="white", edgecolor="black", hatch="//", label="second model chunk (interleaved)")]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, bbox_to_anchor=(0.5, 0.0))
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    save_figure(fig, path, provenance)
    plt.close(fig)
    return pd.DataFrame(rows).set_index("schedule")


def plot_timeline(ax, events: Sequence[dict], title: str = "", show_comm: bool = False, unit: float = 1e3) -> None:
    """Gantt chart: one row per stage, forward (blue) and backward (orange) boxes labelled by
    micro-batch (hatched: a rank's second model chunk, interleaved). Idle gaps are the bubble.
    `show_comm` adds receive waits as thin grey bars."""
    evs = shift(events)
    stages = sorted({e["stage"] for e in evs if e["kind"] in COMPUTE_KINDS})
    colors = {"F": "#4C72B0", "B": "#DD8452"}
    for e in evs:
        y = e["stage"]
        if e["kind"] in COMPUTE_KINDS:
            w = (e["t1"] - e["t0"]) * unit
            ax.barh(y, w, left=e["t0"] * unit, height=0.6, color=colors[e["kind"]], edgecolor="black", lw=0.4,
                    hatch="///" if e.get("chunk", 0) else None)  # interleaved: the rank's second model chunk
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


def plot_timelines(runs: dict[str, Any], step: int | None = None, figsize=(11, 3.4)):
    """Gantt charts side by side, one per labelled run folder, on a common time axis, all showing the
    same step: the given one, or the first run's typical step (median span). Returns the figure."""
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
        theory = bubble_formula(rec["stages"], rec["microbatches"], rec.get("virtual", 1))
        plot_timeline(ax, rec["events"], f"{label}: m={rec['microbatches']}, step {rec['step']}, bubble "
                                         f"{s['bubble']:.2f} (theory {theory:.2f})")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#4C72B0", "#DD8452")]
    labels = ["forward", "backward"]
    if any(r.get("virtual", 1) > 1 for records in timelines.values() for r in records):
        handles.append(plt.Rectangle((0, 0), 1, 1, fc="white", ec="black", hatch="///"))
        labels.append("a rank's second model chunk")
    # below the charts, right of the provenance line: no box hidden
    fig.legend(handles, labels, fontsize=7, loc="lower right", ncol=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


# ---------------------------------------------------------------- the library's pipelines against one device


def compare_pipelines(base: dict, micro_batch_size: int, grad_accum: int, steps: int, nproc: int,
                      timeout_s: int = 900, deepspeed: bool = True) -> tuple[pd.DataFrame, dict]:
    """Single-device training, then torch's pipeline (GPipe and 1F1B) and DeepSpeed's PipelineModule back to
    back in one launch, on the same global batch (`deepspeed=False`: torch's two alone, where DeepSpeed's op
    cannot be built). Returns (the loss per step of each, the jobs)."""
    cmp = {**base, "micro_batch_size": micro_batch_size, "grad_accum": grad_accum, "max_steps": steps,
           "warmup_steps": 1}
    jobs = {"single device": launch_training("04_single", 1, {**cmp, "strategy": "single", "pipeline_stages": None,
                                                              "stage_layers": None}, timeout_s=timeout_s, echo=False)}
    variants = {"DeepSpeed PipelineModule": ("04_ds_pipeline", {"strategy": "ds_pipeline"}),
                "pipeline, GPipe": ("04_pipeline_gpipe", {"pipeline_schedule": "gpipe"}),
                "pipeline, 1F1B": ("04_pipeline_1f1b", {"pipeline_schedule": "1f1b"})}
    if not deepspeed:
        del variants["DeepSpeed PipelineModule"]
    split = launch_sweep("04_pipelines", nproc, {**cmp, "strategy": "pipeline"}, dict(variants.values()),
                         timeout_s=timeout_s, echo=False)
    jobs.update({label: split[name] for label, (name, _) in variants.items()})
    curves = pd.DataFrame({label: [r["loss"] for r in read_log(job.log)] for label, job in jobs.items()},
                          index=range(1, steps + 1)).rename_axis("step")
    return curves, jobs


def plot_loss_curves(curves: pd.DataFrame, path, provenance: dict, title: str) -> pd.DataFrame:
    """The loss curves on top, each pipeline's relative difference from single-device training below (log
    scale, shrinking markers so that equal values stay visible). Saves the figure; returns the differences."""
    ref = curves["single device"]
    rel = curves.drop(columns="single device").sub(ref, axis=0).abs().div(ref.abs(), axis=0)
    fig, (ax, axd) = plt.subplots(2, 1, figsize=(6.5, 4.6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    styles = ["o-", "x--", "s:", "^-."]
    colors = {label: f"C{i}" for i, label in enumerate(curves)}
    for (label, style), lw, ms in zip(zip(curves, styles), (3, 1, 1, 1), (7, 6, 5, 5)):
        ax.plot(curves.index, curves[label], style, ms=ms, lw=lw, alpha=0.5 if lw == 3 else 1, label=label,
                color=colors[label], mfc="none" if style[0] in "s^" else None)
    ax.set_ylabel("training loss")
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    for j, (label, style) in enumerate(zip(rel, styles[1:])):
        axd.plot(rel.index, rel[label].clip(lower=1e-12), style, ms=10 - 3 * j, mfc="none", color=colors[label])
    axd.set_yscale("log")
    axd.set_ylabel("relative difference\nfrom single device", fontsize=8)
    axd.set_xlabel("optimizer step")
    axd.set_xticks(list(curves.index))
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    save_figure(fig, path, provenance)
    plt.close(fig)
    return rel


# ---------------------------------------------------------------- the bubble measured


def bubble_columns(bub: pd.DataFrame) -> list[str]:
    """The sweep table's columns a reader needs, in reading order."""
    return (["m", "schedule", "schedule_run", "measured", "theory", "model_handoff", "model_costs", "abs_diff",
             "compute_ms", "handoff_ms", "imbalance"] + [c for c in bub.columns if c.startswith("idle_stage")]
            + ["pipeline_span_s", "comm_time_s"])


def interleaved_vs_1f1b(bub: pd.DataFrame) -> pd.DataFrame:
    """1F1B and interleaved 1F1B at the micro-batch counts both ran: each one's formula, theory and
    measured bubble (median over steady steps), and |measured - theory|."""
    both = set(bub[bub.schedule == "1f1b"].m) & set(bub[bub.schedule == "interleaved"].m)
    rows = bub[bub.schedule.isin(["1f1b", "interleaved"]) & bub.m.isin(both)].sort_values(["m", "schedule"])
    out = rows[["m", "schedule", "v", "theory", "measured", "abs_diff", "pipeline_span_s"]].copy()
    out.insert(3, "formula", [formula_text(v) for v in out["v"]])
    return out.set_index(["m", "schedule"])


def plot_bubble_vs_m(bub: pd.DataFrame, stages: int, path, provenance: dict) -> None:
    """Measured idle fraction (mean of stages and each stage) against m, beside the theory and the
    hand-off model; the two schedules drawn side by side at each m."""
    ms = sorted(bub["m"].unique())
    idle_cols = [c for c in bub.columns if c.startswith("idle_stage")]
    fig, ax = plt.subplots(figsize=(7, 5))
    mm = np.geomspace(min(ms) / 1.3, max(ms) * 1.3, 100)
    ax.plot(mm, (stages - 1) / (mm + stages - 1), color="0.4", lw=1.2, label="theory (p-1)/(m+p-1)")
    offsets = {"gpipe": 0.94, "1f1b": 1.06}  # side by side in log-x, so no marker hides another
    for sched, color in (("gpipe", "C0"), ("1f1b", "C1")):
        d = bub[bub.schedule == sched].sort_values("m")
        x = d["m"] * offsets[sched]
        ax.plot(x, d["model_handoff"], "_", ms=14, mew=2, color=color, label=f"{sched}: model with hand-off")
        ax.plot(x, d["measured"], "o", ms=7, color=color, label=f"{sched}: measured, mean of stages")
        for c, marker in zip(idle_cols, ("v", "^", "<", ">")):
            ax.plot(x, d[c], marker, ms=5, mfc="none", color=color, alpha=0.8,
                    label=f"{sched}: {c.replace('idle_stage', 'stage ')}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms)
    ax.set_xticklabels(ms)
    ax.set_xlim(mm[0], mm[-1])
    ax.set_ylim(0, None)
    ax.minorticks_off()
    ax.set_xlabel("micro-batches per step (m); the two schedules drawn side by side at each m")
    ax.set_ylabel("idle fraction of a step")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    ax.set_title(f"pipeline bubble, p = {stages}: measured, theory, and with the measured hand-off", fontsize=9)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    save_figure(fig, path, provenance)
    plt.close(fig)


def box_durations(run_dirs: dict[str, Any], step: int | None = None) -> pd.DataFrame:
    """Median forward and backward box (ms) per stage in the drawn step of each labelled run, the
    step's span, and the minor page faults the stage's boxes took (fresh memory touched: its cost is
    inside the boxes): what makes one timeline longer than another at the same count of idle slots."""
    rows = []
    timelines = {label: read_timeline(d) for label, d in run_dirs.items()}
    step = step if step is not None else typical_step(next(iter(timelines.values())))["step"]
    for label, records in timelines.items():
        events = shift(next(r for r in records if r["step"] == step)["events"])
        compute = [e for e in events if e["kind"] in COMPUTE_KINDS]
        for stage in sorted({e["stage"] for e in compute}):
            row = {"schedule": label, "stage": stage}
            for kind in COMPUTE_KINDS:
                row[f"{kind} median ms"] = 1e3 * statistics.median(
                    e["t1"] - e["t0"] for e in compute if e["stage"] == stage and e["kind"] == kind)
            row["span ms"] = 1e3 * max(e["t1"] for e in compute)
            row["page faults"] = sum(e.get("page_faults", 0) for e in compute if e["stage"] == stage)
            rows.append(row)
    return pd.DataFrame(rows).set_index(["schedule", "stage"])


def plot_activation_memory(bub: pd.DataFrame, path, provenance: dict) -> pd.DataFrame:
    """Each stage's peak of saved activations against m for both schedules. Saves the figure; returns the
    peaks in MiB (rows m, columns (stage, schedule))."""
    act_cols = [c for c in bub.columns if c.startswith("activation_peak_bytes_stage")]
    ms = sorted(bub["m"].unique())
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    for sched, ls in (("gpipe", "-"), ("1f1b", "--")):
        d = bub[bub.schedule == sched].sort_values("m")
        for c, marker in zip(act_cols, ("o", "s", "^", "v")):
            ax.plot(d["m"], d[c] / 2**20, ls, marker=marker, mfc="none" if sched == "1f1b" else None,
                    label=f"{sched}, {c.replace('activation_peak_bytes_', '').replace('stage', 'stage ')}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms)
    ax.set_xticklabels(ms)
    ax.set_ylim(0, None)
    ax.set_xlabel("micro-batches per step (m)")
    ax.set_ylabel("peak activations held (MiB)")
    ax.legend(fontsize=7)
    ax.set_title("activation memory per stage")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    save_figure(fig, path, provenance)
    plt.close(fig)
    peaks = bub.pivot(index="m", columns="schedule", values=act_cols) / 2**20
    peaks.columns = [f"{c.replace('activation_peak_bytes_', '')} {s} (MiB)" for c, s in peaks.columns]
    return peaks


# ---------------------------------------------------------------- the DeepSpeed pipeline study's table


def ga_sweep(table: pd.DataFrame, micro: int) -> pd.DataFrame:
    """The table's rows at one micro-batch size with the first such row's checkpointing and dtype, by GA."""
    same = table[table.micro_bsz == micro]
    ref = same.iloc[0]
    return same[(same["ckpt"] == ref["ckpt"]) & (same["dtype"] == ref["dtype"])].sort_values("GA")


def plot_ga_sweep(ga: pd.DataFrame, stages: int, path, provenance: dict) -> None:
    """Throughput against GA (mean, min-max bars over steady steps) beside the measured busy fraction,
    1 - (p-1)/(m+p-1) and the cost model's (section 4: the formula with the measured hand-off)."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9.5, 3.6))
    err = [ga["tokens_per_s"] - ga["tokens_per_s_min"], ga["tokens_per_s_max"] - ga["tokens_per_s"]]
    ax1.errorbar(ga["GA"], ga["tokens_per_s"], yerr=err, fmt="o-", capsize=4,
                 label="mean, bars: min-max over steady steps")
    ax1.set_ylim(0, None)
    ax1.set_xlabel(f"GA (= micro-batches m), micro_bsz {int(ga['micro_bsz'].iloc[0])}")
    ax1.set_ylabel("tokens/s (all ranks)")
    ax1.set_title(f"throughput vs GA (activation checkpointing {ga['ckpt'].iloc[0]}, {ga['dtype'].iloc[0]})",
                  fontsize=9)
    ax1.legend(fontsize=7, loc="lower right")
    ax2.plot(ga["GA"], 1 - ga["bubble_fraction"], "o-", label="measured busy fraction")
    ax2.plot(ga["GA"], [1 - bubble_formula(stages, g) for g in ga["GA"]], "x--", color="0.4",
             label="1 - (p-1)/(m+p-1)")
    if "bubble_model" in ga:  # section 4's cost model: the formula plus the measured hand-off and stage imbalance
        ax2.plot(ga["GA"], 1 - ga["bubble_model"], "s:", color="tab:orange", label="cost model (measured hand-off)")
    ax2.set_ylim(0, 1.05)
    ax2.set_xlabel("GA")
    ax2.set_ylabel("busy fraction of a step")
    ax2.set_title("why: the bubble shrinks", fontsize=9)
    ax2.legend(fontsize=7, loc="lower right")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ga["GA"])
        ax.set_xticklabels(ga["GA"])
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    save_figure(fig, path, provenance)
    plt.close(fig)


def sdpa_table(device) -> pd.DataFrame:
    """Which attention backends run here and which one PyTorch picks, for plain causal and masked attention."""
    return pd.DataFrame(sdpa_backends(device)).set_index("attention")


def save_timelines(runs: dict[str, Any], path, provenance: dict) -> None:
    """plot_timelines, saved with provenance and closed (the notebook shows the saved image)."""
    fig = plot_timelines(runs)
    save_figure(fig, path, provenance)
    plt.close(fig)


def split_table(model: str | None, stages: int, stage_layers: Sequence[int] | None = None) -> pd.DataFrame:
    """What each stage runs and holds: its layers (and the embedding, norm, head) and its parameters."""
    causal = load_model(model)
    ranges = split_layers(causal.config.num_hidden_layers, stages, stage_layers)
    rows = []
    for s, layers in enumerate(ranges):
        stage = StageModule(causal, layers, s == 0, s == stages - 1)
        rows.append({"stage": s, "runs": describe_split(ranges)[s].split(": ", 1)[1],
                     "parameters (M)": sum(p.numel() for p in stage.parameters()) / 1e6})
    return pd.DataFrame(rows).set_index("stage")
