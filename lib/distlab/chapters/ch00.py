"""Chapter 00 (the environment): the ring all-reduce drawn step by step, the by-hand timing's output read
back, the latency-bandwidth prediction set against the library's sweep, the sweep's figure (bus and
algorithm bandwidth against the message size) and the phases of the sweep for the utilisation timeline.
The measurement itself is distlab.workers.launcher.run_allreduce_bench."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from distlab import provenance as prov
from distlab.measure.limits import size_text
from distlab.workers.allreduce_bench import bus_factor

# ---------------------------------------------------------------- the ring, simulated and drawn


def ring_allreduce_steps(n: int) -> list[dict[str, Any]]:
    """The ring all-reduce of n ranks, each holding n chunks, as a list of steps.

    Each step: `phase` ('start', 'reduce-scatter', 'all-gather'), `sends` [(from, to, chunk)], and
    `state`, per rank and chunk the set of ranks whose values that chunk sums after the step. In
    reduce-scatter step s rank r sends chunk (r - s) mod n to rank r + 1, which adds it to its own; after
    n - 1 steps rank r holds the full sum of chunk r + 1. In all-gather step s it passes the full chunk
    (r + 1 - s) mod n on, and the receiver overwrites its copy."""
    if n < 2:
        raise ValueError(f"a ring needs at least 2 ranks, got {n}")
    state = [[frozenset({r}) for _ in range(n)] for r in range(n)]
    steps = [{"phase": "start", "step": 0, "sends": [], "state": [row[:] for row in state]}]
    for phase, first_chunk in (("reduce-scatter", 0), ("all-gather", 1)):
        for s in range(n - 1):
            sends = [(r, (r + 1) % n, (r + first_chunk - s) % n) for r in range(n)]
            before = [row[:] for row in state]  # every rank sends at once: what it held before the step
            for src, dst, c in sends:
                state[dst][c] = before[dst][c] | before[src][c] if phase == "reduce-scatter" else before[src][c]
            steps.append({"phase": phase, "step": s + 1, "sends": sends, "state": [row[:] for row in state]})
    return steps


def ring_steps_from_record(records: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """`ring_allreduce_steps`' steps, rebuilt from what the chapter's by-hand ring recorded on each rank: per step,
    the chunk it sent to its right neighbour and the first value of every chunk it held. Rank r added 2^r, so a
    value's bits are the ranks whose values that chunk sums."""
    n = len(records)
    steps = []
    for k in range(len(records[0])):
        phase = "start" if k == 0 else "reduce-scatter" if k < n else "all-gather"
        sends = [(r, (r + 1) % n, records[r][k]["sent"]) for r in range(n)] if k else []
        state = [[frozenset(b for b in range(n) if value >> b & 1) for value in records[r][k]["chunks"]]
                 for r in range(n)]
        steps.append({"phase": phase, "step": k if k < n else k - (n - 1), "sends": sends, "state": state})
    return steps


def chunks_sent_per_rank(steps: Sequence[Mapping[str, Any]], n: int) -> list[int]:
    """How many chunks (of B/n bytes each) every rank sent over the whole all-reduce."""
    sent = [0] * n
    for step in steps:
        for src, _, _ in step["sends"]:
            sent[src] += 1
    return sent


def draw_ring_allreduce(n: int, out_png: str | Path, provenance: Mapping[str, Any],
                        steps: Sequence[Mapping[str, Any]] | None = None) -> Figure:
    """Every step of a ring all-reduce of n ranks: who sends which chunk to whom, and what each chunk sums.

    One panel per step (the start, n - 1 reduce-scatter steps, n - 1 all-gather steps) and a last one that
    counts the bytes: 2(n - 1) chunks of B/n, the 2(n-1)/n of busbw. `steps`: a run's own record
    (`ring_steps_from_record`), else the schedule computed (`ring_allreduce_steps`). Saved with its provenance."""
    steps = list(steps) if steps is not None else ring_allreduce_steps(n)
    panels = len(steps) + 1
    cols = math.ceil(panels / 2)
    fig = Figure(figsize=(3.0 * cols, 6.4))
    axes = fig.subplots(2, cols).ravel()
    for ax, step in zip(axes, steps):
        _draw_ring_step(ax, step, n)
    _draw_byte_count(axes[len(steps)], steps, n)
    for ax in axes[len(steps) + 1:]:
        ax.set_axis_off()
    fig.suptitle(f"ring all-reduce of {n} ranks:{' ' if cols > 2 else chr(10)}"
                 "reduce-scatter (top row), then all-gather (bottom row)", fontsize=11)
    fig.tight_layout()
    prov.save_figure(fig, out_png, dict(provenance))
    return fig


CHUNK = 0.2  # side of one chunk's square, in the panel's data units (the ring has radius 1)


def _rank_xy(r: int, n: int) -> tuple[float, float]:
    angle = math.pi / 2 - 2 * math.pi * r / n  # rank 0 on top, the ring runs clockwise
    return math.cos(angle), math.sin(angle)


def _draw_ring_step(ax, step: Mapping[str, Any], n: int) -> None:
    shades = colormaps["Blues"]
    received = {(dst, c) for _, dst, c in step["sends"]}
    for r in range(n):
        x, y = _rank_xy(r, n)
        left = x - n * CHUNK / 2
        for c, summed in enumerate(step["state"][r]):
            full = len(summed) == n
            colour = "mediumseagreen" if full else shades(0.15 + 0.6 * (len(summed) - 1) / max(n - 1, 1))
            edge, width = ("crimson", 2.0) if (r, c) in received else ("0.3", 0.6)
            ax.add_patch(Rectangle((left + c * CHUNK, y - CHUNK / 2), CHUNK, CHUNK, facecolor=colour,
                                   edgecolor=edge, lw=width))
            ax.text(left + (c + 0.5) * CHUNK, y, str(len(summed)), ha="center", va="center", fontsize=7,
                    color="white" if full else "black")
        ax.text(x, y + CHUNK * 0.85, f"rank {r}", ha="center", va="bottom", fontsize=8)
        if step["phase"] == "start":
            for c in range(n):
                ax.text(left + (c + 0.5) * CHUNK, y - CHUNK * 0.7, f"c{c}", ha="center", va="top", fontsize=6,
                        color="0.35")
    for src, dst, c in step["sends"]:
        ax.add_patch(FancyArrowPatch(_rank_xy(src, n), _rank_xy(dst, n), connectionstyle="arc3,rad=-0.35",
                                     arrowstyle="-|>", mutation_scale=10, color="crimson", lw=1.2,
                                     shrinkA=26, shrinkB=26))
        (xa, ya), (xb, yb) = _rank_xy(src, n), _rank_xy(dst, n)
        mx, my = (xa + xb) / 2, (ya + yb) / 2
        norm = math.hypot(mx, my) or 1.0
        reach = 1.25 if n > 2 else 0.0  # outside the ring, beside its arrow
        lx, ly = (mx / norm * reach, my / norm * reach) if n > 2 else (0.55 * (1 if src == 0 else -1), 0.0)
        ax.text(lx, ly, f"c{c}", ha="center", va="center", fontsize=8, color="crimson")
    if step["phase"] == "start":
        title = f"start: each rank's own\nvalues, cut in {n} chunks"
    else:
        verb = "add" if step["phase"] == "reduce-scatter" else "overwrite"
        title = f"{step['phase']} step {step['step']}/{n - 1}:\nsend one chunk right, {verb}"
    ax.set_title(title, fontsize=9)
    ax.set_xlim(-1.6, 1.6)
    ax.set_ylim(-1.5, 1.6)
    ax.set_aspect("equal")
    ax.set_axis_off()


def _draw_byte_count(ax, steps: Sequence[Mapping[str, Any]], n: int) -> None:
    sent = chunks_sent_per_rank(steps, n)
    assert len(set(sent)) == 1 and sent[0] == 2 * (n - 1), sent  # the ring is balanced: every rank the same
    lines = [
        "bytes each rank sends,",
        "message of B bytes:",
        "",
        f"reduce-scatter: {n - 1} x B/{n}",
        f"all-gather:     {n - 1} x B/{n}",
        f"total: {sent[0]}/{n} B = 2(n-1)/n B = {bus_factor(n):g} B",
        "",
        "busbw = algbw x 2(n-1)/n",
        "n = 2: factor 1 (this chapter)",
        "",
        "number in a chunk: how many",
        "ranks' values it sums",
        "(green: all of them)",
        "red: the chunk just received",
    ]
    ax.text(0.0, 0.98, "\n".join(lines), transform=ax.transAxes, ha="left", va="top", fontsize=8,
            family="monospace")
    ax.set_axis_off()


# ---------------------------------------------------------------- the by-hand timing and the prediction

KEY_VALUE = re.compile(r"(\w+)=(-?[\d.]+(?:e[-+]?\d+)?)")


def read_results(lines: Iterable[str], tag: str) -> pd.DataFrame:
    """The lines `tag: key=value key=value ...` that a by-hand script's rank 0 prints, as a table (one row
    a line; whole numbers stay integers). Everything else in the output (torchrun's warnings) is skipped."""
    rows = [{key: (int(value) if value.lstrip("-").isdigit() else float(value))
             for key, value in KEY_VALUE.findall(line.split(f"{tag}:", 1)[1])}
            for line in lines if f"{tag}:" in line]
    if not rows:
        raise ValueError(f"no '{tag}: key=value ...' line in the script's output")
    return pd.DataFrame(rows)


def parse_by_hand(lines: Iterable[str]) -> pd.DataFrame:
    """The by-hand all-reduce's lines (one per size: size_bytes, time_us, busbw_GBps) as a table."""
    return read_results(lines, "by hand")


def parse_halves(lines: Iterable[str]) -> pd.Series:
    """Exercise 2's one line: the difference from all_reduce and the three collectives' times."""
    return read_results(lines, "halves").iloc[0]


def alpha_beta_prediction(by_hand: pd.DataFrame, sizes_kib: Sequence[float], world_size: int) -> pd.DataFrame:
    """t(B) = alpha + B x 2(n-1)/n / busbw for every size: alpha, the time of the smallest message timed
    by hand (too small to carry data: pure latency); busbw, that of the largest. `bandwidth_bound`: the
    sizes whose bandwidth term is at least alpha (B at or above B1/2 = alpha x busbw / (2(n-1)/n))."""
    alpha_s = by_hand["time_us"].min() * 1e-6
    busbw = by_hand.loc[by_hand["size_bytes"].idxmax(), "busbw_GBps"] * 1e9
    size_bytes = pd.Series([round(k * 1024) for k in sizes_kib])
    predicted_s = alpha_s + size_bytes * bus_factor(world_size) / busbw
    bandwidth_s = size_bytes * bus_factor(world_size) / busbw
    return pd.DataFrame({"size": size_bytes.map(size_text), "size_bytes": size_bytes,
                         "predicted_us": predicted_s * 1e6,
                         "predicted_busbw_GBps": size_bytes * bus_factor(world_size) / predicted_s / 1e9,
                         "bandwidth_bound": bandwidth_s >= alpha_s})


def against_prediction(predicted: pd.DataFrame, sweep: pd.DataFrame) -> pd.DataFrame:
    """Prediction and the sweep's measurement side by side, one row per size."""
    table = predicted.merge(sweep[["size_bytes", "time_us", "busbw_GBps"]], on="size_bytes")
    table = table.rename(columns={"time_us": "measured_us", "busbw_GBps": "measured_busbw_GBps"})
    table["measured / predicted"] = table["measured_us"] / table["predicted_us"]
    return table.drop(columns="size_bytes").set_index("size")


def by_hand_against_library(by_hand: pd.DataFrame, sweep: pd.DataFrame) -> pd.DataFrame:
    """The by-hand timings next to the library's at the same sizes."""
    table = by_hand.merge(sweep[["size_bytes", "time_us"]], on="size_bytes", suffixes=("_by_hand", "_library"))
    table["by hand / library"] = table["time_us_by_hand"] / table["time_us_library"]
    table.insert(0, "size", table.pop("size_bytes").map(size_text))
    return table.drop(columns="busbw_GBps").set_index("size")


def latency_and_plateau(sweep: pd.DataFrame) -> pd.DataFrame:
    """The smallest and the largest message of the sweep: time and busbw."""
    ends = sweep.sort_values("size_bytes").iloc[[0, -1]]
    table = ends[["size_bytes", "time_us", "busbw_GBps"]].copy()
    table.index = ["smallest (latency-bound)", "largest (bandwidth-bound)"]
    table.insert(0, "size", table.pop("size_bytes").map(size_text))
    return table


# ---------------------------------------------------------------- the sweep's figure and phases


def plot_allreduce_busbw(sweep, out_png: str | Path, provenance: Mapping[str, Any],
                         by_hand: pd.DataFrame | None = None):
    """busbw and algbw against message size (log scale), saved with its provenance. With `by_hand`, also the
    by-hand timings and the busbw that the latency-bandwidth model built from them predicts at every size."""
    fig = Figure(figsize=(6.5, 3.8))
    ax = fig.add_subplot()
    backend, n = sweep["backend"].iloc[0], int(sweep["world_size"].iloc[0])
    ax.plot(sweep["size_bytes"], sweep["busbw_GBps"], "o-", label="busbw = algbw x 2(n-1)/n (library)")
    ax.plot(sweep["size_bytes"], sweep["algbw_GBps"], "s--", alpha=0.7, label="algbw = bytes / time (library)")
    if by_hand is not None:
        lo, hi = sweep["size_bytes"].min(), sweep["size_bytes"].max()
        curve = alpha_beta_prediction(by_hand, [lo * (hi / lo) ** (i / 63) / 1024 for i in range(64)], n)
        ax.plot(curve["size_bytes"], curve["predicted_busbw_GBps"], ":", color="0.3", lw=2,
                label="busbw predicted from the by-hand run")
        ax.plot(by_hand["size_bytes"], by_hand["busbw_GBps"], "x", color="crimson", ms=9, mew=2,
                label="busbw by hand")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # small messages are latency-bound: orders of magnitude below the large ones
    ax.minorticks_off()
    ticks = list(sweep["size_bytes"])
    ax.set_xticks(ticks, [size_text(t) for t in ticks], rotation=45, ha="right")
    ax.set_xlabel("message size")
    ax.set_ylabel("GB/s")
    note = " (2(n-1)/n = 1: the lines coincide)" if n == 2 else ""
    ax.set_title(f"all_reduce bandwidth, {n} ranks, {backend}{note}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    prov.save_figure(fig, out_png, dict(provenance))
    return fig


STARTUP_PHASES = ("torchrun starts", "python, import torch", "rendezvous")


def phase_durations(spans: Sequence[tuple[float, float, str]]) -> pd.DataFrame:
    """Seconds per phase, each marked start-up, all-reduce (one per message size) or exit."""
    table = pd.DataFrame(spans, columns=["start_s", "end_s", "phase"])
    table["seconds"] = table["end_s"] - table["start_s"]
    table["kind"] = ["start-up" if p in STARTUP_PHASES else "exit" if p == "exit" else "all-reduce"
                     for p in table["phase"]]
    return table


def sweep_phases(sweep: pd.DataFrame, sampler, launched: float, returned: float) -> list[tuple[float, float, str]]:
    """The sweep's phases as spans (start, end, label) in the sampler's clock, for plot_utilization: torchrun
    starting its ranks (from the launch to rank 0's process start), rank 0's own phases (imports,
    rendezvous, each size) and the exit (from the last size to the launch returning)."""
    ranks = list(sweep.attrs.get("phases", []))
    first = ranks[0][0] if ranks else returned
    last = ranks[-1][1] if ranks else launched
    wall = [(launched, first, "torchrun starts")] + ranks + [(last, returned, "exit")]
    return [(sampler.since_start(t0), sampler.since_start(t1), label) for t0, t1, label in wall]
