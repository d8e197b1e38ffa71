"""Pipeline bubbles: the theory, the measurement from per-stage timestamps, and the timeline plot.

Both pipeline strategies (torch.distributed.pipelining and DeepSpeed's PipelineModule) record, for
every optimizer step, one event per forward and per backward of each micro-batch on each stage,
and one per stage-to-stage send and receive, on a clock common to all ranks:

    {"stage": 0, "kind": "F", "mb": 3, "t0": 12.001, "t1": 12.045}                 compute
    {"stage": 1, "kind": "recv", "peer": 0, "what": "act", "t0": ..., "t1": ..., "bytes": 1048576}

Bubble. With p stages and m micro-batches, a fill-drain schedule (GPipe) keeps each stage busy for
m forward+backward slots out of m + p - 1, so each stage idles for (p - 1) / (m + p - 1) of the
step, whatever the forward/backward ratio, as long as the stages take equal time. 1F1B reorders the
same work (a backward as soon as possible) and has the same bubble; what it changes is memory: a
stage holds at most p micro-batches of activations instead of m.

Measured: span = last op end on any stage - first op start on any stage (the schedule's step);
busy(stage) = sum of its forward and backward durations; idle(stage) = 1 - busy / span. The
pipeline's bubble fraction is the mean idle fraction over stages. Unequal stages (the embedding
on the first, the LM head and loss on the last) raise the idle time of the lighter stage above
the theory and lower the heavier stage's: the per-stage numbers show which.

Communication. A receive is complete at t1 of its event; its message could not move before both
the sender had posted the send and the receiver the receive. The transfer time of a message is
recv.t1 - max(recv.t0, send.t0), matching the k-th send from stage a to stage b with the k-th
receive at b from a (point-to-point messages between two ranks arrive in order). Time blocked in
a receive before the sender posted is waiting (that is the bubble), not communication.
"""

from __future__ import annotations

import json
import shutil
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Sequence

import pandas as pd
import torch

from distlab.launch.jobs import launch_sweep
from distlab.metrics import read_log
from distlab.models import TINY_QWEN2, load_tokenizer, qwen2_config
from distlab.paths import MODEL_CACHE, RUNS_DIR
from distlab.results import schema

COMPUTE_KINDS = ("F", "B")


def theoretical_bubble(stages: int, microbatches: int) -> float:
    """Idle fraction of every stage in a balanced GPipe or 1F1B schedule: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def compute_events(events: Iterable[dict]) -> list[dict]:
    return [e for e in events if e["kind"] in COMPUTE_KINDS]


def stage_idle(events: Sequence[dict]) -> dict[str, Any]:
    """Per-stage busy time and idle fraction over one step's events (all stages together)."""
    ops = compute_events(events)
    if not ops:
        raise ValueError("no forward/backward events: was the timeline recorded (measure_comm=True)?")
    start = min(e["t0"] for e in ops)
    end = max(e["t1"] for e in ops)
    span = end - start
    busy: dict[int, float] = defaultdict(float)
    for e in ops:
        busy[e["stage"]] += e["t1"] - e["t0"]
    stages = sorted(busy)
    idle = {s: 1.0 - busy[s] / span for s in stages}
    return {"span_s": span, "busy_s": dict(busy), "idle": idle,
            "bubble": sum(idle.values()) / len(idle), "stages": len(stages),
            "microbatches": len({e["mb"] for e in ops})}


def transfers(events: Sequence[dict]) -> list[dict]:
    """Each received message with its transfer time (see the module docstring) and size."""
    sends: dict[tuple[int, int], list[dict]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for e in sorted(events, key=lambda e: e["t0"]):
        if e["kind"] == "send":
            sends[(e["stage"], e["peer"])].append(e)
        elif e["kind"] == "recv":
            recvs[(e["peer"], e["stage"])].append(e)
    out = []
    for pair, rs in recvs.items():
        ss = sends.get(pair, [])
        for k, r in enumerate(rs):
            s = ss[k] if k < len(ss) else None
            ready = max(r["t0"], s["t0"]) if s is not None else r["t0"]
            out.append({"src": pair[0], "dst": pair[1], "what": r.get("what", ""), "bytes": r.get("bytes", 0),
                        "transfer_s": max(0.0, r["t1"] - ready), "blocked_s": r["t1"] - r["t0"]})
    return out


def step_summary(events: Sequence[dict]) -> dict[str, Any]:
    """What the step log records per step: bubble, per-stage idle, communication time and bytes."""
    idle = stage_idle(events)
    msgs = transfers(events)
    return {
        "bubble_fraction": idle["bubble"],
        "stage_idle": [idle["idle"][s] for s in sorted(idle["idle"])],
        "stage_busy_s": [idle["busy_s"][s] for s in sorted(idle["busy_s"])],
        "pipeline_span_s": idle["span_s"],
        "microbatches": idle["microbatches"],
        "comm_time_s": sum(m["transfer_s"] for m in msgs),
        "comm_bytes": int(sum(m["bytes"] for m in msgs)),
        "p2p_blocked_s": sum(m["blocked_s"] for m in msgs),
        "messages": len(msgs),
    }


def shift(events: Sequence[dict], origin: float | None = None) -> list[dict]:
    """Events with times relative to the step's first compute start (for plotting)."""
    if origin is None:
        origin = min(e["t0"] for e in compute_events(events))
    return [{**e, "t0": e["t0"] - origin, "t1": e["t1"] - origin} for e in events]


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


def aggregate(summaries: Sequence[dict], statistic: str = "median") -> dict[str, float]:
    """Median (default) or mean over steps of step_summary() results; leave warm-up steps out
    first. The median keeps one step disturbed by another process on a shared machine from
    moving the result; the notebook shows every step too."""
    if not summaries:
        raise ValueError("no steps to aggregate")
    f = statistics.median if statistic == "median" else statistics.fmean
    out: dict[str, Any] = {k: f([s[k] for s in summaries]) for k in
                           ("bubble_fraction", "pipeline_span_s", "comm_time_s", "p2p_blocked_s", "comm_bytes")}
    out["stage_idle"] = [f(list(v)) for v in zip(*[s["stage_idle"] for s in summaries])]
    out["steps"] = len(summaries)
    return out


# --------------------------------------------------------------------------- runs and sweeps

def read_timeline(run_dir) -> list[dict]:
    """The per-step timelines a measured pipeline run wrote (<output_dir>/pipeline_timeline.jsonl)."""

    path = Path(run_dir) / "pipeline_timeline.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no timeline (run the pipeline strategy with measure_comm=True)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def balanced_bench_model(intermediate_size: int = 4096, layers: int = 4) -> str:
    """A folder with a random-init model of the tiny Qwen2's shape (same tokenizer, vocabulary,
    hidden size), but an FFN `intermediate_size` wide, built once under build/models.

    Why: only the last stage runs the final norm, the LM head and the loss (and it computes the
    input gradient it sends back, which the first stage skips). With the tiny model's FFN (688) that
    is about half a decoder layer, so a [2, 2] split is ~20% unbalanced and the lighter stage idles
    far more than (p-1)/(m+p-1) predicts. With a 4096-wide FFN the last stage is measured ~8% slower
    per micro-batch on a 2-core CPU (two ranks, one thread each); the bubble then mostly measures the
    schedule, and the remaining imbalance shows as the lighter stage idling a few hundredths more."""


    folder = MODEL_CACHE / f"pipeline-bench-ffn{intermediate_size}-l{layers}"
    stamp = folder / "distlab_build.json"
    spec = {"intermediate_size": intermediate_size, "num_hidden_layers": layers, "recipe": 1}
    if stamp.exists() and json.loads(stamp.read_text()) == spec:
        return str(folder)
    from transformers import Qwen2ForCausalLM  # deferred: transformers is slow to import

    tokenizer = load_tokenizer(None)
    shape = {**TINY_QWEN2, "intermediate_size": intermediate_size, "num_hidden_layers": layers}
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen2_config(tokenizer, **shape))
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "distlab_build.json").write_text(json.dumps(spec))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return str(folder)


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
    return agg


def bubble_sweep(microbatches: Sequence[int] = (1, 2, 4, 8), schedules: Sequence[str] = ("gpipe", "1f1b"),
                 model: str | None = None, micro_batch_size: int = 2, seq_len: int = 256, steps: int = 4,
                 stages: int = 2, runs_dir=None, prefix: str = "bubble",
                 extra: dict | None = None, echo: bool = False, timeout_s: int = 900):
    """One measured pipeline run per (schedule, m) through the training loop, all in one launch
    (jobs.launch_sweep); a table with the measured bubble (mean idle fraction over stages),
    per-stage idle, the theory and |diff|."""


    base = {"strategy": "pipeline", "pipeline_stages": stages, "model": model, "micro_batch_size": micro_batch_size,
            "seq_len": seq_len, "max_steps": steps, "warmup_steps": 1, "measure_comm": True, "eval_file": None,
            "save_model": False, "logging_steps": 1, "lora_dropout": 0.0, **(extra or {})}
    variants = {f"{prefix}_{schedule}_m{m}": {"pipeline_schedule": schedule, "grad_accum": m}
                for schedule in schedules for m in microbatches}
    jobs = launch_sweep(prefix, stages, base, variants, runs_dir=runs_dir or RUNS_DIR, echo=False,
                        timeout_s=timeout_s)
    rows = []
    for name, job in jobs.items():
        schedule, m = variants[name]["pipeline_schedule"], variants[name]["grad_accum"]
        agg = measure_run(job.output_dir)
        row = {"schedule": schedule, "schedule_run": agg["schedule"], "m": m, "p": stages,
               "measured": agg["bubble_fraction"], "theory": agg["theory"], "abs_diff": abs(agg["diff"])}
        for s, idle in enumerate(agg["stage_idle"]):
            row[f"idle_stage{s}"] = idle
        row.update(pipeline_span_s=agg["pipeline_span_s"], comm_time_s=agg["comm_time_s"],
                   p2p_blocked_s=agg["p2p_blocked_s"])
        steady = schema.steady(read_log(job.log))  # activation peaks: the most any steady step held, per stage
        for s in range(len(steady[-1].get("stage_activation_peak_bytes", []))):
            row[f"activation_peak_bytes_stage{s}"] = max(r["stage_activation_peak_bytes"][s] for r in steady)
        row["run_dir"] = str(job.output_dir)
        rows.append(row)
        if echo:
            idle = " ".join(f"{row[f'idle_stage{s}']:.3f}" for s in range(stages))
            print(f"{schedule:5s} m={m}: bubble measured {row['measured']:.3f} (stages {idle}), "
                  f"theory {row['theory']:.3f}, span {row['pipeline_span_s'] * 1e3:.0f} ms", flush=True)
    if echo:
        print(f"{len(jobs)} runs in one launch: {next(iter(jobs.values())).result.elapsed_s:.0f} s", flush=True)
    return pd.DataFrame(rows)


def table_row(job, *, strategy: str, micro: int, ga: int, ckpt: bool, dtype: str, seq_len: int,
              data_parallel: int) -> dict[str, Any]:
    """One row of the DeepSpeed-PP seed's table from a finished run: the seed's setup columns (chapter 04's
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


def typical_step(records: Sequence[dict]) -> dict:
    """The steady-state step whose span is the median one (a representative step to draw)."""
    steady = [r for r in records if r["step"] > schema.WARMUP_STEPS] or list(records)
    spans = sorted(steady, key=lambda r: stage_idle(r["events"])["span_s"])
    return spans[(len(spans) - 1) // 2]


def plot_timelines(runs: dict[str, Any], step: int | None = None, figsize=(11, 3.4)):
    """Gantt charts side by side, one per labelled run folder, on a common time axis: the given
    step, or each run's typical step (median span). Returns the figure."""
    import matplotlib.pyplot as plt  # deferred: plotting is only needed when drawing

    fig, axes = plt.subplots(1, len(runs), figsize=figsize, sharex=True)
    axes = [axes] if len(runs) == 1 else list(axes)
    for ax, (label, run_dir) in zip(axes, runs.items()):
        records = read_timeline(run_dir)
        rec = typical_step(records) if step is None else next(r for r in records if r["step"] == step)
        s = stage_idle(rec["events"])
        theory = theoretical_bubble(rec["stages"], rec["microbatches"])
        plot_timeline(ax, rec["events"], f"{label}: m={rec['microbatches']}, step {rec['step']}, bubble "
                                         f"{s['bubble']:.2f} (theory {theory:.2f})")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#4C72B0", "#DD8452")]
    axes[-1].legend(handles, ["forward", "backward"], fontsize=7, loc="lower right")
    fig.tight_layout(rect=(0, 0.04, 1, 1))  # room for the provenance line
    return fig
