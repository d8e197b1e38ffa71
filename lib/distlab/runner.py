"""Run a launched job (torchrun, a shell script, papermill) so that it can never leave orphans.

The child gets its own process session, so the whole tree it starts (torchrun agent, its ranks,
their helpers) is one process group that we can kill at once. Output is streamed line by line to
the caller (a notebook cell shows it live) and to a log file. On failure, interrupt or timeout the
group is killed and the error says which rank failed and what it printed last.
"""

from __future__ import annotations

import collections
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

# torchrun's failure summary: "rank      : 1 (local_rank: 1)" ... "exitcode  : -9 (pid: 123)"
_RANK_RE = re.compile(r"^\s*rank\s*:\s*(\d+)")
_EXIT_RE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
# torchrun --tee / our own log prefixes: "[default1]:..." or "[rank1]:..."
_PREFIX_RE = re.compile(r"^\[(?:default|rank)(\d+)\]:")

KILL_GRACE_S = 5.0


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


def _descendants(pid: int) -> list:
    try:
        import psutil

        return psutil.Process(pid).children(recursive=True)
    except Exception:  # psutil missing or the leader already gone
        return []


def kill_group(pgid: int, grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM the group, give it `grace_s` to exit, then SIGKILL whatever is left.

    Descendants that moved to a session of their own (a Jupyter kernel does; a torchrun job
    launched from that kernel through this module does too) are not in the group, so they are
    found through the process tree while the leader is still alive and killed as well."""
    strays = [p for p in _descendants(pgid) if _pgid(p.pid) not in (pgid, None)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for target in [pgid] + [_pgid(p.pid) for p in strays]:
            if target is None or target == os.getpgrp():
                continue
            try:
                os.killpg(target, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if sig == signal.SIGKILL:
            break
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (_alive_group(pgid) or any(p.is_running() for p in strays)):
            time.sleep(0.05)
    for p in strays:  # a stray that left its group too
        try:
            p.kill()
        except Exception:
            pass


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _alive_group(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


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

    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True, text=True, errors="replace", bufsize=1,
    )
    pgid = proc.pid  # start_new_session: the child leads its own group

    def pump() -> None:
        assert proc.stdout is not None
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
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    except BaseException:  # KeyboardInterrupt from a notebook's stop button
        kill_group(pgid)
        proc.wait()
        raise
    finally:
        # Also on success: a rank or helper that outlived the leader must not survive.
        kill_group(pgid, grace_s=KILL_GRACE_S if timed_out else 1.0)
        proc.wait()
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
