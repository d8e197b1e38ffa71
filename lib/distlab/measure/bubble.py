"""Pipeline bubbles: the theory, and what a recorded timeline of per-stage timestamps says.

Pure functions of a timeline (the events below, or a run's pipeline_timeline.jsonl): no runs, no models,
no plots. The sweeps that record timelines and their tables are distlab.pipeline_sweeps, the Gantt charts
chapter 04's plumbing (distlab.chapters.ch04); the equal-stage model they measure is
distlab.models.balanced_bench_model. The theory is one function, `bubble_formula` (v = 1 for GPipe and 1F1B,
v model chunks per rank for interleaved 1F1B).

Both pipeline strategies (torch.distributed.pipelining and DeepSpeed's PipelineModule) record, for
every optimizer step, one event per forward and per backward of each micro-batch on each stage,
and one per stage-to-stage send and receive, on a clock common to all ranks:

    {"stage": 0, "kind": "F", "mb": 3, "t0": 12.001, "t1": 12.045}                 compute
    {"stage": 1, "kind": "recv", "peer": 0, "what": "act", "t0": ..., "t1": ..., "bytes": 1048576}

(t0: posted; t1: its wait returned; torch's receives also carry `tw`, when the wait began: the
interleaved schedule posts receives early and computes meanwhile, so only tw..t1 is blocked.)

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
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Sequence

from distlab.results import schema

COMPUTE_KINDS = ("F", "B")


def bubble_formula(stages: int, microbatches: int, virtual: int = 1) -> float:
    """The idle fraction of every stage in a step on equal stages with free hand-offs: (p-1)/(v m + p-1); v = 1
    for GPipe and 1F1B, v model chunks per rank for interleaved 1F1B (each chunk's work is 1/v of a stage's)."""
    return (stages - 1) / (virtual * microbatches + stages - 1)



def formula_text(virtual: int = 1) -> str:
    """bubble_formula as a reader writes it."""
    return "(p-1)/(m+p-1)" if virtual == 1 else f"(p-1)/({virtual:g}m+p-1)"


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


def matched_messages(events: Sequence[dict]) -> list[tuple[tuple[int, int], dict, dict | None]]:
    """Each receive with its matching send: the k-th receive at b from a is the k-th send from a to b
    (None when the timeline holds no such send). Items are ((src, dst), recv, send)."""
    sends: dict[tuple[int, int], list[dict]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for e in sorted(events, key=lambda e: e["t0"]):
        if e["kind"] == "send":
            sends[(e["stage"], e["peer"])].append(e)
        elif e["kind"] == "recv":
            recvs[(e["peer"], e["stage"])].append(e)
    return [(pair, r, sends[pair][k] if k < len(sends[pair]) else None)
            for pair, rs in recvs.items() for k, r in enumerate(rs)]


def transfers(events: Sequence[dict]) -> list[dict]:
    """Each received message with its transfer time (see the module docstring) and size."""
    out = []
    for pair, r, s in matched_messages(events):
        ready = max(r["t0"], s["t0"]) if s is not None else r["t0"]
        out.append({"src": pair[0], "dst": pair[1], "what": r.get("what", ""), "bytes": r.get("bytes", 0),
                    "transfer_s": max(0.0, r["t1"] - ready), "blocked_s": r["t1"] - r.get("tw", r["t0"])})
    return out


def peer_waits(events: Sequence[dict]) -> dict[int, float]:
    """Per stage, the time its receives waited for the sender to post (matched_messages), clipped to the
    stage's own compute window."""
    ops = compute_events(events)
    window = {s: (min(e["t0"] for e in ops if e["stage"] == s), max(e["t1"] for e in ops if e["stage"] == s))
              for s in {e["stage"] for e in ops}}
    wait: dict[int, float] = defaultdict(float)
    for _, r, s in matched_messages(events):
        w0, w1 = window.get(r["stage"], (r["t0"], r["t1"]))
        posted = s["t0"] if s is not None else r["t1"]
        start, end = max(r.get("tw", r["t0"]), w0), min(posted, r["t1"], w1)
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


def read_timeline(run_dir) -> list[dict]:
    """The per-step timelines a measured pipeline run wrote (<output_dir>/pipeline_timeline.jsonl)."""

    path = Path(run_dir) / "pipeline_timeline.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no timeline (run the pipeline strategy with measure_comm=True)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def typical_step(records: Sequence[dict]) -> dict:
    """The steady-state step whose span is the median one (a representative step to draw)."""
    steady = [r for r in records if r["step"] > schema.WARMUP_STEPS] or list(records)
    spans = sorted(steady, key=lambda r: stage_idle(r["events"])["span_s"])
    return spans[(len(spans) - 1) // 2]
