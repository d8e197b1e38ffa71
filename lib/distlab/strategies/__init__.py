"""How the one training loop is distributed. Each strategy is a small module around distlab.train.

`single` runs on one device. Later chapters add ddp, fsdp, zero and pipeline beside it; they
override only the hooks that differ (wrapping, gradient sync, optimizer step, saving)."""

from __future__ import annotations

from .ddp import DDPStrategy
from .fsdp import FSDPStrategy
from .single import SingleDevice, Strategy
from .zero import Zero2Strategy, Zero3Strategy
from .pipeline import PipelineStrategy
from .ds_pipeline import DeepSpeedPipelineStrategy

STRATEGIES: dict[str, type[Strategy]] = {"single": SingleDevice, "ddp": DDPStrategy}
STRATEGIES.update({"fsdp": FSDPStrategy, "zero2": Zero2Strategy, "zero3": Zero3Strategy})
STRATEGIES.update({"pipeline": PipelineStrategy, "ds_pipeline": DeepSpeedPipelineStrategy})


def make_strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]()
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; available: {', '.join(sorted(STRATEGIES))}") from None
