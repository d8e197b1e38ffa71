"""One real optimizer step's memory, measured in the planner's terms, and the QLoRA ladder of such steps
(chapter 01 and `python -m distlab.bench.memory_recipes`).

measure_training_memory builds a run's model exactly as distlab.train does, takes one real step and sums the
weights, gradients, optimizer state and the activations autograd saved (TrainingMemory), with the run's
settings in the terms of distlab.planning.plan.estimate_training_memory, so measured and planned stand side
by side. memory_ladder does that for each rung of the LAN cluster guide's QLoRA recipe (LADDER: a 4-bit NF4
base, 8-bit AdamW, activation checkpointing, one change per rung) against the planner's breakdown
(ladder_plan). Measuring a run means building it, which is why this is not in distlab.measure (which watches
runs others build) or distlab.planning (torch-free arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from distlab.config import TrainConfig
from distlab.data import model_inputs
from distlab.device import autocast
from distlab.measure.state import measure_activation_memory, measure_state
from distlab.planning.plan import estimate_training_memory, plan_memory
from distlab.prepare import prepare_run
from distlab.results.schema import STATE_COMPONENTS, MemoryBreakdown
from distlab.strategies import make_strategy


@dataclass
class TrainingMemory:
    """One real optimizer step of a run on one device: what it held, and what the run was, in the
    terms of distlab.planning.plan.estimate_training_memory, so the two can be put side by side:
    `estimate_training_memory(m.model_config, **m.estimate_args)`."""
    measured: MemoryBreakdown
    model_config: Any  # the HF config of the model the run built
    estimate_args: dict[str, Any]  # the trainer's dtype, LoRA, batch shape, loss-token fraction


def trainer_dtype(choice) -> str:
    """The trainer's dtype name for a device choice ("auto" resolved): what the planner plans with."""
    names = {(torch.float32, None): "fp32", (torch.float32, torch.bfloat16): "bf16-autocast",
             (torch.bfloat16, None): "bf16", (torch.float32, torch.float16): "fp16-autocast"}
    return names[(choice.dtype, choice.autocast_dtype)]


def measure_training_memory(cfg: TrainConfig) -> TrainingMemory:
    """Build the run's model exactly as distlab.train does (distlab.prepare.prepare_run), take one real
    step on a first micro-batch, then sum weights, gradients and optimizer state and the activations
    autograd saved."""
    strategy = make_strategy("single")
    choice, _, train_data, _, model = prepare_run(cfg.replace(eval_file=None), strategy)
    model, optimizer, _ = strategy.prepare(model, choice, cfg)
    model.train()
    first = train_data.batch(list(range(cfg.micro_batch_size)))
    batch = model_inputs(first, choice.device)

    def loss_fn(m):
        with autocast(choice):
            return m(**batch)

    activations = measure_activation_memory(model, loss_fn)
    loss_fn(model).backward()
    optimizer.step()  # creates AdamW's moments
    measured = measure_state(model, optimizer)
    measured.activations = activations
    estimate_args = dict(
        dtype=trainer_dtype(choice), lora_r=cfg.lora_r if cfg.lora else None, lora_targets=cfg.lora_targets,
        micro_batch=cfg.micro_batch_size, seq_len=cfg.seq_len,
        activation_checkpointing=cfg.activation_checkpointing, lora_dropout=cfg.lora_dropout,
        loss_token_fraction=first["n_label_tokens"] / first["input_ids"].numel(), cross_entropy=cfg.cross_entropy)
    return TrainingMemory(measured, model.causal_lm.config, estimate_args)


# The QLoRA ladder (the LAN cluster guide's recipe, one change per rung), as chapter 01 and
# `python -m distlab.bench.memory_recipes` run it: each rung adds its change to the previous one.
LADDER = {
    "nf4 base": {"quantization": "nf4"},
    "+ 8-bit AdamW": {"quantization": "nf4", "optimizer": "adamw_8bit"},
    "+ checkpointing": {"quantization": "nf4", "optimizer": "adamw_8bit", "activation_checkpointing": True},
}
# The guide's two changes that can alter what is learnt; checkpointing recomputes the same numbers
QLORA = LADDER["+ 8-bit AdamW"]
PLANNER_OPTIMIZER = {"adamw": "adamw", "adamw_8bit": "adamw8bit", "paged_adamw_8bit": "adamw8bit"}


def ladder_plan(cfg: TrainConfig, run: TrainingMemory) -> MemoryBreakdown:
    """The planner's single-device breakdown for a measured run of `cfg` (a rung of the ladder)."""
    if cfg.quantization == "none":
        return estimate_training_memory(run.model_config, **run.estimate_args,
                                        optimizer=PLANNER_OPTIMIZER[cfg.optimizer])
    # After prepare_model_for_kbit_training the embedding is fp32, so the residual stream and all computed from it
    # is fp32 (each 4-bit layer casts its output back to its input's dtype): 4 bytes per activation value
    args = {**run.estimate_args, "dtype": cfg.quantization, "activation_bytes": 4, "double_quant": cfg.double_quant,
            "optimizer": PLANNER_OPTIMIZER[cfg.optimizer]}
    return plan_memory(run.model_config, **args)


def memory_ladder(cfg: TrainConfig, rungs=LADDER, first: TrainingMemory | None = None,
                  first_name: str = "LoRA") -> pd.DataFrame:
    """One row per rung (`cfg` itself first, then each of `rungs` applied to it) and component: the bytes one
    real optimizer step held (measure_training_memory) and the planner's, in MiB, and measured / planned.
    `first`: an already measured step of `cfg`, reused."""
    rows = []
    for rung, changes in {first_name: {}, **rungs}.items():
        run_cfg = cfg.replace(**changes)
        run = first if (first is not None and not changes) else measure_training_memory(run_cfg)
        plan = ladder_plan(run_cfg, run)
        for part in (*STATE_COMPONENTS, "total"):
            got, want = run.measured.as_dict().get(part, 0.0), plan.as_dict().get(part, 0.0)
            if got or want:
                rows.append({"rung": rung, "component": part, "measured_mib": got / 2**20,
                             "planned_mib": want / 2**20, "measured / planned": got / want if want else float("nan")})
    return pd.DataFrame(rows)
