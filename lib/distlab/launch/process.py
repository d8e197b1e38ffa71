"""Run a launched job (torchrun, a shell script, papermill) so that it can never leave orphans.

The child gets its own process session, so the whole tree it starts (torchrun agent, its ranks,
their helpers) is one process group that we can kill at once. Output is streamed line by line to
the caller (a notebook cell shows it live) and to a log file. On failure, interrupt or timeout the
group is killed and the error says which rank failed and what it printed last.

Not every descendant stays in the group: torchrun starts each rank in a session of its own, and a
daemon may do the same. While the job runs, its process tree is sampled every TRACK_INTERVAL_S, so
such descendants are killed at the end too, even when the process that started them has died
first (torchrun killed by the OOM killer leaves its ranks behind otherwise).

Two ways to kill a tree, for two callers: `kill_group` kills a job this process launched in a session
of its own (its process group, plus the descendants that left it); `kill_descendants` kills every
descendant of this process itself and reaps them, for a child subreaper that has inherited orphans.
`reap_and_run` is that subreaper: it runs a command as its child and, when the command ends, kills what
the command left behind in sessions of its own (distlab.publish.regenerate runs papermill under it, so a
job a notebook launched cannot outlive the notebook's kernel).
"""

from __future__ import annotations

import collections
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import psutil

# torchrun's failure summary: "rank      : 1 (local_rank: 1)" ... "exitcode  : -9 (pid: 123)"
_RANK_RE = re.compile(r"^\s*rank\s*:\s*(\d+)")
_EXIT_RE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
# torchrun --tee / our own log prefixes: "[default1]:..." or "[rank1]:..."
_PREFIX_RE = re.compile(r"^\[(?:default|rank)(\d+)\]:")

KILL_GRACE_S = 5.0
TRACK_INTERVAL_S = 0.25  # how often the job's process tree is sampled while it runs


@dataclass
class RunResult:
    cmd: list[str]
    returncode: int | None
    elapsed_s: float
    log_path: Path | None
    tail: list[str] = field(default_factory=list)
    timed_out: bool = False
    failed_ranks: dict[int, int] = field(default_factory=dict)  # rank -> exit code

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


class RunFailed(RuntimeError):
    def __init__(self, result: RunResult, rank_tails: dict[int, list[str]]):
        self.result = result
        if result.timed_out:
            head = f"timed out after {result.elapsed_s:.0f}s and was killed as a group"
        else:
            head = f"exited with code {result.returncode}"
        lines = [f"{' '.join(result.cmd[:3])}... {head}"]
        for rank, code in sorted(result.failed_ranks.items()):
            lines.append(f"  rank {rank} failed with exit code {code}"
                         + (" (killed by signal %d)" % -code if code < 0 else ""))
            for ln in rank_tails.get(rank, [])[-8:]:
                lines.append(f"    | {ln}")
        if not result.failed_ranks:
            lines.append("  last output:")
            lines += [f"    | {ln}" for ln in result.tail[-15:]]
        if result.log_path:
            lines.append(f"  full log: {result.log_path}")
        super().__init__("\n".join(lines))


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:  # the leader is already gone (or not ours to inspect)
        return []


def _running(p) -> bool:
    """Alive and not a zombie (a dead process waiting to be reaped has nothing left to kill)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:  # psutil.NoSuchProcess and friends
        return False


def track_tree(pgid: int, seen: dict) -> None:
    """Remember every current descendant of the group's leader (pid -> psutil.Process), and
    forget those already gone (a long job may start many short-lived helpers)."""
    for pid in [pid for pid, p in seen.items() if not _running(p)]:
        del seen[pid]
    for p in _descendants(pgid):
        seen.setdefault(p.pid, p)


def kill_group(pgid: int, grace_s: float = KILL_GRACE_S, also: Sequence = ()) -> None:
    """SIGTERM the group, give it `grace_s` to exit, then SIGKILL whatever is left.

    Descendants that moved to a session of their own (a Jupyter kernel does; a torchrun job
    launched from that kernel through this module does too) are not in the group, so they are
    found through the process tree while the leader is still alive and killed as well, with their
    own groups. `also` adds psutil.Process objects seen earlier (run() samples the tree while the
    job runs), which covers those whose parent is already gone. A psutil.Process remembers its
    start time, so a pid reused by an unrelated process is never signalled."""
    candidates = {p.pid: p for p in also}
    candidates.update({p.pid: p for p in _descendants(pgid)})
    strays = [p for p in candidates.values() if _running(p) and _pgid(p.pid) not in (pgid, None)]
    own = os.getpgrp()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        targets = [pgid] + [g for g in {_pgid(p.pid) for p in strays if _running(p)} if g is not None]
        for target in dict.fromkeys(targets):
            if target == own:
                continue
            try:
                os.killpg(target, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if sig == signal.SIGKILL:
            break
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (_alive_group(pgid) or any(_running(p) for p in strays)):
            time.sleep(0.05)
    for p in strays:  # a stray that left its group too (or shares ours)
        try:
            if _running(p):
                p.kill()
        except psutil.Error:  # gone between the check and the kill
            pass
    # SIGKILL is delivered asynchronously: wait (briefly) until the processes are really gone, so
    # that nothing is left running when this returns.
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and (_alive_group(pgid) or any(_running(p) for p in strays)):
        time.sleep(0.02)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _alive_group(pgid: int) -> bool:
    """Does the group still have a live member? Zombies do not count: the leader stays one until
    run() reaps it, and waiting for it would add the whole grace period to every timeout."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            pass
    return False


def kill_descendants(grace_s: float = 3.0) -> int:
    """SIGTERM every descendant of this process, SIGKILL what is left after `grace_s`, and reap
    them (so none stays behind as a zombie). Returns how many were found.

    Unlike kill_group this signals processes one by one, whatever their group, and waits for its
    own children: meant for a child subreaper, to which orphans that left their session are
    re-parented."""

    me = psutil.Process()
    total = 0
    for _ in range(3):  # a dying parent may start a last child; look again
        procs = me.children(recursive=True)
        if not procs:
            break
        total += len(procs)
        for sig_name in ("terminate", "kill"):
            for p in procs:
                try:
                    getattr(p, sig_name)()
                except psutil.Error:
                    pass
            procs = _wait_gone(procs, grace_s)
            if not procs:
                break
    _reap_zombies()
    return total


def _wait_gone(procs: list, timeout_s: float) -> list:
    """Wait until none of `procs` is alive (a zombie counts as gone); return those still alive."""
    deadline = time.monotonic() + timeout_s
    while True:
        _reap_zombies()  # orphans re-parented to this subreaper become our children
        procs = [p for p in procs if _running(p)]
        if not procs or time.monotonic() >= deadline:
            return procs
        time.sleep(0.05)


def _reap_zombies() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


PR_SET_CHILD_SUBREAPER = 36  # prctl option (linux/prctl.h): orphans below this process are re-parented to it


def _become_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class _Terminated(BaseException):
    pass


def reap_and_run(cmd: Sequence[str]) -> int:
    """Run `cmd` as a child of this process, marked as subreaper; when it ends (or this process is
    terminated) kill and reap every descendant, orphans that left their session included. Returns the
    command's exit code (128 + the signal's number when a signal ended it or this process)."""
    _become_subreaper()

    def on_signal(signum, _frame):
        raise _Terminated(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    code = 1
    try:
        child = subprocess.Popen(list(cmd))
        code = child.wait()
    except _Terminated as exc:
        code = 128 + int(exc.args[0])
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        left = kill_descendants()
        if left:
            print(f"[distlab.launch.process] killed {left} leftover process(es) that outlived "
                  f"{Path(cmd[0]).name if cmd else 'the command'} (orphans re-parented to this reaper)", flush=True)
    return code if code >= 0 else 128 - code


class _SigintHold:
    """Holds a SIGINT (Ctrl-C) back from its creation until `release()`, which gives it, if one came, to the
    handler there was before (Python's raises KeyboardInterrupt there and then). Only the main thread receives
    signals; elsewhere it holds nothing. A child started meanwhile keeps its own: exec resets a caught signal."""

    def __init__(self) -> None:
        self.came = False
        self._previous = None
        # (a handler installed outside Python reads as None: it is left alone)
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not None:
            self._previous = signal.signal(signal.SIGINT, self._hold)

    def _hold(self, signum, frame) -> None:
        self.came = True

    def release(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
            if self.came:
                signal.raise_signal(signal.SIGINT)


def run(
    cmd: Sequence[str],
    *,
    timeout_s: float,
    log_path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    echo: bool | Callable[[str], None] = True,
    check: bool = True,
    tail_lines: int = 200,
) -> RunResult:
    """Run `cmd` in its own process group with a hard timeout; stream and log its output.

    `env` is added to the current environment. `echo=True` prints each line (flushed, so a
    notebook shows it live); a callable receives each line instead. Raises RunFailed when
    `check` and the command failed or timed out. The process group is always killed at the
    end, so nothing the command started outlives this call."""
    cmd = [str(c) for c in cmd]
    full_env = dict(os.environ)
    if env:
        full_env.update({k: str(v) for k, v in env.items()})
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    log_file = None
    if log_path is not None:
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(log_path, "w", encoding="utf-8")
    emit = echo if callable(echo) else ((lambda s: print(s, flush=True)) if echo else None)

    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    rank_tails: dict[int, collections.deque[str]] = collections.defaultdict(lambda: collections.deque(maxlen=20))
    failed: dict[int, int] = {}
    pending_rank: list[int] = []

    def pump() -> None:
        assert proc is not None and proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            tail.append(line)
            m = _PREFIX_RE.match(line)
            if m:
                rank_tails[int(m.group(1))].append(line[m.end():])
            if (m := _RANK_RE.match(line)):
                pending_rank[:] = [int(m.group(1))]
            elif (m := _EXIT_RE.match(line)) and pending_rank:
                failed[pending_rank.pop()] = int(m.group(1))
            if log_file:
                log_file.write(line + "\n")
                log_file.flush()
            if emit:
                emit(line)

    reader = threading.Thread(target=pump, daemon=True)
    timed_out = False
    seen: dict = {}  # pid -> psutil.Process of every descendant observed while the job ran
    proc: subprocess.Popen | None = None
    start = time.monotonic()
    deadline = start + timeout_s
    # A Ctrl-C that comes before the child's group is known is held back, then raised inside the try: wherever
    # an interrupt lands, the handler below that kills the group sees it.
    hold = _SigintHold()
    try:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, text=True, errors="replace", bufsize=1,
        )
        pgid = proc.pid  # start_new_session: the child leads its own group
        hold.release()
        reader.start()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            try:
                proc.wait(timeout=min(TRACK_INTERVAL_S, remaining))
                break
            except subprocess.TimeoutExpired:
                track_tree(pgid, seen)
    except BaseException:  # KeyboardInterrupt from a notebook's stop button
        if proc is not None:
            kill_group(proc.pid, also=list(seen.values()))
            proc.wait()
        raise
    finally:
        hold.release()
        if proc is not None:
            # Also on success: a rank or helper that outlived the leader must not survive.
            kill_group(proc.pid, grace_s=KILL_GRACE_S if timed_out else 1.0, also=list(seen.values()))
            proc.wait()
        if reader.ident is not None:
            reader.join(timeout=5)
        if log_file:
            log_file.close()

    result = RunResult(cmd=cmd, returncode=proc.returncode, elapsed_s=time.monotonic() - start,
                       log_path=log_path, tail=list(tail), timed_out=timed_out, failed_ranks=dict(failed))
    if check and not result.ok:
        raise RunFailed(result, {r: list(t) for r, t in rank_tails.items()})
    return result


def python_module_cmd(module: str, *args: str) -> list[str]:
    """`python -m module args` with the current interpreter (the venv's, inside a notebook)."""
    return [sys.executable, "-m", module, *args]
