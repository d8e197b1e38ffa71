"""torchrun across the emulated hosts: one agent per host, each from the per-node script distlab.launch
writes, each started inside its host (namespace, CPU share, memory cap) through distlab.launch.process.

    placement = place(3)                       # the namespace cluster if this machine can build one
    with placement.running():
        job = run_training(placement, "ddp3", {"strategy": "ddp", "max_steps": 20}, limits=[...])

The scripts are the ones a real 3-machine LAN runs (static or c10d rendezvous at host 0's address,
GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME from the lan-ethernet preset: eth0, which is also the emulated
hosts' interface). Without namespaces (no root, no iproute2) `place` falls back to agents on localhost
(127.0.0.1, the loopback interface: lo, lo0 on macOS) and says so: `placement.kind` is "namespaces" or "localhost".

A failed node does not stop the others by itself (on a real LAN nothing would tell them): they fail at
their next collective, within TrainConfig.collective_timeout_s, or at the script's hard limit. Each
node's runner kills its whole process tree, and `running()` removes the namespaces and cgroups.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from distlab.lan import hosts
from distlab.lan.cgroups import HostLimits, Throttle
from distlab.lan.cgroups import supported as cgroups_supported
from distlab.launch.local import TINY_CONFIG, training_spec
from distlab.launch.network import loopback_ifname
from distlab.launch.process import RunResult, run
from distlab.launch.spec import LaunchSpec
from distlab.launch.torchrun import write_scripts
from distlab.paths import BUILD_DIR, REPO_ROOT, RUNS_DIR

SCRIPTS_DIR = BUILD_DIR / "lan" / "launch"
PORT = 29577  # the rendezvous port on host 0 (a localhost fallback shares the machine: not 29500)


@dataclass
class Placement:
    """Where the agents run: `cluster` (namespaces) or, when it is None, localhost."""

    nodes: int
    cluster: hosts.Cluster | None = None
    why_local: str = ""

    @property
    def kind(self) -> str:
        return "namespaces" if self.cluster else "localhost"

    @property
    def addresses(self) -> list[str]:
        return self.cluster.addresses[:self.nodes] if self.cluster else ["127.0.0.1"] * self.nodes

    @property
    def why_unshaped(self) -> str | None:
        """Why no claim about link rates holds here (None on the namespace cluster, whose links are shaped)."""
        return None if self.cluster else "the links are loopback, not shaped (localhost fallback)"

    def link_rates(self, rates: Sequence[str]) -> list[str]:
        """The rates a sweep really applies: `rates` on the namespace cluster; on localhost the one unshaped
        loopback (hosts.LOOPBACK), measured once instead of once per rate it would never have."""
        return list(rates) if self.cluster else [hosts.LOOPBACK]

    def subset(self, nodes: int) -> "Placement":
        """The first `nodes` hosts of the same cluster (a 2-host job on the 3-host LAN)."""
        return Placement(nodes, self.cluster, self.why_local)

    @property
    def ifname(self) -> str:
        return hosts.IFNAME if self.cluster else loopback_ifname()

    def name(self, i: int) -> str:
        return self.cluster.hosts[i].ns if self.cluster else f"local{i}"

    def prefix(self, i: int) -> list[str]:
        return self.cluster.exec_prefix(i) if self.cluster else []

    @contextlib.contextmanager
    def running(self):
        if self.cluster is None:
            yield self
            return
        with self.cluster.running():
            yield self

    def describe(self) -> str:
        if self.cluster:
            return (f"{self.nodes} emulated hosts (network namespaces "
                    + ", ".join(f"{h.ns}={h.address} @ {h.rate}" for h in self.cluster.hosts) + ")")
        return f"{self.nodes} torchrun agents on localhost (FALLBACK: {self.why_local})"

    def mode_line(self, demos: bool = True) -> str:
        """Which mode this run is in, and what the reader loses when it is the fallback (`demos`: also chapter
        05's failure demos and slow hosts; chapter 08 has neither)."""
        if self.cluster:
            return f"mode: namespaces. {self.describe()}"
        line = (f"mode: FALLBACK to localhost, because {self.why_local}.\n"
                "  Every host is a torchrun agent on this machine talking over loopback: the links are not shaped, "
                "so each sweep over link rates runs once on loopback, labelled so,\n  and no claim about link rates "
                "is checked")
        return line + ("; there are no memory caps and no per-host cables to cut (those demos are skipped and say "
                       "so); slow hosts still come from cpu_mode='sleep'." if demos else ".")


def place(nodes: int, rates: Sequence[str] | str = "1gbit", force_local: bool = False) -> Placement:
    rates = [rates] * nodes if isinstance(rates, str) else list(rates)
    ok, why = (False, "asked for localhost") if force_local else hosts.available()
    if not ok:
        print(f"[distlab.lan] namespaces unavailable ({why}): falling back to localhost agents", flush=True)
        return Placement(nodes, None, why)
    return Placement(nodes, hosts.Cluster.from_rates(rates))


def cluster_spec(placement: Placement, base: LaunchSpec, rendezvous: str = "static", port: int = PORT,
                 max_restarts: int = 0) -> LaunchSpec:
    """`base` (one node's launch) as a job over every host: node ranks, host 0 as master, the LAN preset."""
    addr = placement.addresses[0]
    where = (dict(master_addr=addr, master_port=port, rdzv_endpoint=None) if rendezvous == "static"
             else dict(master_addr=None, rdzv_endpoint=f"{addr}:{port}"))
    env = {**base.env}
    if not placement.cluster:  # the preset's eth0 is not this machine's loopback
        loopback = loopback_ifname()
        env.update(GLOO_SOCKET_IFNAME=loopback, NCCL_SOCKET_IFNAME=loopback)
    return dataclasses.replace(base, nnodes=placement.nodes, nproc_per_node=1, node_rank=0, rendezvous=rendezvous,
                               hosts=placement.addresses if placement.cluster else [], network="lan-ethernet",
                               env=env, max_restarts=max_restarts, **where)


@dataclass
class ClusterRun:
    name: str
    scripts: list[Path]
    results: list[RunResult]
    elapsed_s: float
    output_dir: Path | None = None
    lines: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def log(self) -> Path:
        return Path(self.output_dir) / "train_log.jsonl"

    def failure(self) -> str:
        """One paragraph per failed node: exit status and its last lines."""
        out = []
        for i, r in enumerate(self.results):
            if r.ok:
                continue
            head = "timed out" if r.timed_out else f"exit code {r.returncode}"
            out.append(f"node {i} ({head} after {r.elapsed_s:.1f}s):")
            out += [f"  | {ln}" for ln in r.tail[-6:]]
        return "\n".join(out)


def run_spec(placement: Placement, spec: LaunchSpec, name: str, *, limits: Sequence[HostLimits] | None = None,
             timeout_s: float = 600, echo: bool | Callable[[str], None] = True,
             on_start: Callable[[], None] | None = None, output_dir: Path | None = None) -> ClusterRun:
    """Write the per-node scripts of `spec` and run node i's inside host i, all at once."""
    scripts = write_scripts(spec, SCRIPTS_DIR, name)[:placement.nodes]
    limits = list(limits or [HostLimits()] * placement.nodes)
    use_cgroups = cgroups_supported()[0]
    results: list[RunResult | None] = [None] * placement.nodes
    lines: list[str] = []
    lock = threading.Lock()

    def emitter(i: int):
        def emit(line: str) -> None:
            text = f"[{placement.name(i)}] {line}"
            with lock:
                lines.append(text)
            if callable(echo):
                echo(text)
            elif echo:
                print(text, flush=True)
        return emit

    def node(i: int) -> None:
        inside = limits[i].apply(placement.name(i)) if use_cgroups else []
        cmd = [*placement.prefix(i), *inside, "bash", str(scripts[i])]
        throttle = None
        if limits[i].cpu is not None and (limits[i].cpu_mode == "duty" or (limits[i].cpu_mode == "quota"
                                                                            and not use_cgroups)):
            throttle = _throttle_when_started(scripts[i], limits[i].cpu)
        try:
            results[i] = run(cmd, timeout_s=timeout_s, log_path=SCRIPTS_DIR.parent / "logs" / name / f"node{i}.log",
                             env={"PYTHON": sys.executable, **limits[i].env()}, echo=emitter(i), check=False,
                             cwd=REPO_ROOT)
        finally:
            if throttle:
                throttle.stop()

    start = time.monotonic()
    threads = [threading.Thread(target=node, args=(i,), daemon=True) for i in range(placement.nodes)]
    for t in threads:
        t.start()
    if on_start:
        on_start()
    for t in threads:
        t.join()
    return ClusterRun(name, scripts, results, time.monotonic() - start, output_dir, lines)


def _throttle_when_started(script: Path, cpu: float) -> Throttle:
    """The fallback slowdown (no writable cgroups): once the runner has started the node's script, hold
    its process tree to `cpu` of a core with SIGSTOP/SIGCONT duty cycles (distlab.lan.cgroups)."""
    import psutil  # deferred: only the fallback path looks processes up

    holder = Throttle(-1, cpu)

    def attach() -> None:
        for _ in range(200):
            for p in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if str(script) in p.cmdline():
                        holder.root = p.pid
                        holder.start()
                        return
            time.sleep(0.05)

    threading.Thread(target=attach, daemon=True).start()
    return holder


def run_training(placement: Placement, name: str, overrides: Mapping[str, Any], *, limits=None,
                 rendezvous: str = "static", variants: Mapping[str, Mapping[str, Any]] | None = None,
                 env: Mapping[str, str] | None = None, max_restarts: int = 0, timeout_s: int = 600,
                 runs_dir: Path = RUNS_DIR / "lan", echo=True, on_start=None, config: Path = TINY_CONFIG) -> ClusterRun:
    """distlab.train on every host (or a sweep of `variants` in the same ranks, one launch)."""
    base = training_spec(name, placement.nodes, overrides, config, 0, env, timeout_s, runs_dir, variants=variants)
    spec = cluster_spec(placement, base, rendezvous, max_restarts=max_restarts)
    for run_name in {name, *(variants or {})}:  # stale logs or checkpoints would be resumed or summarised
        shutil.rmtree(Path(runs_dir) / run_name, ignore_errors=True)
    return run_spec(placement, spec, name, limits=limits, timeout_s=timeout_s + 60, echo=echo, on_start=on_start,
                    output_dir=Path(runs_dir) / name)


def run_module(placement: Placement, name: str, module: str, args: Sequence[str], *, limits=None,
               env: Mapping[str, str] | None = None, timeout_s: int = 300, echo=True, rendezvous: str = "static",
               on_start=None) -> ClusterRun:
    """Any worker module (allreduce_bench, fingerprint, calibrate) with one rank per host."""
    spec = module_spec(placement, name, module, args, env=env, timeout_s=timeout_s, rendezvous=rendezvous)
    return run_spec(placement, spec, name, limits=limits, timeout_s=timeout_s + 60, echo=echo, on_start=on_start)


def module_spec(placement: Placement, name: str, module: str, args: Sequence[str], *,
                env: Mapping[str, str] | None = None, timeout_s: int = 300, rendezvous: str = "static") -> LaunchSpec:
    """The cluster launch spec of a worker module, one rank per host (what run_module runs)."""
    base = LaunchSpec(module=module, args=list(args), env={"OMP_NUM_THREADS": "1", **(env or {})},
                      log_dir=str(BUILD_DIR / "lan" / "torchrun" / name), timeout_s=timeout_s, kill_after_s=45,
                      python=sys.executable, description=f"{name}: {module} on the LAN cluster")
    return cluster_spec(placement, base, rendezvous)


def when_step(log: Path, step: int, action: Callable[[], None], timeout_s: float = 300) -> Callable[[], None]:
    """An `on_start` callback: wait until rank 0's step log records `step`, then run `action` (cut a link...)."""
    def wait_then_act() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                for line in Path(log).read_text().splitlines():
                    with contextlib.suppress(ValueError):
                        if '"step"' in line and json.loads(line).get("step", 0) >= step:
                            action()
                            return
            time.sleep(0.2)
    return wait_then_act
