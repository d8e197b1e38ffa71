"""Uneven devices on one machine: a CPU share and a memory cap per emulated host (cgroup v1).

    limits = HostLimits(cpu=0.5, memory_bytes=700 * 2**20)   # half a core, a 700 MiB "card"
    prefix = limits.apply("dl5h1")                          # argv prefix that runs a command inside them

A quota of q cores (`cpu.cfs_quota_us = q x cpu.cfs_period_us`) is exact here: 0.5 -> about 2x slower
on a single-threaded rank (measured +-15% on a busy machine). SCHED_IDLE is not a substitute: it starves.
The memory cap (`memory.limit_in_bytes`, swap included) stands in for a smaller GPU: overflowing it gets
the rank OOM-killed (SIGKILL, exit -9), which `memory.failcnt` and `oom_killed` confirm afterwards.

Fallback when /sys/fs/cgroup/{cpu,memory} are not writable (no root, cgroup v2 only, a container):
`Throttle` stops and continues the rank's processes (SIGSTOP/SIGCONT) for (1 - q) of every 100 ms, the
same duty cycle the CFS quota enforces, so a rank's compute takes 1/q as long: the "sleep (factor-1) x
compute" of the LAN-cluster guide, applied from outside so the training loop stays unchanged. It is coarser (a
stopped rank also stops answering the network) and there is no memory-cap fallback: `supported()` says
which path runs, and callers print it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

PREFIX = "dl5"  # every namespace, link and cgroup of the emulated cluster starts with it
ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


def group_dir(controller: str, name: str) -> Path:
    return ROOT / controller / PREFIX / name


def supported() -> tuple[bool, str]:
    for controller in ("cpu", "memory"):
        base = ROOT / controller
        if not (base / "cgroup.procs").exists():
            return False, f"{base} is not a cgroup v1 hierarchy"
        if not os.access(base, os.W_OK):
            return False, f"{base} is not writable (needs root)"
    return True, ""


@dataclass
class HostLimits:
    cpu: float | None = None  # cores; None: unlimited
    memory_bytes: int | None = None  # None: unlimited
    # "quota": cgroup cfs quota (exact on an idle machine); "duty": the SIGSTOP/SIGCONT Throttle, which
    # stays relative on a machine other jobs load (a quota above what a busy core gives no longer binds)
    # "sleep": distlab.faults.install_slowdown (DISTLAB_SLOWDOWN = 1/cpu), relative to the rank's own compute
    cpu_mode: str = "quota"

    def env(self) -> dict[str, str]:
        return {"DISTLAB_SLOWDOWN": f"{1 / self.cpu:g}"} if self.cpu and self.cpu_mode == "sleep" else {}

    def apply(self, name: str) -> list[str]:
        """Create (or reset) the host's groups and return an argv prefix that moves the command into them.
        The prefix is `sh -c 'echo $$ > .../cgroup.procs; exec "$@"'`: the command and all it starts inherit."""
        dirs = []
        if self.cpu is not None and self.cpu_mode == "quota":
            d = _fresh("cpu", name)
            (d / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (d / "cpu.cfs_quota_us").write_text(str(int(self.cpu * PERIOD_US)))
            dirs.append(d)
        if self.memory_bytes is not None:
            d = _fresh("memory", name)
            (d / "memory.limit_in_bytes").write_text(str(int(self.memory_bytes)))
            with contextlib.suppress(OSError):  # no swap accounting on this kernel: the cap alone holds
                (d / "memory.memsw.limit_in_bytes").write_text(str(int(self.memory_bytes)))
            dirs.append(d)
        if not dirs:
            return []
        moves = "; ".join(f"echo $$ > {d / 'cgroup.procs'}" for d in dirs)
        return ["sh", "-c", f'{moves}; exec "$@"', "sh"]


def _fresh(controller: str, name: str) -> Path:
    d = group_dir(controller, name)
    remove(controller, name)
    d.mkdir(parents=True, exist_ok=True)
    return d


def oom_killed(name: str) -> dict:
    """What the memory group of host `name` saw: its cap, peak use, and how often the cap was hit."""
    d = group_dir("memory", name)
    if not d.exists():
        return {}

    def read(f: str) -> int:
        try:
            return int((d / f).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return -1

    control = {}
    with contextlib.suppress(OSError):
        control = dict(line.split() for line in (d / "memory.oom_control").read_text().splitlines())
    return {"limit_bytes": read("memory.limit_in_bytes"), "max_usage_bytes": read("memory.max_usage_in_bytes"),
            "failcnt": read("memory.failcnt"), "oom_kills": int(control.get("oom_kill", 0))}


def remove(controller: str, name: str) -> bool:
    """Kill what is left in the group and delete it."""
    d = group_dir(controller, name)
    if not d.exists():
        return False
    for _ in range(50):
        pids = [int(p) for p in (d / "cgroup.procs").read_text().split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    with contextlib.suppress(OSError):
        d.rmdir()
    return not d.exists()


def remove_all() -> list[str]:
    removed = []
    for controller in ("cpu", "memory"):
        base = ROOT / controller / PREFIX
        if not base.exists():
            continue
        for d in sorted(p for p in base.iterdir() if p.is_dir()):
            if remove(controller, d.name):
                removed.append(f"{controller}:{PREFIX}/{d.name}")
        with contextlib.suppress(OSError):
            base.rmdir()
    return removed


class Throttle:
    """The fallback: hold a process tree to `cpu` of a core by SIGSTOP/SIGCONT duty cycles."""

    def __init__(self, root_pid: int, cpu: float, period_s: float = 0.1):
        self.root, self.cpu, self.period = root_pid, cpu, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.root)
            return [root, *root.children(recursive=True)]
        except (psutil.Error, ValueError):  # gone, or not attached yet (root -1)
            return []

    def _signal(self, sig: int) -> None:
        for p in self._tree():
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)

    def _loop(self) -> None:
        while not self._stop.is_set() and self._tree():
            time.sleep(self.period * self.cpu)
            self._signal(signal.SIGSTOP)
            time.sleep(self.period * (1 - self.cpu))
            self._signal(signal.SIGCONT)
        self._signal(signal.SIGCONT)

    def start(self) -> "Throttle":
        if self.cpu < 1:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self._signal(signal.SIGCONT)
