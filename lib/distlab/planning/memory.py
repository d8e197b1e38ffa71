"""Where training memory goes, as the chapters use it: `from distlab.planning import memory`.

Chapter 01 estimates one device (`estimate_training_memory`, the studied models' shapes) and puts the
estimate next to a measured step (distlab.chapters.ch01.measure_training_memory) in `breakdown_table`.
Chapter 03 plans every strategy per rank (`plan_memory`, `plan_table`; drawn by distlab.chapters.ch03), what a
rank holds while the model loads (`plan_load`; a run fits where `peak_bytes`, the larger, does), the
traffic per step (`communication_bytes`) and the LAN-cluster guide's choice (`recommend`).

This module gathers those names from the planning modules (shapes, plan, advice), builds the
breakdown tables, and sets measured state bytes beside the planner's (`state_vs_plan`).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import pandas as pd

from distlab.config import LORA_TARGETS, STRATEGY_NAMES, ZERO3_PERSISTENCE_THRESHOLD, zero_bucket_elements
from distlab.planning.advice import (
    Decision,
    Option,
    Recommendation,
    communication_bytes,
    decide,
    explain,
    recommend,
)
from distlab.planning.cards import LAN_CLUSTER
from distlab.planning.load import LoadPeak, load_path, peak_bytes, plan_load
from distlab.planning.plan import (
    DTYPE_BYTES,
    MOMENT_BYTES,
    PLANNERS,
    ZERO_ALIGNMENT,
    estimate_training_memory,
    moment_bytes,
    plan_memory,
)
from distlab.planning.shapes import (
    ATTENTION_PROJECTIONS,
    CASE_STUDY_MODELS,
    LLAMA2_7B,
    LLAMA2_13B,
    MLP_PROJECTIONS,
    QWEN3_06B,
    QWEN25_3B,
    QWEN25_7B,
    ParamSpec,
    activation_bytes_estimate,
    linear_shapes,
    lora_parameter_count,
    optimizer_groups,
    parameter_count,
    parameter_layout,
)
from distlab.results.schema import STATE_COMPONENTS, MemoryBreakdown

GIB = 1024**3

__all__ = [
    # distlab.planning.shapes
    "ATTENTION_PROJECTIONS", "LLAMA2_7B", "LLAMA2_13B", "MLP_PROJECTIONS", "QWEN25_3B", "QWEN25_7B", "QWEN3_06B",
    "CASE_STUDY_MODELS",
    "ParamSpec", "activation_bytes_estimate", "linear_shapes", "lora_parameter_count", "optimizer_groups",
    "parameter_count", "parameter_layout",
    # distlab.planning.plan
    "DTYPE_BYTES", "MOMENT_BYTES", "PLANNERS", "ZERO3_PERSISTENCE_THRESHOLD", "ZERO_ALIGNMENT",
    "estimate_training_memory", "moment_bytes", "plan_memory", "zero_bucket_elements",
    # distlab.planning.load
    "LoadPeak", "load_path", "peak_bytes", "plan_load",
    # distlab.planning.advice
    "LAN_CLUSTER", "Decision", "Option", "Recommendation", "communication_bytes", "decide", "explain", "recommend",
    # distlab.measure.state, distlab.strategies
    "MemoryBreakdown", "STATE_COMPONENTS", "STRATEGY_NAMES",
    # here
    "GIB", "breakdown_table", "plan_table", "state_vs_plan",
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


# ----------------------------------------------------------------------------- measured against planned

STATE_PARTS = ("weights", "adapter_weights", "gradients", "optimizer_state")


def state_vs_plan(runs: Iterable[Mapping[int, Mapping[str, Any]]], config, *, dtype: str | None = None,
                  lora_targets=None):
    """One row per run, rank and component: the bytes the rank measured it owns (record
    "state_bytes", from runs with measure_state) next to distlab.planning.plan.plan_memory's prediction
    for that strategy, world size and rank, in MiB, with their ratio."""
    rows = []
    for results in runs:
        for rank, rec in sorted(results.items()):
            measured = rec.get("state_bytes")
            if not measured:
                raise ValueError(f"run {rec.get('run')} rank {rank}: no state_bytes (run it with measure_state=True)")
            plan = plan_memory(config, strategy=rec["strategy"], world_size=rec["world_size"], rank=rank,
                               dtype=dtype, lora_r=rec.get("lora_r") if rec["mode"] == "lora" else None,
                               lora_targets=lora_targets or LORA_TARGETS,
                               tp_size=rec["world_size"] // rec["data_parallel_size"] if rec["strategy"] == "fsdp_tp"
                               else None, vocab_parallel=bool(rec.get("vocab_parallel")))
            for part in STATE_PARTS:
                m, p = measured[part], getattr(plan, part)
                rows.append({"run": rec.get("run"), "strategy": rec["strategy"], "mode": rec["mode"],
                             "world_size": rec["world_size"],
                             "rank": rank, "component": part, "measured_mib": m / 2**20, "planned_mib": p / 2**20,
                             "planned / measured": (p / m) if m else (1.0 if p == 0 else float("inf"))})
    return pd.DataFrame(rows)
