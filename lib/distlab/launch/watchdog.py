"""A hard time limit around one command, portable where coreutils' `timeout` is missing (macOS): what every
generated torchrun script runs its job under (distlab.launch.torchrun).

    python -m distlab.launch.watchdog --timeout-s 3600 --kill-after-s 60 -- python -m torch.distributed.run ...

The contract is GNU `timeout --kill-after`'s. The command runs in a session of its own, so that its whole
process group can be signalled at once. After `--timeout-s` seconds the group gets SIGTERM (torchrun forwards
it to its ranks), and whatever is still running `--kill-after-s` seconds later gets SIGKILL; the exit status is
then 124, however the command ended. SIGINT, SIGTERM, SIGHUP and SIGUSR1 sent to the watchdog (Ctrl-C in the
terminal, a scheduler, a closed terminal, Slurm's `--signal` ahead of a time limit) are passed on to the
command's group, with the same SIGKILL `--kill-after-s` later: the command is in another session, so the
terminal's Ctrl-C reaches it only this way. Otherwise the exit
status is the command's own; a command killed by a signal kills the watchdog with the same signal (as
`timeout` does), so the shell that started the script sees what really happened.

The killing is distlab.launch.process.kill_group's, not a second copy of it. Unlike `timeout`, it also finds
the descendants that left the group (torchrun starts each rank in a session of its own; the process tree is
sampled while the command runs), so a torchrun SIGKILLed at the limit, or killed by the OOM killer before,
leaves no rank behind holding a GPU. For the same reason whatever the command left running when it exited is
stopped too (SIGTERM, then SIGKILL after KILL_GRACE_S).

The watchdog's own exit statuses are `timeout`'s: 125 for bad arguments (one line naming what is wrong),
126 for a command that cannot be run, 127 for one that does not exist, so that none of them can be mistaken
for a status of the command.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import signal
import subprocess
import sys
import time
from typing import NoReturn, Sequence

from distlab.cli import finite_float
from distlab.launch.process import KILL_GRACE_S, TRACK_INTERVAL_S, kill_group, track_tree

TIMED_OUT_EXIT = 124  # the limit was hit (GNU timeout's status)
USAGE_EXIT, CANNOT_RUN_EXIT, NOT_FOUND_EXIT = 125, 126, 127
# What the watchdog forwards to the command's group. SIGUSR1 too: distlab.train saves a checkpoint on it
# (distlab.preemption), and its default action would kill the watchdog and orphan the job.
PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


class WatchdogUsageError(ValueError):
    """Bad arguments to the watchdog itself."""


class CannotRun(OSError):
    """The command could not be started; `.status` is the watchdog's exit status for it (126 or 127)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def watch(cmd: Sequence[str], timeout_s: float, kill_after_s: float) -> int:
    """Run `cmd` under the limit; return its exit status (negative: killed by that signal), or 124 when the
    limit was hit. Installs handlers for PASSED_ON in this process (the main thread must call it)."""
    received: list[int] = []  # signals to pass on, in order; the first starts the SIGKILL countdown
    child: list[subprocess.Popen] = []

    def pass_on(signum, frame) -> None:
        received.append(signum)
        if child:
            _signal_group(child[0].pid, signum)

    for sig in PASSED_ON:
        signal.signal(sig, pass_on)
    start = time.monotonic()
    try:
        child.append(subprocess.Popen(list(cmd), start_new_session=True))
    except FileNotFoundError:
        raise CannotRun(NOT_FOUND_EXIT, f"{cmd[0]}: command not found") from None
    except OSError as e:  # found, but not runnable: no permission, not an executable
        raise CannotRun(CANNOT_RUN_EXIT, f"{cmd[0]}: cannot run it: {e.strerror or e}") from None
    proc, pgid = child[0], child[0].pid
    if received:  # a signal that came before the command existed
        _signal_group(pgid, received[-1])
    seen: dict = {}  # pid -> psutil.Process of every descendant observed, for kill_group
    limit_at = start + timeout_s
    kill_at = None  # once a signal was passed on: when whatever is left gets SIGKILL
    while True:
        now = time.monotonic()
        if received and kill_at is None:
            kill_at = now + kill_after_s
        if now >= limit_at:
            kill_group(pgid, grace_s=kill_after_s, also=list(seen.values()))
            proc.wait()
            return TIMED_OUT_EXIT
        if kill_at is not None and now >= kill_at:
            kill_group(pgid, grace_s=0, also=list(seen.values()))  # its grace already ran out
            break
        try:
            proc.wait(timeout=min(TRACK_INTERVAL_S, limit_at - now, math.inf if kill_at is None else kill_at - now))
            break
        except subprocess.TimeoutExpired:
            track_tree(pgid, seen)
    # The command has ended: nothing it started may outlive it (a rank whose torchrun was OOM-killed).
    kill_group(pgid, grace_s=KILL_GRACE_S, also=list(seen.values()))
    return proc.wait()


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):  # already gone (only its zombie leader is left)
        pass


def exit_like(status: int) -> NoReturn:
    """Exit with the command's status; for a command killed by a signal, die of the same signal."""
    if status >= 0:
        sys.exit(status)
    signum = -status
    try:  # no core file of the watchdog itself when the command died of SIGQUIT, SIGABRT, SIGSEGV, ...
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ValueError, OSError):
        pass
    try:
        signal.signal(signum, signal.SIG_DFL)
    except OSError:  # SIGKILL and SIGSTOP take no handler: theirs is already the default
        pass
    os.kill(os.getpid(), signum)
    sys.exit(128 + signum)  # only reached for a signal whose default action does not end a process


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise WatchdogUsageError(message)


def _seconds(text: str) -> float:
    value = finite_float(text)  # NaN and infinities refused, as for every float option of distlab
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: needs a number of seconds above 0")
    return value


def parse(argv: Sequence[str]) -> tuple[float, float, list[str]]:
    """(timeout_s, kill_after_s, command) from `--timeout-s N --kill-after-s M -- command...`."""
    argv = list(argv)
    if "--" not in argv:
        raise WatchdogUsageError("no command: put it after `--` (--timeout-s N --kill-after-s M -- command ...)")
    split = argv.index("--")
    options, cmd = argv[:split], argv[split + 1:]
    ap = _Parser(prog="python -m distlab.launch.watchdog", description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout-s", type=_seconds, required=True, help="the hard limit on the command")
    ap.add_argument("--kill-after-s", type=_seconds, required=True,
                    help="SIGKILL this long after the SIGTERM (or a passed-on signal)")
    args = ap.parse_args(options)
    if not cmd:
        raise WatchdogUsageError("no command after `--`")
    return args.timeout_s, args.kill_after_s, cmd


def main(argv: Sequence[str] | None = None) -> NoReturn:
    prog = "python -m distlab.launch.watchdog"
    try:
        timeout_s, kill_after_s, cmd = parse(sys.argv[1:] if argv is None else argv)
    except WatchdogUsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        sys.exit(USAGE_EXIT)
    try:
        status = watch(cmd, timeout_s, kill_after_s)
    except CannotRun as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        sys.exit(e.status)
    exit_like(status)


if __name__ == "__main__":
    main()
