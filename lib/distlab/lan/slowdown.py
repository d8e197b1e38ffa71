"""The portable slow device: sleep (factor - 1) x the compute time just spent, switched on by environment.

DISTLAB_SLOWDOWN=2.0    this rank takes twice as long per forward+backward (`install` on the model: distlab.train
                        and distlab.lan.calibrate call it)

The time is the rank's own compute, never its waiting: a forward hook times each forward of the
loss-computing model (no collective runs inside it) and sleeps (factor - 1) x 3 x that time, a backward
costing about twice a forward. Unlike a CPU quota (distlab.lan.cgroups), which stops binding when other
jobs already hold the core, the sleep is relative to the rank's own compute, so a 2x slower rank stays 2x
slower on a loaded machine, and it needs no root. What it cannot emulate: a slow device's memory
bandwidth or its lower peak, only its time.
"""

from __future__ import annotations

import os
import time

ENV = "DISTLAB_SLOWDOWN"
BACKWARD_OVER_FORWARD = 2.0


def factor() -> float:
    return float(os.environ.get(ENV, "1") or 1)


def install(model) -> None:
    """Hooks on `model` (the unwrapped loss-computing module) that slow this rank down, if asked to.
    A pipeline rank's model never runs forward itself (its schedule runs the stage module), so the hooks
    go on its `stage` (distlab.strategies.split.PipelinedModel): every micro-batch through the stage."""
    extra = factor() - 1.0
    if extra <= 0:
        return
    stage = getattr(model, "stage", None)
    model = model if stage is None else stage
    started: list[float] = []

    def before(module, args, kwargs=None):
        started.append(time.perf_counter())

    def after(module, args, output):
        forward_s = time.perf_counter() - started.pop()
        time.sleep(extra * (1 + BACKWARD_OVER_FORWARD) * forward_s)

    model.register_forward_pre_hook(before)
    model.register_forward_hook(after)
