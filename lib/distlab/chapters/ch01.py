"""Chapter 01 (one device): a real optimizer step's memory, measured in the planner's terms so the two
stand side by side. Measuring a run means building it, which is why this lives with the chapter and
not in distlab.measure (which watches runs others build) or distlab.planning (torch-free arithmetic)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distlab.config import TrainConfig
from distlab.data import model_inputs
from distlab.device import autocast
from distlab.measure.state import measure_activation_memory, measure_state
from distlab.prepare import prepare_run
from distlab.results.schema import MemoryBreakdown
from distlab.strategies import make_strategy


@dataclass
class TrainingMemory:
    """One real optimizer step of a run on one device: what it held, and what the run was, in the
    terms of distlab.planning.memory.estimate_training_memory, so the two can be put side by side:
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
        loss_token_fraction=first["n_label_tokens"] / first["input_ids"].numel())
    return TrainingMemory(measured, model.causal_lm.config, estimate_args)
