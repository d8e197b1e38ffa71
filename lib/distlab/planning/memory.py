"""Where training memory goes, as the chapters use it: `from distlab.planning import memory`.

Chapter 01 estimates one device (`estimate_training_memory`, the seed models' shapes) and puts the
estimate next to a measured step (distlab.measure.state.measure_training_memory) in `breakdown_table`.
Chapter 03 plans every strategy per rank (`plan_memory`, `plan_table`, `plot_breakdowns`), the
traffic per step (`communication_bytes`) and the LAN-cluster guide's choice (`recommend`).

This module gathers those names from the planning modules (shapes, plan, advice) and draws the
tables and figures of breakdowns.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import matplotlib.pyplot as plt
import pandas as pd

from distlab.measure.state import STATE_COMPONENTS, MemoryBreakdown
from distlab.planning.advice import (
    LAN_CLUSTER,
    Decision,
    Option,
    Recommendation,
    communication_bytes,
    decide,
    explain,
    recommend,
)
from distlab.planning.plan import (
    DTYPE_BYTES,
    MOMENT_BYTES,
    PLANNERS,
    ZERO3_PERSISTENCE_THRESHOLD,
    ZERO_ALIGNMENT,
    estimate_training_memory,
    moment_bytes,
    plan_memory,
    zero_bucket_elements,
)
from distlab.planning.shapes import (
    ATTENTION_PROJECTIONS,
    LLAMA2_7B,
    MLP_PROJECTIONS,
    QWEN3_06B,
    QWEN25_3B,
    QWEN25_7B,
    SEED_MODELS,
    ParamSpec,
    activation_bytes_estimate,
    linear_shapes,
    lora_parameter_count,
    optimizer_groups,
    parameter_count,
    parameter_layout,
)
from distlab.strategies import STRATEGY_NAMES

GIB = 1024**3

__all__ = [
    # distlab.planning.shapes
    "ATTENTION_PROJECTIONS", "LLAMA2_7B", "MLP_PROJECTIONS", "QWEN25_3B", "QWEN25_7B", "QWEN3_06B", "SEED_MODELS",
    "ParamSpec", "activation_bytes_estimate", "linear_shapes", "lora_parameter_count", "optimizer_groups",
    "parameter_count", "parameter_layout",
    # distlab.planning.plan
    "DTYPE_BYTES", "MOMENT_BYTES", "PLANNERS", "ZERO3_PERSISTENCE_THRESHOLD", "ZERO_ALIGNMENT",
    "estimate_training_memory", "moment_bytes", "plan_memory", "zero_bucket_elements",
    # distlab.planning.advice
    "LAN_CLUSTER", "Decision", "Option", "Recommendation", "communication_bytes", "decide", "explain", "recommend",
    # distlab.measure.state, distlab.strategies
    "MemoryBreakdown", "STATE_COMPONENTS", "STRATEGY_NAMES",
    # here
    "GIB", "breakdown_table", "plan_table", "plot_breakdowns",
]


def breakdown_table(rows: dict[str, MemoryBreakdown], unit: float = 2**20, unit_name: str = "MiB"):
    """One column per breakdown, one row per component (and the total), in `unit`."""
    df = pd.DataFrame({name: {k: v / unit for k, v in b.as_dict().items()} for name, b in rows.items()}).fillna(0.0)
    order = [k for k in (*STATE_COMPONENTS, "total") if k in df.index]
    return df.loc[order].rename_axis(f"component ({unit_name})")


def plan_table(config, strategies: Iterable[str] = ("single", "ddp", "zero2", "fsdp", "zero3"), *,
               world_size: int = 2, unit: float = 2**20, unit_name: str = "MiB", **kwargs):
    """One column per strategy, one row per component, in `unit` per rank."""
    rows = {s: plan_memory(config, strategy=s, world_size=1 if s == "single" else world_size, **kwargs)
            for s in strategies}
    return breakdown_table(rows, unit=unit, unit_name=unit_name)


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
