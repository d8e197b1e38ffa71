"""Chapter 02 (DDP): where a step's time goes, per world size (compute, transfer, waiting), drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import matplotlib.pyplot as plt

from distlab.provenance import save_figure


def plot_step_split(rows: Mapping[str, Mapping[str, float]], path: str | Path, provenance: dict,
                    title: str = "where a step's time goes (measured)") -> Path:
    """Stacked bars, one per run ({label: {"compute_s", "comm_wait_s", "comm_transfer_s"}}), in ms."""
    fig, ax = plt.subplots(figsize=(6.2, 3.3))
    labels = list(rows)
    bottom = [0.0] * len(labels)
    parts = (("compute_s", "compute", "C0"), ("comm_wait_s", "all-reduce: waiting for the slower rank", "C1"),
             ("comm_transfer_s", "all-reduce: the transfer itself", "C2"))
    for key, name, color in parts:
        values = [rows[label].get(key, 0.0) * 1e3 for label in labels]
        ax.bar(labels, values, bottom=bottom, label=name, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(ylabel="ms per optimizer step (slowest rank)", title=title, ylim=(0, max(bottom) * 1.45))
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    out = save_figure(fig, path, provenance)
    plt.close(fig)
    return out
