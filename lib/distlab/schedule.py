"""The learning-rate schedule every training loop here uses: a linear warm-up, then half a cosine down to a floor.

`warmup_cosine` is the value at a step, `cosine_with_warmup` the same as a torch LambdaLR on an optimizer (the
strategies' schedule, floor 0); the default model's pretraining (distlab.tiny_base, floor 0.1) sets its
learning rate from `warmup_cosine` directly. One formula, so the two never drift apart.
"""

from __future__ import annotations

import math

import torch


def warmup_cosine(step: int, peak: float, warmup_steps: int, total_steps: int, floor: float = 0.0) -> float:
    """The schedule at `step` (0-based): up in equal steps to `peak` over `warmup_steps`, then half a cosine
    down to `floor` x peak at `total_steps`, and flat there after.

    `peak` multiplies first (peak * (step + 1) / warmup): the default model's recipe has always computed its
    learning rate in this order, and another order rounds some steps differently, which would change the
    weights a cached build was made with."""
    if step < warmup_steps:
        return peak * (step + 1) / max(1, warmup_steps)
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak * (floor + (1 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def cosine_with_warmup(optimizer, warmup_steps: int, total_steps: int, floor: float = 0.0):
    """A LambdaLR that scales each parameter group's learning rate (its peak) by warmup_cosine."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, 1.0, warmup_steps, total_steps, floor))
