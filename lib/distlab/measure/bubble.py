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

Hand-off. The theory counts compute only. Every micro-batch also crosses a stage boundary: the
receiver's copy of the message (gloo on CPU), posting the send and receive, the schedule's Python
between two ops. Per stage, the time inside its own window (its first op start to its last op
end) that is neither compute nor waiting for the peer (a receive posted before the sender posted
its send: that is the bubble) is its hand-off time; h = that time / m, averaged over stages.

Models. With t_s the compute (forward + backward) per micro-batch of stage s and h the hand-off
per micro-batch, the first micro-batch crosses every stage once, the other m - 1 follow at the
pace of the slowest stage, and every one of the m + p - 1 slots carries one hand-off:

    span = sum_s t_s + (m - 1) max_s t_s + (m + p - 1) h,   idle_s = 1 - m t_s / span.

Equal stages (t_s = t): span = (m + p - 1)(t + h), so

    bubble = 1 - m t / ((m + p - 1)(t + h)) = (p - 1)/(m + p - 1) + m h / ((m + p - 1)(t + h)):

the theory plus an excess that grows with m towards h / (t + h). `handoff_bubble` is that model;
`cost_bubble` adds the measured stage imbalance. Assumed: one thread per stage that computes and
communicates in turn (no overlap, as on CPU with gloo), the same h for every micro-batch and
direction, and the same t_s for every micro-batch. The simple theory applies where
m h / (t + h) and the imbalance are small against the tolerance.

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


def peer_waits(events: Sequence[dict]) -> dict[int, float]:
    """Per stage, the time its receives waited for the sender to post (the k-th receive at b from a
    matched with the k-th send from a to b), clipped to the stage's own compute window."""
    ops = compute_events(events)
    window = {s: (min(e["t0"] for e in ops if e["stage"] == s), max(e["t1"] for e in ops if e["stage"] == s))
              for s in {e["stage"] for e in ops}}
    sends: dict[tuple[int, int], list[dict]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for e in sorted(events, key=lambda e: e["t0"]):
        if e["kind"] == "send":
            sends[(e["stage"], e["peer"])].append(e)
        elif e["kind"] == "recv":
            recvs[(e["peer"], e["stage"])].append(e)
    wait: dict[int, float] = defaultdict(float)
    for pair, rs in recvs.items():
        ss = sends.get(pair, [])
        for k, r in enumerate(rs):
            w0, w1 = window.get(r["stage"], (r["t0"], r["t1"]))
            posted = ss[k]["t0"] if k < len(ss) else r["t1"]
            start, end = max(r["t0"], w0), min(posted, r["t1"], w1)
            wait[r["stage"]] += max(0.0, end - start)
    return dict(wait)


def handoff(events: Sequence[dict]) -> dict[str, Any]:
    """Per stage: compute per micro-batch, and hand-off per micro-batch (its window minus compute minus
    waiting for the peer, over m); see the module docstring."""
    ops = compute_events(events)
    waits = peer_waits(events)
    m = len({e["mb"] for e in ops})
    compute, hand = {}, {}
    for s in sorted({e["stage"] for e in ops}):
        mine = [e for e in ops if e["stage"] == s]
        busy = sum(e["t1"] - e["t0"] for e in mine)
        window = max(e["t1"] for e in mine) - min(e["t0"] for e in mine)
        compute[s] = busy / m
        hand[s] = max(0.0, window - busy - waits.get(s, 0.0)) / m
    return {"compute_per_mb_s": [compute[s] for s in compute], "handoff_per_mb_s": [hand[s] for s in hand]}


def cost_bubble(compute_per_mb: Sequence[float], handoff_per_mb: float, microbatches: int) -> float:
    """Mean idle fraction over stages predicted from measured costs (module docstring): per-stage
    compute t_s per micro-batch, hand-off h per micro-batch, m micro-batches."""
    p, m = len(compute_per_mb), microbatches
    span = sum(compute_per_mb) + (m - 1) * max(compute_per_mb) + (m + p - 1) * handoff_per_mb
    return sum(1 - m * t / span for t in compute_per_mb) / p


def handoff_bubble(stages: int, microbatches: int, compute_per_mb: float, handoff_per_mb: float) -> float:
    """Equal stages with a hand-off h per micro-batch: 1 - m t / ((m + p - 1)(t + h))."""
    return cost_bubble([compute_per_mb] * stages, handoff_per_mb, microbatches)


def step_summary(events: Sequence[dict]) -> dict[str, Any]:
    """What the step log records per step: bubble, per-stage idle, communication time and bytes."""
    idle = stage_idle(events)
    msgs = transfers(events)
    costs = handoff(events)
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
        **costs,
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
    for key in ("stage_idle", "compute_per_mb_s", "handoff_per_mb_s"):
        if all(key in s for s in summaries):
            out[key] = [f(list(v)) for v in zip(*[s[key] for s in summaries])]
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
    (jobs.launch_sweep), repeated `rounds` times (one launch per round, every configuration once in
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
