"""Deliberate failures and slowdowns for the fault-tolerance and heterogeneous-cluster demos and tests,
switched on by environment only.

DISTLAB_KILL_AT_STEP=N      SIGKILL this process after optimizer step N (before any checkpoint
                            of that step), on the first attempt of the job only.
DISTLAB_KILL_IN_CHECKPOINT=N  SIGKILL in the middle of writing the checkpoint of step N.
DISTLAB_KILL_RANK=R         which rank dies (default 1).

"First attempt" is torchrun's TORCHELASTIC_RESTART_COUNT == 0, so a restarted group runs clean.
A real SIGKILL, not an exception: nothing in the process gets to clean up, as with an OOM kill
or a lost node.

DISTLAB_SLOWDOWN=2.0        this rank takes twice as long per forward+backward (`install_slowdown` on
                            the model: distlab.train and distlab.lan.calibrate call it): the portable
                            slow device of chapter 05.

The slowdown sleeps (factor - 1) x the rank's own compute, never its waiting: a forward hook times each
forward of the loss-computing model (no collective runs inside it) and sleeps (factor - 1) x 3 x that
time, a backward costing about twice a forward. Unlike a CPU quota (distlab.lan.cgroups), which stops
binding when other jobs already hold the core, the sleep is relative to the rank's own compute, so a 2x
slower rank stays 2x slower on a loaded machine, and it needs no root. What it cannot emulate: a slow
device's memory bandwidth or its lower peak, only its time."""

from __future__ import annotations

import os
import signal
import time

SLOWDOWN_ENV = "DISTLAB_SLOWDOWN"
BACKWARD_OVER_FORWARD = 2.0


def _armed(var: str, step: int, rank: int) -> bool:
    at = os.environ.get(var)
    if at is None or int(at) != step:
        return False
    if int(os.environ.get("DISTLAB_KILL_RANK", "1")) != rank:
        return False
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0


def _die(what: str, step: int, rank: int) -> None:
    print(f"[distlab.faults] rank {rank}: SIGKILL {what} step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def after_step(step: int, rank: int) -> None:
    if _armed("DISTLAB_KILL_AT_STEP", step, rank):
        _die("after", step, rank)


def during_checkpoint(step: int, rank: int) -> None:
    if _armed("DISTLAB_KILL_IN_CHECKPOINT", step, rank):
        _die("while writing the checkpoint of", step, rank)


def slowdown_factor() -> float:
    return float(os.environ.get(SLOWDOWN_ENV, "1") or 1)


def install_slowdown(model) -> None:
    """Hooks on `model` (the unwrapped loss-computing module) that slow this rank down, if asked to.
    A pipeline rank's model never runs forward itself (its schedule runs the stage module), so the hooks
    go on its `stage` (distlab.strategies.split.PipelinedModel): every micro-batch through the stage."""
    extra = slowdown_factor() - 1.0
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
