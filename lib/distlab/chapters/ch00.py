"""Chapter 00 (the environment): the all-reduce sweep's figure, bus and algorithm bandwidth against the
message size (the measurement itself is distlab.workers.launcher.run_allreduce_bench)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from matplotlib.figure import Figure

from distlab import provenance as prov
from distlab.measure.limits import size_text


def plot_allreduce_busbw(sweep, out_png: str | Path, provenance: Mapping[str, Any]):
    """busbw and algbw against message size (log scale), saved with its provenance."""
    fig = Figure(figsize=(6.5, 3.8))
    ax = fig.add_subplot()
    backend, n = sweep["backend"].iloc[0], int(sweep["world_size"].iloc[0])
    ax.plot(sweep["size_bytes"], sweep["busbw_GBps"], "o-", label="busbw = algbw x 2(n-1)/n")
    ax.plot(sweep["size_bytes"], sweep["algbw_GBps"], "s--", alpha=0.7, label="algbw = bytes / time")
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
    ax.legend()
    fig.tight_layout()
    prov.save_figure(fig, out_png, dict(provenance))
    return fig
