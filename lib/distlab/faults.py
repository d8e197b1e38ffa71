"""Deliberate failures for the fault-tolerance demos and tests, switched on by environment only.

DISTLAB_KILL_AT_STEP=N      SIGKILL this process after optimizer step N (before any checkpoint
                            of that step), on the first attempt of the job only.
DISTLAB_KILL_IN_CHECKPOINT=N  SIGKILL in the middle of writing the checkpoint of step N.
DISTLAB_KILL_RANK=R         which rank dies (default 1).

"First attempt" is torchrun's TORCHELASTIC_RESTART_COUNT == 0, so a restarted group runs clean.
A real SIGKILL, not an exception: nothing in the process gets to clean up, as with an OOM kill
or a lost node."""

from __future__ import annotations

import os
import signal


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
