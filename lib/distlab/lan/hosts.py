"""Emulated LAN hosts: Linux network namespaces on one switch, each link shaped with tc tbf.

    cluster = Cluster.from_rates(["1gbit", "1gbit", "1gbit"])
    with cluster.running():          # up (clearing any leftover first), down on exit, even on a crash
        cluster.exec_prefix(1)      # ["nsenter", "--net=/run/netns/dl5h1", "--", ...]

Topology: a namespace `dl5sw` holds the bridge `br0` (the switch); host i is the namespace `dl5h<i>`
with `lo` up (gloo and torchrun's store talk to themselves over it: without it rank 0 hangs) and
`eth0` at 10.77.0.<10+i>/24, one end of a veth pair whose other end (`h<i>`) is a port of the bridge.
Nothing lives in the root namespace, so deleting the `dl5*` namespaces removes every link, and no
address of the cluster is reachable from (or routed to) the outside.

Shaping: tbf on both ends of each host's link (egress of eth0 = upload, egress of the switch port =
download), with a 1 MB bucket (10 MB at 10 Gbit) and 50 ms queue. This kernel has no `netem`, so no
added latency, jitter or loss: emulating a WAN's delay would need sch_netem (or a userspace proxy
that holds packets), and delay also needs a larger tbf queue (`latency`) to avoid tail drops.

A crashed driver must not leave namespaces behind: `running()` tears down in `finally`, and starts
a watchdog process (`python -m distlab.lan reap`) that holds a pipe from the driver and tears the
cluster down when the pipe closes, which covers a SIGKILLed driver too. `up` first clears leftovers.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from distlab.lan import cgroups
from distlab.lan.cgroups import PREFIX

SWITCH_NS = f"{PREFIX}sw"
BRIDGE = "br0"
SUBNET = "10.77.0"
IFNAME = "eth0"  # the lan-ethernet network preset's interface name: the generated scripts need no override
NETNS_DIR = Path("/run/netns")
RATE_RE = re.compile(r"^(\d+)(kbit|mbit|gbit)$")
RATE_BITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
# The one "rate" the localhost fallback can measure at: loopback, where no rate was ever applied. Sweeps run
# there once under this label instead of labelling loopback numbers with rates they never had.
LOOPBACK = "loopback"


class LanError(RuntimeError):
    """The cluster cannot be built here (no root, no iproute2, no namespaces): the caller falls back."""


def rate_bits(rate: str) -> float:
    m = RATE_RE.match(rate)
    if not m:
        raise ValueError(f"link rate {rate!r}: expected e.g. 100mbit, 1gbit, 10gbit")
    return int(m.group(1)) * RATE_BITS[m.group(2)]


def link_bits(rate: str) -> float:
    """Bits per second of a sweep's link, for ordering it: `rate_bits`, and infinity for the unshaped loopback
    (nothing holds it back; `link_bytes_per_s` gives NaN for it, so no arithmetic treats it as a rate)."""
    return math.inf if rate == LOOPBACK else rate_bits(rate)


def link_bytes_per_s(rate: str) -> float:
    """Bytes per second the shaper allows at `rate`; NaN on loopback, which has no rate to compare with."""
    return math.nan if rate == LOOPBACK else rate_bits(rate) / 8


BURST_S = 0.002  # tbf's bucket holds this much of the line: enough for the rate with high-resolution timers
MIN_BURST = 64 * 2**10  # and never less than one segment the kernel hands the qdisc at once (64 KiB with GSO)


def burst_bytes(rate: str) -> int:
    """tbf's bucket at `rate`: 2 ms of the line, at least 64 KiB. It is also what the link lets through at once
    after an idle spell, faster than the rate (a real wire keeps no such credit), so it is kept that small: a fixed
    1 MiB bucket would be 168 ms of free line at 50 Mbit/s. Over any window of T seconds the link carries at most
    burst + rate x T bytes: a step that sends N bytes lasts at least (N - burst) / rate (the link floor)."""
    return bucket_bytes(rate_bits(rate))


def bucket_bytes(bits_per_s: float) -> int:
    """`burst_bytes` for a rate in bits per second."""
    return max(MIN_BURST, int(bits_per_s / 8 * BURST_S))


def link_floor_s(nbytes: float, bits_per_s: float) -> float:
    """The link floor: the least time a step that sends `nbytes` over a link shaped at `bits_per_s` can take,
    the bytes beyond one bucket (which pass at once after an idle spell: burst_bytes) at the rate."""
    return max(0.0, nbytes - bucket_bytes(bits_per_s)) * 8 / bits_per_s


def tbf_args(rate: str) -> list[str]:
    return ["tbf", "rate", rate, "burst", str(burst_bytes(rate)), "latency", "50ms"]


def sh(*cmd: str, check: bool = True, ns: str | None = None) -> subprocess.CompletedProcess:
    full = ["ip", "netns", "exec", ns, *cmd] if ns else list(cmd)
    res = subprocess.run(full, capture_output=True, text=True, timeout=30)
    if check and res.returncode:
        raise LanError(f"{' '.join(full)}: {res.stderr.strip() or res.stdout.strip()}")
    return res


def namespaces() -> list[str]:
    """Every namespace of ours that exists now (none where there is no `ip`: no namespace was built)."""
    if shutil.which("ip") is None:
        return []
    res = sh("ip", "netns", "list", check=False)
    return sorted(line.split()[0] for line in res.stdout.splitlines() if line.startswith(PREFIX))


def namespace_pids(ns: str) -> list[int]:
    res = sh("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in res.stdout.split()]


@dataclass
class Host:
    index: int
    rate: str = "1gbit"

    @property
    def ns(self) -> str:
        return f"{PREFIX}h{self.index}"

    @property
    def address(self) -> str:
        return f"{SUBNET}.{10 + self.index}"

    @property
    def port(self) -> str:
        return f"h{self.index}"


@dataclass
class Cluster:
    hosts: list[Host] = field(default_factory=list)

    @classmethod
    def from_rates(cls, rates: list[str]) -> "Cluster":
        for r in rates:
            rate_bits(r)
        return cls([Host(i, r) for i, r in enumerate(rates)])

    @property
    def addresses(self) -> list[str]:
        return [h.address for h in self.hosts]

    # ------------------------------------------------------------------ build and tear down
    def up(self) -> None:
        """Build the cluster from nothing (leftovers of an earlier run are removed first)."""
        if os.geteuid() != 0:
            raise LanError("network namespaces need root (CAP_NET_ADMIN)")
        down()
        try:
            sh("ip", "netns", "add", SWITCH_NS)
            sh("ip", "link", "add", BRIDGE, "type", "bridge", ns=SWITCH_NS)
            sh("ip", "link", "set", BRIDGE, "up", ns=SWITCH_NS)
            for h in self.hosts:
                sh("ip", "netns", "add", h.ns)
                sh("ip", "link", "set", "lo", "up", ns=h.ns)
                sh("ip", "link", "add", IFNAME, "type", "veth", "peer", "name", h.port, "netns", SWITCH_NS, ns=h.ns)
                sh("ip", "addr", "add", f"{h.address}/24", "dev", IFNAME, ns=h.ns)
                sh("ip", "link", "set", IFNAME, "up", ns=h.ns)
                sh("ip", "link", "set", h.port, "master", BRIDGE, ns=SWITCH_NS)
                sh("ip", "link", "set", h.port, "up", ns=SWITCH_NS)
                self.shape(h.index, h.rate)
        except BaseException:
            down()
            raise

    def shape(self, index: int, rate: str) -> None:
        """(Re)shape host `index`'s link to `rate`, both directions."""
        h = self.hosts[index]
        h.rate = rate
        sh("tc", "qdisc", "replace", "dev", IFNAME, "root", *tbf_args(rate), ns=h.ns)
        sh("tc", "qdisc", "replace", "dev", h.port, "root", *tbf_args(rate), ns=SWITCH_NS)

    def shape_all(self, rate: str) -> None:
        for h in self.hosts:
            self.shape(h.index, rate)

    def cut_link(self, index: int) -> None:
        """Unplug host `index`'s cable, as seen from inside it."""
        sh("ip", "link", "set", IFNAME, "down", ns=self.hosts[index].ns)

    @contextlib.contextmanager
    def running(self):
        """The cluster is up inside the block and gone after it, however the block ends."""
        self.up()
        watchdog = start_watchdog()
        try:
            yield self
        finally:
            down()
            with contextlib.suppress(OSError):
                watchdog.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                watchdog.wait(timeout=10)

    # ------------------------------------------------------------------ processes inside hosts
    def exec_prefix(self, index: int) -> list[str]:
        """Run a command in host `index`'s network namespace. nsenter, not `ip netns exec`:
        that one also remounts /sys, which daemons that read cgroups there trip over. A UTS namespace
        of its own gives the host its own hostname, its address: torchrun's c10d rendezvous decides
        which agent hosts the store by matching the endpoint against the hostname, as on real machines."""
        h = self.hosts[index]
        return ["nsenter", f"--net={NETNS_DIR / h.ns}", "--", "unshare", "--uts", "--",
                "sh", "-c", 'hostname "$0" && exec "$@"', h.address]

    def status(self) -> list[dict]:
        rows = []
        for h in self.hosts:
            exists = h.ns in namespaces()
            qdisc = sh("tc", "qdisc", "show", "dev", IFNAME, ns=h.ns, check=False).stdout.strip() if exists else ""
            link = sh("ip", "-br", "addr", "show", IFNAME, ns=h.ns, check=False).stdout.strip() if exists else ""
            rows.append({"host": h.ns, "address": h.address, "rate": h.rate, "up": exists, "link": link,
                         "qdisc": qdisc, "processes": len(namespace_pids(h.ns)) if exists else 0})
        return rows


def leftovers() -> list[str]:
    """What of ours exists now: namespaces, and cgroups as "<controller>:<name>" (empty after `down`)."""
    found = namespaces()
    for controller in ("cpu", "memory"):
        base = cgroups.ROOT / controller / PREFIX
        if base.exists():
            found += [f"{controller}:{p.name}" for p in base.iterdir() if p.is_dir()]
    return found


def down() -> list[str]:
    """Kill every process inside our namespaces, delete them (their links go with them) and our
    cgroups. Idempotent; returns what was removed."""
    removed = namespaces()
    for ns in removed:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = namespace_pids(ns)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 3
            while pids and namespace_pids(ns) and time.monotonic() < deadline:
                time.sleep(0.05)
    for ns in removed:
        sh("ip", "netns", "del", ns, check=False)
    removed += cgroups.remove_all()
    return removed


def start_watchdog() -> subprocess.Popen:
    """A process in a session of its own that tears the cluster down once our end of its pipe closes
    (this process exited, however: exception, SIGTERM, SIGKILL)."""
    return subprocess.Popen([sys.executable, "-m", "distlab.lan", "reap"], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def reap() -> None:
    """The watchdog's body: block until stdin closes, then tear down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a notebook's interrupt must not skip the teardown
    sys.stdin.buffer.read()
    down()


def available() -> tuple[bool, str]:
    """Can this machine build the namespace cluster? (ok, why not). Nothing is run before the cheap checks
    pass: on macOS or as a normal user no `ip` command is ever started."""
    if platform.system() != "Linux":
        return False, f"network namespaces are a Linux feature (this is {platform.system()})"
    if os.geteuid() != 0:
        return False, "not root: network namespaces need CAP_NET_ADMIN"
    for tool in ("ip", "tc", "nsenter"):
        if shutil.which(tool) is None:
            return False, f"{tool} is not installed (iproute2 / util-linux)"
    probe = f"{PREFIX}probe"
    res = sh("ip", "netns", "add", probe, check=False)
    sh("ip", "netns", "del", probe, check=False)
    if res.returncode:
        return False, f"ip netns add failed: {res.stderr.strip()}"
    return True, ""
