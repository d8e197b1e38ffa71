"""Chapter 03 (FSDP and ZeRO): each strategy's planned bytes per rank drawn as stacked bars, against the
capacity of the cards a reader may have."""

from __future__ import annotations

from typing import Mapping

import matplotlib.pyplot as plt

from distlab.planning.memory import GIB, breakdown_table
from distlab.results.schema import MemoryBreakdown


def plot_breakdowns(rows: Mapping[str, MemoryBreakdown], capacities: Mapping[str, float] | None = None,
                    title: str = "", unit: float = GIB, unit_name: str = "GiB", ax=None):
    """Stacked horizontal bars, one per breakdown (e.g. per strategy), with dashed lines at GPU
    capacities (name -> GiB). Returns the figure."""
    table = breakdown_table(dict(rows), unit=unit, unit_name=unit_name).T.drop(columns="total")
    if ax is None:
        fig, ax = plt.subplots(figsize=(7.5, 0.5 + 0.45 * len(table)))
    else:
        fig = ax.figure
    table.plot.barh(stacked=True, ax=ax, width=0.7)
    ax.invert_yaxis()
    for name, gb in (capacities or {}).items():
        ax.axvline(gb * GIB / unit, color="k", ls="--", lw=1)
        ax.text(gb * GIB / unit, 1.01, f"{name} ({gb:g} GiB)", transform=ax.get_xaxis_transform(), fontsize=7,
                ha="center", va="bottom")
    ax.set_xlabel(f"{unit_name} per rank (planned)")
    ax.set_title(title, fontsize=9, pad=14 if capacities else 6)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig
