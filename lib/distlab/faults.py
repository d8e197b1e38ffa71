"""Deliberate failures and slowdowns for the fault-tolerance and heterogeneous-cluster demos and tests,
switched on by environment only.

DISTLAB_KILL_AT_STEP=N      SIGKILL this process after optimizer step N (before any checkpoint
                            of that step), on the first attempt of the job only.
DISTLAB_KILL_IN_CHECKPOINT=N  SIGKILL in the middle of writing the checkpoint of step N.
DISTLAB_KILL_AFTER_MICRO_BATCHES=N  pipeline inference (distlab.inference): SIGKILL this stage once N
                            micro-batches have finished on it (the last stage has written their
                            completions by then): a stage lost mid-job.
DISTLAB_SIGNAL_AT_STEP=N    send this process SIGTERM (or DISTLAB_SIGNAL=USR1) during optimizer step N: a
                            scheduler's notice reaching one rank only; the run stops after that step
                            with its checkpoint (distlab.preemption).
DISTLAB_FILL_DISK_AT_CHECKPOINT=N  while writing the checkpoint of step N, fill the output folder's file
                            system (a file `fill-disk.ballast` in the output folder) so that the rest of
                            the save meets a real ENOSPC: a disk that filled up mid-save.
DISTLAB_KILL_RANK=R         which rank dies, is signalled, or fills the disk (default 1).

"First attempt" is torchrun's TORCHELASTIC_RESTART_COUNT == 0 and Slurm's SLURM_RESTART_COUNT == 0 (a
requeued job counts up), so a restarted group or a requeued job runs clean.
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
    return first_attempt()


def first_attempt() -> bool:
    """Neither restarted by torchrun nor requeued by Slurm."""
    return all(int(os.environ.get(v) or 0) == 0 for v in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))


def _die(when: str, rank: int) -> None:
    print(f"[distlab.faults] rank {rank}: SIGKILL {when}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def after_step(step: int, rank: int) -> None:
    if _armed("DISTLAB_KILL_AT_STEP", step, rank):
        _die(f"after step {step}", rank)
    if _armed("DISTLAB_SIGNAL_AT_STEP", step, rank):
        sig = getattr(signal, "SIG" + os.environ.get("DISTLAB_SIGNAL", "TERM").upper().removeprefix("SIG"))
        print(f"[distlab.faults] rank {rank}: {sig.name} during step {step}", flush=True)
        os.kill(os.getpid(), sig)


def during_checkpoint(step: int, rank: int, output_dir=None) -> None:
    if _armed("DISTLAB_KILL_IN_CHECKPOINT", step, rank):
        _die(f"while writing the checkpoint of step {step}", rank)
    if output_dir is not None and _armed("DISTLAB_FILL_DISK_AT_CHECKPOINT", step, rank):
        _fill_disk(os.path.join(output_dir, "fill-disk.ballast"))
        print(f"[distlab.faults] rank {rank}: filled the disk while writing the checkpoint of step {step}", flush=True)


def _fill_disk(path: str) -> None:
    """Write zeros until the file system says ENOSPC (a tmpfs in the tests: never the real disk)."""
    with open(path, "wb", buffering=0) as fh:  # unbuffered: nothing left to fail when it closes
        for size in (1 << 16, 512):  # then the last partial block too, so not even a small file fits
            try:
                while fh.write(bytes(size)):
                    pass
            except OSError:
                pass


def after_micro_batches(done: int, rank: int) -> None:
    if _armed("DISTLAB_KILL_AFTER_MICRO_BATCHES", done, rank):
        _die(f"after {done} finished micro-batches", rank)


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
