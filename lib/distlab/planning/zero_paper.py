"""The ZeRO paper's model-state formulas next to the planner and to measured bytes (chapter 03).

Rajbhandari et al. (2020), "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", sec. 5:
mixed-precision Adam holds per parameter 2 bytes of fp16 weights, 2 of fp16 gradients and K = 12 of
optimizer state (fp32 master weights, momentum, variance). Over N_d data-parallel ranks:

    baseline (DDP)        (2 + 2 + K) Psi
    P_os      (ZeRO-1)    2 Psi + 2 Psi + K Psi / N_d
    P_os+g    (ZeRO-2)    2 Psi + (2 + K) Psi / N_d
    P_os+g+p  (ZeRO-3)    (2 + 2 + K) Psi / N_d

`zero_paper_table` puts these, per component, next to distlab.planning.plan.plan_memory and (when given)
the bytes a run measured (distlab.measure.state); `explain_zero_paper` renders why they differ, with the
table's own numbers, as markdown for the chapter. With LoRA the paper's Psi splits: weights count every
parameter (2 Psi), gradients and optimizer state only the trained ones.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from distlab.config import ZERO3_PERSISTENCE_THRESHOLD
from distlab.planning.plan import plan_memory
from distlab.planning.shapes import LLAMA2_7B, parameter_layout

K = 12  # bytes of optimizer state per parameter in the paper's mixed-precision Adam
# paper stage -> (its name, the distlab strategy that runs it, or None)
STAGES = {0: ("baseline (DDP)", "ddp"), 1: ("P_os (ZeRO-1)", None), 2: ("P_os+g (ZeRO-2)", "zero2"),
          3: ("P_os+g+p (ZeRO-3)", "zero3")}
COMPONENTS = ("params", "gradients", "optimizer_state")


def paper_bytes(n_params: int, n_trained: int, world_size: int, stage: int, k: float = K) -> dict[str, float]:
    """The paper's bytes per rank for `stage` (0: plain data parallelism), by component."""
    n = world_size
    return {"params": 2 * n_params / (n if stage >= 3 else 1),
            "gradients": 2 * n_trained / (n if stage >= 2 else 1),
            "optimizer_state": k * n_trained / (n if stage >= 1 else 1)}


def _planned(b) -> dict[str, float]:
    return {"params": b.weights + b.adapter_weights, "gradients": b.gradients, "optimizer_state": b.optimizer_state}


def zero_paper_table(config, *, world_size: int = 2, dtype: str = "bf16-autocast", lora_r: int | None = None,
                     lora_targets=None, rank: int = 0,
                     measured: Mapping[str, Mapping[str, float]] | None = None):
    """One row per (paper stage, component, and their total): the paper's bytes, the planner's for the
    strategy that runs that stage in `dtype`, and `measured` ({strategy: a state_bytes record of rank
    `rank`}) where given. ZeRO-1 has no distlab strategy: planner and measured are NaN there."""
    import pandas as pd  # deferred: planning stays importable without pandas' start-up in every rank

    layout = parameter_layout(config, lora_r, lora_targets)
    n_params, n_trained = sum(p.numel for p in layout), sum(p.numel for p in layout if p.trainable)
    rows: list[dict[str, Any]] = []
    for stage, (name, strategy) in STAGES.items():
        paper = paper_bytes(n_params, n_trained, world_size, stage)
        planned = _planned(plan_memory(config, strategy=strategy, world_size=world_size, dtype=dtype, lora_r=lora_r,
                                       lora_targets=lora_targets, rank=rank)) if strategy else {}
        got = measured.get(strategy) if (measured and strategy) else None
        seen = ({"params": got["weights"] + got["adapter_weights"], "gradients": got["gradients"],
                 "optimizer_state": got["optimizer_state"]} if got else {})
        for component in (*COMPONENTS, "total"):
            def value(d):
                if not d:
                    return math.nan
                return sum(d.values()) if component == "total" else d[component]

            p, q, m = value(paper), value(planned), value(seen)
            rows.append({"stage": name, "strategy": strategy or "-", "component": component, "paper_bytes": p,
                         "planner_bytes": q, "measured_bytes": m, "planner / paper": q / p if p else math.nan,
                         "measured / planner": m / q if q else math.nan})
    return pd.DataFrame(rows)


def persistent_elements(config, lora_r: int | None = None, lora_targets=None,
                        threshold: int = ZERO3_PERSISTENCE_THRESHOLD) -> tuple[int, int]:
    """(elements, tensors) ZeRO-3 keeps whole on every rank: those at most `threshold` elements."""
    small = [p.numel for p in parameter_layout(config, lora_r, lora_targets) if p.numel <= threshold]
    return sum(small), len(small)


def explain_zero_paper(table, config, *, world_size: int = 2, dtype: str = "bf16-autocast",
                       lora_r: int | None = None, lora_targets=None) -> str:
    """Markdown: why the planner (and DeepSpeed 0.19.8 on this setup) differs from the paper, per stage,
    with the numbers of `table` (zero_paper_table's) rendered in."""
    def ratio(stage: int, component: str) -> float:
        row = table[(table["stage"] == STAGES[stage][0]) & (table["component"] == component)]
        return float(row["planner / paper"].iloc[0])

    persistent, n_small = persistent_elements(config, lora_r, lora_targets)
    layout = parameter_layout(config, lora_r, lora_targets)
    n_params = sum(p.numel for p in layout)
    largest = max(layout, key=lambda p: p.numel)
    big = parameter_layout(LLAMA2_7B, lora_r, lora_targets)
    big_share = persistent_elements(LLAMA2_7B, lora_r, lora_targets)[0] / sum(p.numel for p in big)
    ds_bf16 = dtype == "bf16-autocast"
    lines = [
        f"**The ZeRO paper against the planner** ({dtype}, {'LoRA r=%d' % lora_r if lora_r else 'full fine-tuning'}, "
        f"N_d = {world_size}; planner / paper per component):",
        "",
        f"- *Baseline (DDP)*: total {ratio(0, 'total'):.2f}x the paper's (2+2+K)Psi. "
        + ("The weights stay fp32 (torch autocast only computes in 16 bits) and are their own master copy: weights "
           f"{ratio(0, 'params'):.1f}x and gradients {ratio(0, 'gradients'):.1f}x the paper's fp16 ones, "
           f"optimizer state {ratio(0, 'optimizer_state'):.2f}x (two fp32 moments, 8 of K = 12 bytes). "
           if dtype in ("bf16-autocast", "fp16-autocast", "fp32") else
           "Weights stored in bf16 with torch's AdamW keep bf16 gradients and bf16 moments (4 bytes, no master "
           f"copy): optimizer state {ratio(0, 'optimizer_state'):.2f}x K. ")
        + "DDP also copies every gradient into its all-reduce buckets (buffers, outside the paper's model states).",
        "- *ZeRO-1*: distlab runs no stage-1 strategy (ZeRO-2 costs the same communication and holds less).",
        f"- *ZeRO-2*: optimizer state {ratio(2, 'optimizer_state'):.3f}x K Psi/N_d "
        "(DeepSpeed pads each flat group to a multiple of 2 N_d elements; torch's AdamW on the fp32 partition "
        "keeps the same two fp32 moments as DeepSpeed's fused or CPU Adam would, and its 0-d step counters are "
        f"not counted). Weights {ratio(2, 'params'):.2f}x 2 Psi"
        + (" (DeepSpeed's bf16 mode casts the whole module to bf16)" if ds_bf16 else
           " (no bf16 mode: the model stays in its stored dtype, and DeepSpeed still keeps an fp32 master copy, "
           "so fp32 runs hold 4 + 4 + 12 bytes, not 2 + 2 + 12)")
        + f". Gradients {ratio(2, 'gradients'):.2f}x 2 Psi/N_d: "
        + ("DeepSpeed 0.19.8 accumulates in its model dtype (bf16) and copies each reduced gradient *whole* into "
           "its partition buffer when the tensor touches this rank's partition, so tensors straddling a "
           f"partition boundary are held whole (here the largest, {largest.name}, is "
           f"{largest.numel / n_params:.0%} of the weights); the "
           "reduce bucket (min(5e8, trained) elements) is a buffer on top."
           if ds_bf16 else
           "with fp32 weights the reduced gradients are fp32 and whole tensors touching the partition are kept; "
           "16-bit weights with fp32 accumulation get a compact fp32 partition (4 Psi/N_d)."),
        f"- *ZeRO-3*: optimizer state {ratio(3, 'optimizer_state'):.3f}x and gradients "
        f"{ratio(3, 'gradients'):.3f}x the paper (per-tensor partitions, each padded to a multiple of N_d; "
        + ("bf16 gradient partitions in bf16 mode). " if ds_bf16 else "fp32 gradient partitions). ")
        + f"Weights {ratio(3, 'params'):.2f}x 2 Psi/N_d: the {n_small} tensors of at most "
        f"{ZERO3_PERSISTENCE_THRESHOLD:,} elements ({persistent / n_params:.0%} of this model's weights: "
        "norms, biases, small projections, LoRA adapters) stay whole on every rank "
        f"(stage3_param_persistence_threshold). On Llama-2-7B they are {big_share:.3%} of the weights.",
        "- *What is measured*: the storages of the tensors a rank owns at the state point of a step (after "
        "backward, before the optimizer step, from the second step on so that the moments exist), a view into a "
        "flat buffer counting the whole buffer. Not counted, like the paper: activations, DeepSpeed's reduce "
        "buckets and ZeRO-3's gathered weights (buffers, released at that point), allocator fragmentation.",
    ]
    return "\n".join(lines)
