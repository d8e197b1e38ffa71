"""The planner's breakdowns as tables, and measured state beside the plan: `from distlab.planning import memory`.

`breakdown_table` sets breakdowns (distlab.results.schema.MemoryBreakdown: a measured step, an estimate, a plan
per strategy from distlab.planning.plan.plan_memory) side by side, one row per component; `state_vs_plan` sets
the state bytes each rank measured it owns beside the planner's for that rank. The planner itself is
distlab.planning.plan, the models' shapes distlab.planning.shapes, what a rank holds while loading
distlab.planning.load, the LAN-cluster guide's advice distlab.planning.advice: import each from there.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import pandas as pd

from distlab.config import LORA_TARGETS
from distlab.planning.plan import plan_memory
from distlab.results.schema import STATE_COMPONENTS, MemoryBreakdown

GIB = 1024**3


def breakdown_table(rows: dict[str, MemoryBreakdown], unit: float = 2**20, unit_name: str = "MiB"):
    """One column per breakdown, one row per component (and the total), in `unit`."""
    df = pd.DataFrame({name: {k: v / unit for k, v in b.as_dict().items()} for name, b in rows.items()}).fillna(0.0)
    order = [k for k in (*STATE_COMPONENTS, "total") if k in df.index]
    return df.loc[order].rename_axis(f"component ({unit_name})")


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
