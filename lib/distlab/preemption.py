"""Stopping on a scheduler's notice without losing the steps since the last checkpoint.

A shared cluster takes a run's resources back with a warning first: Kubernetes eviction and Slurm
preemption send SIGTERM and wait a grace period (30 s by default in Kubernetes, Slurm's GraceTime)
before SIGKILL; Slurm's `--signal=USR1@<s>` sends SIGUSR1 that many seconds before the time limit.
Exiting at once would lose every step since the last periodic checkpoint; waiting for the next one may
outlast the grace period. So the training loop:

1. notes the signal (`StopRequest`: the handler only sets a flag, the step in progress runs on: a
   handler that raised mid-step could leave a collective half-done on one rank only);
2. after each step asks every rank whether any was signalled (`Strategy.world_max`: one small all-reduce,
   since the scheduler signals the ranks at different moments, or only one of them);
3. if one was, every rank saves the checkpoint of that step together and the run ends with `Preempted`:
   exit status 143, and under Slurm, for SIGUSR1 (the time limit is near), `scontrol requeue` first so
   the job starts again and resumes from that checkpoint.

What a resumed run computes is bitwise what an uninterrupted run computes (tests/launches/test_preemption_runs.py):
the checkpoint holds the same state a periodic one at that step would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED_EXIT = 128 + signal.SIGTERM  # 143: what a shell reports for SIGTERM, and what Kubernetes expects


class Preempted(Exception):
    """The run stopped on a scheduler's signal after saving the checkpoint of `step` (None: stopped before its
    first step, with nothing new to save)."""

    def __init__(self, signum: int, step: int | None, saved: Path | None):
        self.signum, self.step, self.saved = signum, step, saved
        name = signal.Signals(signum).name
        where = (f"saved the checkpoint of step {step} in {saved}" if saved is not None
                 else "before its first step: nothing new to save")
        super().__init__(f"stopped on {name}: {where}; run the same command again to resume")


class StopRequest:
    """Records SIGTERM / SIGUSR1 for the loop to act on at the end of the step (used as a context manager:
    the previous handlers come back afterwards, so a notebook's kernel is left as it was)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # signals can only be caught there
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _note(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            print(f"[distlab] got {signal.Signals(signum).name}: finishing this step, then saving a checkpoint",
                  flush=True)


def requeue_under_slurm(signum: int) -> str | None:
    """For SIGUSR1 in a Slurm job (sent ahead of the time limit): ask Slurm to run the job again; the new run
    resumes from the checkpoint just saved. Returns what to print, or None outside Slurm / for SIGTERM
    (Slurm's preemption requeues by itself when its PreemptMode says so). A job submitted without
    `--requeue` is refused by scontrol: its one line is passed on, and the checkpoint is there either way."""
    job = os.environ.get("SLURM_JOB_ID")
    if job is None or signum != signal.SIGUSR1:
        return None
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"[distlab] could not ask Slurm to requeue job {job}: {e}"
    if done.returncode != 0:
        said = " ".join((done.stderr or done.stdout).split())
        return f"[distlab] scontrol requeue {job} failed: {said}"
    return f"[distlab] asked Slurm to requeue job {job}: it will resume from this checkpoint"


# ---------------------------------------------------------------------- how long a scheduler must wait

# The stop budget a generated script assumes when no run of the job was measured: a 0.5B-7B LoRA step plus its
# checkpoint on a GPU node takes seconds, a full fine-tune's optimizer state tens of seconds. Not a
# measurement: measure a run of the job (`measured_stop_s`) and give its value as the spec's stop_s.
UNMEASURED_STOP_S = 60.0
STOP_MARGIN = 2.0      # the measured stop may run slower on a busy node or file system
EXIT_S = 15            # process-group teardown and interpreter exit after the save


def grace_seconds(stop_s: float | None) -> int:
    """Seconds between the scheduler's signal and its SIGKILL that let the step in progress finish and its
    checkpoint be written: twice the measured stop (the longest step plus the longest save), plus the exit,
    and never below Kubernetes' default 30 s. `stop_s` None: the UNMEASURED_STOP_S budget."""
    stop = UNMEASURED_STOP_S if stop_s is None else stop_s
    return max(30, int(STOP_MARGIN * stop + 0.999) + EXIT_S)


def measured_stop_s(output_dir: str | Path) -> float:
    """The longest step plus the longest checkpoint save in a run's step log (`train_log.jsonl`): what a stop
    costs this job. ValueError (one line) when the run logged no step or no checkpoint save."""
    from distlab.metrics import read_log  # deferred: the signal handling above needs none of it

    log = Path(output_dir) / "train_log.jsonl"
    steps = [r["step_time_s"] for r in read_log(log) if r.get("step_time_s") is not None]
    saves = [r["save_s"] for r in read_log(log, event="checkpoint") if r.get("save_s") is not None]
    if not steps or not saves:
        raise ValueError(f"{log}: no {'step' if not steps else 'checkpoint save'} measured: run the job with "
                         f"checkpoint_steps set (and logging_steps) to measure what a stop costs")
    return max(steps) + max(saves)


def main(argv: list[str] | None = None) -> int:
    """python -m distlab.preemption RUN_FOLDER: what a stop costs that run, and the scheduler settings that fit."""
    import argparse  # deferred: only the command line needs it

    ap = argparse.ArgumentParser(prog="python -m distlab.preemption", description=main.__doc__)
    ap.add_argument("run_folder", help="a distlab.train output_dir whose run saved at least one checkpoint")
    args = ap.parse_args(argv)
    stop = measured_stop_s(args.run_folder)
    grace = grace_seconds(stop)
    print(f"measured stop: {stop:.2f} s (the longest step + the longest checkpoint save in {args.run_folder})")
    print(f"grace period:  {grace} s (x{STOP_MARGIN:g} + {EXIT_S} s to exit, at least 30 s)")
    print(f"Slurm:         #SBATCH --signal=USR1@{grace}  (SlurmSpec(stop_s={stop:.2f}) writes it)")
    print(f"Kubernetes:    TORCH_ELASTIC_SHUTDOWN_TIMEOUT={grace}, terminationGracePeriodSeconds={grace + EXIT_S} "
          f"(KubeRun(stop_s={stop:.2f}) writes them)")
    return 0


if __name__ == "__main__":
    from distlab.cli import run_main  # deferred: only the command line needs it

    run_main(main)
