"""Chapter 06 (Slurm pipeline inference): a finished run's stage timeline, one row per stage, one bar per
forward (prefill darker), micro-batches told apart by colour (the run is read by
distlab.inference.outputs.load_run)."""

from __future__ import annotations

import matplotlib.pyplot as plt


def plot_timeline(ax, stages: list[dict], until_s: float | None = None) -> None:
    """Each stage's forwards as bars over time (ms): who works while whom waits."""
    # deferred: matplotlib only when drawing

    cmap = plt.get_cmap("tab10")
    t0 = min(e["start"] for s in stages for e in s["events"])
    for s in stages:
        for e in s["events"]:
            if until_s is not None and e["start"] - t0 > until_s:
                continue
            ax.broken_barh([((e["start"] - t0) * 1e3, (e["end"] - e["start"]) * 1e3)], (s["rank"] - 0.4, 0.8),
                           facecolors=cmap(e["mb"] % 10), alpha=1.0 if e["kind"] == "prefill" else 0.6,
                           edgecolor="black" if e["kind"] == "prefill" else "none", linewidth=0.5)
    ax.set_yticks([s["rank"] for s in stages], [f"stage {s['rank']}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel("time since generation started (ms)")
