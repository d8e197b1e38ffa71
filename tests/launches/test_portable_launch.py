"""Launches that run on any reader's machine, macOS included: the Python watchdog that gives every generated
torchrun script its hard limit (no coreutils `timeout`; tests/launches/test_launch_runs.py runs generated scripts
with no `timeout` on PATH), the loopback interface by platform, and a local launch refused before it starts when it
asks for more GPU ranks than there are GPUs. Real processes throughout; pids are checked with psutil (by pid
and start time)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from distlab.launch import local
from distlab.launch.network import default_loopback, loopback_ifname
from test_runner import kill_leftovers, survivors  # the process-tree helpers the runner's own tests use

WATCHDOG = [sys.executable, "-m", "distlab.launch.watchdog"]


def watchdog(timeout_s: float, kill_after_s: float, *cmd: str) -> list[str]:
    return [*WATCHDOG, "--timeout-s", str(timeout_s), "--kill-after-s", str(kill_after_s), "--", *cmd]


def python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code), *args]


def wait_for(path: Path, proc: subprocess.Popen, within_s: float = 15.0) -> str:
    """The text the command wrote to `path` once it is complete (it ends with a newline)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if text.endswith("\n"):
            return text
        assert proc.poll() is None, f"the watchdog ended ({proc.returncode}) before the command was ready"
        time.sleep(0.02)
    raise AssertionError(f"the command did not write {path} within {within_s} s")


# ------------------------------------------------------------------ the watchdog

# The command: ignores SIGTERM (and so do its children: an ignored signal stays ignored across fork and exec),
# starts one child in its own process group and one in a session of its own (as torchrun starts its ranks),
# writes the three pids, then sleeps.
STUBBORN_TREE = """
    import os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sleeper = [sys.executable, "-c", "import time; time.sleep(300)"]
    same_group = subprocess.Popen(sleeper)
    own_session = subprocess.Popen(sleeper, start_new_session=True)
    with open(sys.argv[1], "w") as f:
        f.write(f"{os.getpid()} {same_group.pid} {own_session.pid}\\n")
    time.sleep(300)
"""


def test_the_limit_kills_the_whole_tree_even_what_ignores_sigterm_and_exits_124(tmp_path):
    pids = tmp_path / "pids"
    limit_s, kill_after_s = 2.0, 0.5
    t0 = time.monotonic()
    proc = subprocess.Popen(watchdog(limit_s, kill_after_s, *python(STUBBORN_TREE, str(pids))))
    tree: list[psutil.Process] = []
    try:
        tree = [psutil.Process(int(pid)) for pid in wait_for(pids, proc).split()]
        assert proc.wait(timeout=30) == 124
        elapsed = time.monotonic() - t0
        assert survivors(tree) == [], "the watchdog left part of the command's tree running"
        # SIGTERM was ignored by all three: only the SIGKILL, kill_after_s after the limit, ended them.
        assert limit_s + kill_after_s <= elapsed < limit_s + kill_after_s + 5
    finally:
        proc.kill()
        kill_leftovers(tree)


# The command starts a child in a session of its own (as torchrun starts a rank), writes its pid, and exits
# 0 a second later without stopping it: an orphan that only the watchdog's sampling of the tree can name.
LEAVES_AN_ORPHAN = """
    import subprocess, sys, time
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    with open(sys.argv[1], "w") as f:
        f.write(f"{orphan.pid}\\n")
    time.sleep(1)
"""


def test_what_the_command_left_running_is_stopped_when_it_ends(tmp_path):
    pid_file = tmp_path / "pid"
    proc = subprocess.Popen(watchdog(60, 5, *python(LEAVES_AN_ORPHAN, str(pid_file))))
    orphan: list[psutil.Process] = []
    try:
        orphan = [psutil.Process(int(wait_for(pid_file, proc)))]
        assert proc.wait(timeout=30) == 0
        assert survivors(orphan) == []
    finally:
        proc.kill()
        kill_leftovers(orphan)


@pytest.mark.parametrize("code, status", [("import sys; sys.exit(0)", 0), ("import sys; sys.exit(3)", 3),
                                          ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
                                           -signal.SIGKILL)])
def test_the_commands_exit_status_passes_through(code, status):
    """Within the limit the status is the command's; a command killed by a signal kills the watchdog with it."""
    assert subprocess.run(watchdog(30, 5, *python(code)), timeout=30).returncode == status


# Exits 7 on SIGTERM; with a second argument it ignores SIGINT and SIGTERM instead, so only SIGKILL ends it.
STOPS_ON_SIGTERM = """
    import signal, sys, time
    def stop(signum, frame):
        sys.exit(7)
    stubborn = len(sys.argv) > 2
    signal.signal(signal.SIGTERM, signal.SIG_IGN if stubborn else stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN if stubborn else signal.default_int_handler)
    with open(sys.argv[1], "w") as f:
        f.write("ready\\n")
    time.sleep(300)
"""


def test_a_signal_to_the_watchdog_reaches_the_command(tmp_path):
    ready = tmp_path / "ready"
    proc = subprocess.Popen(watchdog(60, 5, *python(STOPS_ON_SIGTERM, str(ready))))
    try:
        wait_for(ready, proc)
        proc.send_signal(signal.SIGTERM)  # what a scheduler, or process.run's kill, sends
        assert proc.wait(timeout=10) == 7  # the command's handler ran: the signal reached it, its status came back
    finally:
        proc.kill()


def test_a_passed_on_signal_the_command_ignores_ends_in_sigkill_after_kill_after(tmp_path):
    ready = tmp_path / "ready"
    proc = subprocess.Popen(watchdog(60, 0.5, *python(STOPS_ON_SIGTERM, str(ready), "stubborn")))
    try:
        wait_for(ready, proc)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)  # Ctrl-C in the terminal
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert 0.5 <= time.monotonic() - t0 < 4
    finally:
        proc.kill()


@pytest.mark.parametrize("args, status, message", [
    (["--timeout-s", "5", "--kill-after-s", "1"], 125, "no command: put it after `--`"),
    (["--timeout-s", "0", "--kill-after-s", "1", "--", "true"], 125, "argument --timeout-s: '0': needs a number"),
    (["--timeout-s", "5", "--kill-after-s", "nan", "--", "true"], 125, "--kill-after-s: 'nan' is not a finite number"),
    (["--timeout-s", "soon", "--kill-after-s", "1", "--", "true"], 125, "'soon' is not a number"),
    (["--kill-after-s", "1", "--", "true"], 125, "the following arguments are required: --timeout-s"),
    (["--timeout-s", "5", "--kill-after-s", "1", "--"], 125, "no command after `--`"),
    (["--timeout-s", "5", "--kill-after-s", "1", "--", "distlab-no-such-command"], 127,
     "distlab-no-such-command: command not found"),
])
def test_bad_arguments_and_missing_commands_are_one_line_with_timeouts_statuses(args, status, message):
    proc = subprocess.run([*WATCHDOG, *args], capture_output=True, text=True, timeout=30)
    assert proc.returncode == status
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m distlab.launch.watchdog: error: ") and message in lines[0]


# ------------------------------------------------------------------ the loopback interface

def test_the_loopback_is_a_real_interface_carrying_127_0_0_1():
    name = loopback_ifname()
    assert name in [n for _, n in socket.if_nameindex()]
    assert "127.0.0.1" in [a.address for a in psutil.net_if_addrs()[name] if a.family == socket.AF_INET]
    if sys.platform.startswith("linux") or sys.platform == "darwin":
        assert name == default_loopback()


def test_the_loopback_name_by_platform():
    assert [default_loopback(p) for p in ("linux", "darwin", "freebsd14", "openbsd7")] == ["lo", "lo0", "lo0", "lo0"]


def test_the_localhost_fallback_pins_gloo_and_nccl_to_this_machines_loopback():
    from distlab.lan.host_runs import Placement, cluster_spec

    placement = Placement(2, None, "asked for localhost")
    spec = cluster_spec(placement, local.training_spec("t_lo", 1, {"strategy": "ddp"}))
    assert spec.effective_env["GLOO_SOCKET_IFNAME"] == spec.effective_env["NCCL_SOCKET_IFNAME"] == loopback_ifname()
    assert placement.ifname == loopback_ifname()


# ------------------------------------------------------------------ GPU ranks against visible GPUs

def test_more_gpu_ranks_than_gpus_is_refused_with_one_line_naming_both_ways_out():
    with pytest.raises(local.GpuRanksError) as err:
        local.check_gpu_ranks(2, "cuda", gpus=1)
    assert str(err.value) == ("2 GPU ranks per node (device=cuda), but this machine has 1 visible CUDA GPU, one per "
                              "rank: launch at most 1 rank, or set device=cpu to run 2 gloo ranks on CPU")
    with pytest.raises(local.GpuRanksError, match="4 GPU ranks per node .device=auto.*2 visible CUDA GPUs"):
        local.check_gpu_ranks(4, "auto", gpus=2)  # auto means the GPUs when there are any
    with pytest.raises(local.GpuRanksError, match="no visible CUDA GPU: set device=cpu"):
        local.check_gpu_ranks(1, "cuda:0", gpus=0)


@pytest.mark.parametrize("ranks, device, gpus", [(4, "auto", 0), (8, "cpu", 1), (2, "cuda", 2), (1, "auto", 1)])
def test_launches_that_fit_are_not_refused(ranks, device, gpus):
    local.check_gpu_ranks(ranks, device, gpus=gpus)


def test_a_local_launch_is_refused_before_anything_is_written_or_started(tmp_path):
    import torch

    too_many = torch.cuda.device_count() + 1  # on any machine, one rank more than it has GPUs
    with pytest.raises(local.GpuRanksError, match=f"{too_many} .*ranks? .*device=cuda"):
        local.launch_training("t_gpus", too_many, {"device": "cuda"}, runs_dir=tmp_path / "runs",
                              scripts_dir=tmp_path / "scripts", echo=False)
    with pytest.raises(local.GpuRanksError, match="device=cuda"):  # one variant of a sweep is enough
        local.launch_sweep("t_gpus", too_many, {"strategy": "ddp"}, {"on_cpu": {"device": "cpu"},
                                                                     "on_gpus": {"device": "cuda"}},
                           runs_dir=tmp_path / "runs", scripts_dir=tmp_path / "scripts", echo=False)
    assert list(tmp_path.iterdir()) == []
