"""How the one training loop is distributed. Each strategy is a small module around distlab.train.

`single` runs on one device. Later chapters add ddp, fsdp, zero and pipeline beside it; they
override only the hooks that differ (wrapping, gradient sync, optimizer step, saving)."""

from __future__ import annotations

from .ddp import DDPStrategy
from .single import SingleDevice, Strategy

STRATEGIES: dict[str, type[Strategy]] = {"single": SingleDevice, "ddp": DDPStrategy}


def make_strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]()
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; available: {', '.join(sorted(STRATEGIES))}") from None
