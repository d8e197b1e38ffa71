"""distlab.launch.process's guarantees, proven with real processes (bash, sleep, python, torchrun on CPU).

Every test records the processes that the job started (they print "PID <n>" lines, read through
the echo callback while the job runs) and checks with psutil, by pid and start time, that none
of them is still running afterwards. A zombie (dead, waiting for a parent to reap it) counts as
gone: in a container, orphans are re-parented to a PID 1 that may never reap them.
"""

from __future__ import annotations

import _thread
import os
import re
import signal
import sys
import textwrap
import time
import warnings
from pathlib import Path

import psutil
import pytest

from distlab.launch import process

PID_RE = re.compile(r"PID (\d+)")


class Recorder:
    """An echo callback that keeps every line, its arrival time, and the processes named in it."""

    def __init__(self, on_line=None):
        self.lines: list[str] = []
        self.times: list[float] = []
        self.procs: list[psutil.Process] = []
        self.on_line = on_line

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        self.times.append(time.monotonic())
        for pid in PID_RE.findall(line):
            try:
                self.procs.append(psutil.Process(int(pid)))  # remembers the start time too
            except psutil.NoSuchProcess:
                pass
        if self.on_line:
            self.on_line(line)


def survivors(procs: list[psutil.Process], wait_s: float = 0.0) -> list[psutil.Process]:
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def kill_leftovers(procs: list[psutil.Process]) -> None:
    """Never leave a sleeper behind, even when a test fails."""
    for p in survivors(procs):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


# A python child started by bash; it starts its own session (start_new_session=True, as torchrun
# does for every rank) for a grandchild that ignores SIGTERM, then sleeps. Neither is in the job's
# process group, so only the runner's process-tree tracking can find them.
SESSION_ESCAPER = textwrap.dedent("""
    import signal, subprocess, sys, time
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
    g = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    print(f"escaper PID {g.pid}", flush=True)
    time.sleep(0.3)  # let it install its SIGTERM handler before we say READY
    print("READY", flush=True)
    time.sleep(300)
""")


def tree_script(tmp_path: Path) -> list[str]:
    """bash -> 2 x sleep, setsid sleep (own session), python -> python (own session, ignores TERM)."""
    escaper = tmp_path / "escaper.py"
    escaper.write_text(SESSION_ESCAPER)
    script = f"""
        sleep 300 & echo "sleep PID $!"
        sleep 300 & echo "sleep PID $!"
        setsid sleep 300 & echo "setsid sleep PID $!"
        {sys.executable} {escaper} & echo "python PID $!"
        wait
    """
    return ["bash", "-c", textwrap.dedent(script)]


def test_output_streams_line_by_line_in_order_and_to_the_log(tmp_path):
    log = tmp_path / "logs" / "job.log"
    seen_in_log = []

    def check_log(line):  # the log is written (and flushed) before the line is echoed
        seen_in_log.append(line in log.read_text().splitlines())

    rec = Recorder(on_line=check_log)
    cmd = ["bash", "-c", "for i in 1 2 3 4 5; do echo line $i; sleep 0.25; done; echo oops >&2"]
    result = process.run(cmd, timeout_s=30, log_path=log, echo=rec)
    expected = [f"line {i}" for i in range(1, 6)] + ["oops"]
    assert result.ok and result.returncode == 0
    assert rec.lines == expected  # stderr is merged, order is kept
    assert all(seen_in_log)
    assert log.read_text().splitlines() == expected
    assert result.tail == expected
    # Live, not at the end: the first line arrived about a second before the last one.
    assert rec.times[-1] - rec.times[0] > 0.8


def test_failure_raises_with_the_last_output(tmp_path):
    with pytest.raises(process.RunFailed) as err:
        process.run(["bash", "-c", "echo about to fail; exit 7"], timeout_s=30, echo=False,
                   log_path=tmp_path / "fail.log")
    assert err.value.result.returncode == 7 and not err.value.result.timed_out
    assert "exited with code 7" in str(err.value) and "about to fail" in str(err.value)
    assert str(tmp_path / "fail.log") in str(err.value)
    result = process.run(["bash", "-c", "exit 7"], timeout_s=30, echo=False, check=False)
    assert result.returncode == 7 and not result.ok


def test_timeout_kills_grandchildren_and_other_sessions(tmp_path, monkeypatch):
    monkeypatch.setattr(process, "KILL_GRACE_S", 1.0)  # the grandchild ignores SIGTERM: SIGKILL after 1 s
    rec = Recorder()
    t0 = time.monotonic()
    try:
        with pytest.raises(process.RunFailed) as err:
            process.run(tree_script(tmp_path), timeout_s=3, echo=rec)
        elapsed = time.monotonic() - t0
        assert err.value.result.timed_out
        assert re.search(r"timed out after \d+s and was killed as a group", str(err.value))
        assert "READY" in rec.lines and len(rec.procs) == 5
        assert survivors(rec.procs) == []
        assert elapsed < 3 + 1.0 + 2.0  # the limit, one grace period, slack
    finally:
        kill_leftovers(rec.procs)


def test_timeout_returns_promptly_when_the_job_stops_on_sigterm():
    """The limit is hard: a job that dies on SIGTERM must not cost the whole grace period too
    (the job's leader stays a zombie until reaped, and must not count as still running)."""
    t0 = time.monotonic()
    with pytest.raises(process.RunFailed) as err:
        process.run(["bash", "-c", "sleep 300 & sleep 300"], timeout_s=1, echo=False)
    assert err.value.result.timed_out
    assert time.monotonic() - t0 < 1 + process.KILL_GRACE_S - 2


@pytest.fixture
def ctrl_c_raises():
    """Ctrl-C as a terminal or a notebook's stop button meets it: Python's own handler (KeyboardInterrupt), whatever
    an earlier test in this process left installed; that one is put back afterwards, and named in a warning."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    if previous is not signal.default_int_handler:
        warnings.warn(f"an earlier test left SIGINT handled by {previous!r}")
    yield
    signal.signal(signal.SIGINT, previous)


def test_keyboard_interrupt_kills_the_group(tmp_path, ctrl_c_raises):
    def interrupt_when_ready(line):
        if line == "READY":
            _thread.interrupt_main()  # what a notebook's stop button does

    rec = Recorder(on_line=interrupt_when_ready)
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            process.run(tree_script(tmp_path), timeout_s=60, echo=rec)
        assert len(rec.procs) == 5
        assert survivors(rec.procs) == []
        # Only the grandchild that ignores SIGTERM may use the grace period.
        assert time.monotonic() - t0 < process.KILL_GRACE_S + 4
    finally:
        kill_leftovers(rec.procs)


def test_a_ctrl_c_while_the_child_starts_still_kills_its_group(monkeypatch, ctrl_c_raises):
    """The interrupt lands inside Popen, after the child exists and before the runner knows its pid: held back
    until the pid is known, then raised where the handler that kills the group sees it."""
    started: list[psutil.Process] = []
    real_popen = process.subprocess.Popen

    def popen_then_ctrl_c(*args, **kwargs):
        child = real_popen(*args, **kwargs)
        started.append(psutil.Process(child.pid))
        os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C does, at the worst moment
        return child

    monkeypatch.setattr(process.subprocess, "Popen", popen_then_ctrl_c)
    try:
        with pytest.raises(KeyboardInterrupt):
            process.run(["sleep", "300"], timeout_s=60, echo=False)
        assert len(started) == 1 and survivors(started) == []
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back
    finally:
        kill_leftovers(started)


def test_orphans_of_a_leader_that_exits_are_killed(tmp_path):
    """The leader exits normally but left a child in a session of its own (a daemon): the group
    kill cannot reach it and the leader can no longer name it; the runner saw it while it ran."""
    rec = Recorder()
    script = "setsid sleep 300 & echo \"daemon PID $!\"; sleep 1; echo leaving"
    try:
        result = process.run(["bash", "-c", script], timeout_s=30, echo=rec)
        assert result.ok and len(rec.procs) == 1
        assert survivors(rec.procs) == []
    finally:
        kill_leftovers(rec.procs)


# ------------------------------------------------------------------ torchrun (CPU, no torch import)

WORKER = textwrap.dedent("""
    import os, signal, sys, time
    rank = int(os.environ["RANK"])
    print(f"rank {rank} PID {os.getpid()}", flush=True)
    mode = os.environ["WORKER_MODE"]
    if rank == 1:
        time.sleep(0.5)
        print("MARKER: rank 1 gives up", flush=True)
        print("MARKER: last words on stderr", file=sys.stderr, flush=True)
        if mode == "exit3":
            sys.exit(3)
        if mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0 and mode == "kill_agent":
        time.sleep(1.5)  # the runner has seen the ranks by now
        os.kill(os.getppid(), signal.SIGKILL)  # torchrun dies as if OOM-killed: its ranks stay
    time.sleep(300)
""")


def torchrun(tmp_path: Path, mode: str, rec: Recorder, timeout_s: float = 60):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    cmd = process.python_module_cmd("torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                   "--tee", "3", "--log-dir", str(tmp_path / "torchrun_logs"), str(worker))
    return process.run(cmd, timeout_s=timeout_s, echo=rec, log_path=tmp_path / "job.log",
                      env={"OMP_NUM_THREADS": "1", "WORKER_MODE": mode})


def test_torchrun_rank_exit_code_is_reported_with_its_last_lines(tmp_path):
    rec = Recorder()
    try:
        with pytest.raises(process.RunFailed) as err:
            torchrun(tmp_path, "exit3", rec)
        msg = str(err.value)
        # This torch tees each rank's lines as "[default<local rank>]:..."; the runner keys on it.
        assert any(ln.startswith("[default1]:MARKER: rank 1 gives up") for ln in rec.lines)
        assert err.value.result.failed_ranks.get(1) == 3
        assert "rank 1 failed with exit code 3" in msg
        assert "    | MARKER: rank 1 gives up" in msg
        assert "    | MARKER: last words on stderr" in msg
        assert len(rec.procs) == 2
        assert survivors(rec.procs) == []
        assert list((tmp_path / "torchrun_logs").rglob("stdout.log"))  # --tee also wrote the files
    finally:
        kill_leftovers(rec.procs)


def test_torchrun_rank_killed_by_a_signal_is_reported_with_it(tmp_path):
    rec = Recorder()
    try:
        with pytest.raises(process.RunFailed) as err:
            torchrun(tmp_path, "sigkill", rec)
        assert err.value.result.failed_ranks.get(1) == -9
        assert "rank 1 failed with exit code -9 (killed by signal 9)" in str(err.value)
        assert survivors(rec.procs) == []
    finally:
        kill_leftovers(rec.procs)


def test_ranks_of_a_killed_torchrun_agent_do_not_survive(tmp_path):
    """torchrun starts each rank in a session of its own; if the agent itself dies (OOM killer,
    kill -9), its ranks are orphans that would hold their GPU memory forever."""
    rec = Recorder()
    try:
        with pytest.raises(process.RunFailed) as err:
            torchrun(tmp_path, "kill_agent", rec)
        assert err.value.result.returncode == -9
        assert len(rec.procs) == 2
        assert survivors(rec.procs, wait_s=1.0) == []
    finally:
        kill_leftovers(rec.procs)
