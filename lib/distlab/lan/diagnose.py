"""From a failed job's real output to (symptom, cause, fix), and the pre-flight checklist, executed.

    rows = diagnose(job.lines)                   # every rule that matched, with the line that matched
    matrix = troubleshooting_matrix({"link cut": rows, ...})   # the chapter's table, from real demos
    checks = checklist(placement)                # interfaces up, rendezvous port reachable, same software

The rules hold the causes and fixes; the symptoms in the matrix are the lines the demos printed, so the
table shows what a user will actually see (and a rule that stops matching shows up as a missing row).
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: re.Pattern
    cause: str
    fix: str


RULES = [
    Rule("peer connection lost", re.compile(r"Connection (closed|reset) by peer|Broken pipe|ECONNRESET", re.I),
         "a peer's process or its link went away in the middle of a collective",
         "check the link (`ip -br link`, cable, switch port) and which node died first; restart from the last "
         "checkpoint with a c10d rendezvous (torchrun --max-restarts)"),
    Rule("collective timed out", re.compile(r"Timed out waiting \d+ ?ms|timed out after \d+|Watchdog caught collective "
                                            r"operation timeout|wait timeout", re.I),
         "a rank stopped answering (link down, node hung or much slower) for longer than the collective timeout",
         "ping the nodes on the interface in GLOO/NCCL_SOCKET_IFNAME; lower collective_timeout_s to fail sooner"),
    Rule("unreachable", re.compile(r"No route to host|Network is unreachable|Connection refused|connect\(\) "
                                   r"call failed|Name or service not known", re.I),
         "the rendezvous host or a peer cannot be reached on that address/port",
         "check master address, firewall (allow the port and the subnet), and that node 0 is started first"),
    Rule("rendezvous never completed", re.compile(r"RendezvousTimeoutError|rendezvous.*timed out|"
                                                  r"DistStoreError|Socket Timeout", re.I),
         "not every node joined the rendezvous in time (wrong node rank, wrong port, a node not started)",
         "start every node's script with a distinct node rank and the same master address and port"),
    # Not on a bare exit code -9: any SIGKILL gives it ("rank killed" below); only memory's own words count.
    Rule("out of memory", re.compile(r"OOM killer|out of memory|can't allocate memory|Cannot allocate memory", re.I),
         "the rank exceeded its device's memory (here: its cgroup memory cap) and was killed",
         "use the planner's advice: smaller micro-batch, activation checkpointing, LoRA, or a sharded strategy"),
    Rule("memory cap hit (OOM kill)", re.compile(r"memory cgroup: oom_kill [1-9]|Memory cgroup out of memory", re.I),
         "the host's memory (here its cgroup cap, on a GPU its VRAM) was smaller than what the rank needs: "
         "the kernel's OOM killer SIGKILLed it",
         "plan first (distlab.planning plan_memory / recommend with this device's memory): LoRA, a sharded "
         "strategy (ZeRO-2, FSDP), activation checkpointing or a smaller micro-batch"),
    Rule("wrong node rank", re.compile(r"wrong node rank: node rank \d+ belongs on", re.I),
         "a node script was started on a host its node rank does not belong to (copied script, rank given twice)",
         "start on each host the script of its own node rank (nodeN.sh of the generated folder's README)"),
    Rule("environment mismatch", re.compile(r"MISMATCH in", re.I),
         "the nodes do not run the same software stack (torch, Python, CUDA/NCCL versions)",
         "install the same locked environment on every node, then rerun the fingerprint check"),
    Rule("worker killed and restarted", re.compile(r"resumed from .*checkpoint|Restarting worker group|"
                                                   r"restart.*worker", re.I),
         "a worker died; torchrun (max_restarts > 0) restarted the group and the loop resumed from a checkpoint",
         "nothing to do if it resumed; find why the worker died (dmesg, the rank's log) if it repeats"),
    Rule("rank killed", re.compile(r"Signals\.SIGKILL|exitcode\s*:\s*-9|SIGKILL", re.I),
         "a rank was killed from outside (OOM killer, a user, a lost node)",
         "look at the host's kernel log / memory cap; set checkpoint_steps so a restart loses little"),
]


def diagnose(lines: Iterable[str]) -> list[dict]:
    """Each rule that matches some line: rule name, the first matching line, cause, fix."""
    lines = list(lines)
    found = []
    for rule in RULES:
        hit = next((ln for ln in lines if rule.pattern.search(ln)), None)
        if hit is not None:
            found.append({"rule": rule.name, "line": hit.strip()[:240], "cause": rule.cause, "fix": rule.fix})
    return found


def first_error(lines: Sequence[str]) -> str:
    """The most telling line of a failed job: the first that a rule matches, else the last error-looking one."""
    found = diagnose(lines)
    if found:
        return found[0]["line"]
    errors = [ln for ln in lines if re.search(r"error|exception|failed", ln, re.I)]
    return errors[-1].strip() if errors else (lines[-1].strip() if lines else "")


def troubleshooting_matrix(demos: Mapping[str, Sequence[dict]]):
    """A pandas DataFrame: one row per (demo, matched rule) with the real line as the symptom."""
    import pandas as pd  # deferred: pandas only where a table is built

    rows = [{"demo": demo, "symptom": f["line"], "rule": f["rule"], "cause": f["cause"], "fix": f["fix"]}
            for demo, found in demos.items() for f in found]
    return pd.DataFrame(rows, columns=["demo", "symptom", "rule", "cause", "fix"])


# ---------------------------------------------------------------------- the checklist, executed

def _in_host(placement, i: int, argv: Sequence[str], timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run([*placement.prefix(i), *argv], capture_output=True, text=True, timeout=timeout)


LISTEN = ("import socket,sys\ns=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
          "s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(16); s.settimeout(15); print('listening', flush=True)\n"
          "for _ in range(int(sys.argv[3])):\n    c, _ = s.accept(); c.close()\n")
# What `bash -c 'exec 3<>/dev/tcp/HOST/PORT'` checks on a LAN, in Python: no bash, no /dev/tcp, no `timeout`
# (macOS has none), the same answer.
CONNECT = "import socket,sys\nsocket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()\n"


def interface_row(placement, i: int, use_ip: bool) -> dict:
    """Host i's interface is up and holds its address: `ip -br addr` where this machine has iproute2 (always on
    the namespace cluster), else the interface table Python reads (psutil: macOS, or Linux without iproute2)."""
    name, addr = placement.ifname, placement.addresses[i]
    check = {"check": f"interface {name} up with {addr}", "host": placement.name(i)}
    if use_ip:
        res = _in_host(placement, i, ["ip", "-br", "addr", "show", name])
        ok = res.returncode == 0 and ("UP" in res.stdout or "UNKNOWN" in res.stdout) and addr in res.stdout
        return {**check, "ok": ok, "detail": (res.stdout or res.stderr).strip()}
    import psutil  # deferred: only the fallback without iproute2 reads the interfaces itself

    stats, addrs = psutil.net_if_stats(), psutil.net_if_addrs()
    if name not in stats:
        return {**check, "ok": False, "detail": f"no interface {name}; this machine has {', '.join(sorted(stats))}"}
    held = [a.address for a in addrs.get(name, ()) if a.family == socket.AF_INET]
    return {**check, "ok": stats[name].isup and addr in held,
            "detail": f"{name} {'UP' if stats[name].isup else 'DOWN'} {' '.join(held)} (psutil: no `ip` here)"}


def checklist(placement, port: int, network_tools: bool | None = None) -> list[dict]:
    """Before a multi-node launch: every host's interface is up with its address; host 0 can listen on the
    rendezvous port; every host reaches it there. (Identical software: distlab.workers.fingerprint.)
    `network_tools`: whether this machine has `ip` (distlab.machine.Machine.network_tools; None: look on PATH);
    without it the interfaces are read through psutil, so the fallback never starts a command it lacks."""
    use_ip = placement.cluster is not None or (shutil.which("ip") is not None if network_tools is None
                                               else network_tools)
    rows = [interface_row(placement, i, use_ip) for i in range(len(placement.addresses))]
    others = list(range(1, len(placement.addresses)))
    listener = subprocess.Popen([*placement.prefix(0), sys.executable, "-c", LISTEN, placement.addresses[0],
                                 str(port), str(len(others))], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        ready = listener.stdout.readline().strip() == "listening"
        rows.append({"check": f"port {port} free on the rendezvous host", "host": placement.name(0), "ok": ready,
                     "detail": "bound" if ready else listener.stderr.read().strip()[-200:]})
        for i in others:
            res = _in_host(placement, i, [sys.executable, "-c", CONNECT, placement.addresses[0], str(port)])
            error = res.stderr.strip().splitlines()[-1:] if res.returncode else []
            rows.append({"check": f"reaches {placement.addresses[0]}:{port}", "host": placement.name(i),
                         "ok": res.returncode == 0, "detail": error[0][-200:] if error else "connected"})
    finally:
        listener.kill()
        listener.wait()
    return rows
