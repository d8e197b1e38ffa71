"""A LaunchSpec written out as commented, executable bash scripts that run torchrun.

    from distlab.launch import LaunchSpec, render_script, write_scripts
    spec = LaunchSpec(args=["--config", "lib/distlab/configs/tiny_lora.yaml", "--set", "strategy=ddp"],
                      nproc_per_node=2, env={"OMP_NUM_THREADS": "1"}, log_dir="logs/tiny")
    write_scripts(spec, "launch", "tiny_ddp")   # -> launch/tiny_ddp.sh

One node gives `<name>.sh`; several give a folder `<name>/` with `node0.sh`, `node1.sh`, ... (the
same spec with each node rank) and a README.md saying which host runs which script.

What every script does, in order: `set -euo pipefail`; optionally cd to the repository root
(`repo_root`, relative to the folder the script is written into); pick the interpreter (the
spec's `python`, or $PYTHON from the caller's environment); export each environment variable
with a comment saying why; create the log folder; then `exec "$PYTHON" -m distlab.launch.watchdog
... -- "$PYTHON" -m torch.distributed.run ...` (torchrun, run through the interpreter so that it and
every rank use the same Python even where no torchrun is on PATH). Every value is quoted by
distlab.launch.shell.quote; the output holds no timestamp and no path of the machine that wrote it,
so it is deterministic. The scripts need bash and the interpreter, nothing GNU-only: they run on
macOS as they do on Linux.

Why every job runs under a hard limit: a distributed job whose peer died waits in its rendezvous or
inside a collective, possibly forever, holding GPU memory on every node. The limit is
distlab.launch.watchdog, GNU `timeout --kill-after`'s contract in Python (coreutils' `timeout` does
not exist on macOS). At `timeout_s` torchrun's process group gets SIGTERM: torchrun forwards it to
its ranks and SIGKILLs those still running after its shutdown timeout (30 s by default). torchrun
starts each rank in a session of its own, so it is torchrun that stops them in order; `kill_after_s`
must therefore outlast that shutdown timeout (LaunchSpec checks it) before the watchdog SIGKILLs
torchrun and any rank still left. The watchdog runs torchrun in a session of its own and passes on
SIGINT, SIGTERM and SIGHUP, so Ctrl-C reaches torchrun even when the script was started from another
script. Exit status 124 means the limit was hit.

`torchrun_flags` is the one place torchrun's command-line flags are built: the scripts here, the
fingerprint command in a multi-node README, the Kubernetes entrypoints (distlab.launch.kubernetes.manifests)
and the jobs distlab.measure launches all use it. A spec's network preset (`network`) is exported
with the rest of its environment, each variable with the preset's reason.
"""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any

from distlab.launch.generated import GENERATED_MARK, write_file
from distlab.launch.shell import literal_note, quote
from distlab.launch.spec import LaunchSpec, check_output_name

# Why a variable is set, for the comment above its export. Others need LaunchSpec.env_notes.
ENV_NOTES = {
    "OMP_NUM_THREADS": "CPU threads per rank: ranks sharing a node's cores must not oversubscribe them",
    "MKL_NUM_THREADS": "MKL threads per rank, for the same reason as OMP_NUM_THREADS",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "with restarts: a restarted group must not read the dead group's "
                                          "gloo/NCCL addresses from torchrun's shared store (pytorch issue 135712)",
    "NCCL_SOCKET_IFNAME": "the network interface NCCL uses between nodes (see `ip -br addr`; same name on every node)",
    "GLOO_SOCKET_IFNAME": "the interface gloo (CPU collectives, barriers) uses between nodes",
    "NCCL_IB_DISABLE": "no InfiniBand on an Ethernet LAN: NCCL goes straight to TCP sockets",
    "NCCL_DEBUG": "NCCL's log level: INFO prints version, interface and transport per peer (check them once)",
    "NCCL_P2P_DISABLE": "no direct GPU-to-GPU copies (for boards where PCIe peer-to-peer is broken)",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "a rank stuck in a failed collective aborts the job instead of hanging",
    "TORCH_DISTRIBUTED_DEBUG": "torch.distributed checks collectives for mismatches across ranks (slower)",
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "seconds torchrun gives its ranks between SIGTERM and SIGKILL when stopping",
    "CUDA_VISIBLE_DEVICES": "the GPUs this node's ranks may use (local rank i takes the i-th)",
    "HIP_VISIBLE_DEVICES": "the AMD GPUs this node's ranks may use (local rank i takes the i-th)",
    "HF_HOME": "the Hugging Face cache: pre-download the model there before the run",
    "HF_HUB_OFFLINE": "never reach the Hub during the run: the model must already be in the cache",
    "TOKENIZERS_PARALLELISM": "the tokenizers' own thread pool competes with the ranks for cores",
    "PYTHONUNBUFFERED": "every line reaches the log at once, so a hang shows where it stopped",
}


HOST_MISMATCH_EXIT = 3  # a node script started on a host other than its node rank's

# ---------------------------------------------------------------------- torchrun's flags

FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def torchrun_flags(nproc_per_node: int, nnodes: int = 1, *, rendezvous: str = "standalone", node_rank: int = 0,
                   master_addr: str | None = None, master_port: int | None = None,
                   rdzv_endpoint: str | None = None, rdzv_id: str = "distlab", max_restarts: int | None = None,
                   log_dir: str | None = None, tee: bool = True, forward_usr1: bool = True) -> list[list[str]]:
    """torchrun's flags, one option and its value per group (a script writes a group per line).

    How the nodes meet: `standalone` (one node, a local store on a free port), `static` (node
    `node_rank` joins node 0 at master_addr:master_port) or `c10d` (nodes join the store at
    rdzv_endpoint under rdzv_id and are numbered as they join: torchrun ignores --node-rank there,
    so it is left out). `max_restarts` and `log_dir` are left out when None (torchrun's defaults: no
    restart, output on the console only). `tee`: `--tee 3` shows every rank's stdout and stderr on
    the console prefixed [defaultN]:, which is how process.run tells which rank failed. `forward_usr1`:
    torchrun passes SIGUSR1 on to the ranks as well as its default four (distlab.preemption)."""
    flags = [["--nnodes", str(nnodes)], ["--nproc-per-node", str(nproc_per_node)]]
    if max_restarts is not None:
        flags.append(["--max-restarts", str(max_restarts)])
    if rendezvous == "standalone":
        flags.append(["--standalone"])
    elif rendezvous == "static":
        if not master_addr or master_port is None:
            raise ValueError("a static rendezvous needs master_addr and master_port of node 0")
        flags += [["--node-rank", str(node_rank)], ["--rdzv-backend", "static"],
                  ["--master-addr", master_addr], ["--master-port", str(master_port)]]
    elif rendezvous == "c10d":
        if not rdzv_endpoint:
            raise ValueError("a c10d rendezvous needs rdzv_endpoint='host:port' of the node that hosts the store")
        flags += [["--rdzv-backend", "c10d"], ["--rdzv-endpoint", rdzv_endpoint], ["--rdzv-id", rdzv_id]]
    else:
        raise ValueError(f"unknown rendezvous {rendezvous!r}; one of standalone, static, c10d")
    # torchrun forwards these to its ranks (the first four are its default); SIGUSR1 is what Slurm's --signal
    # sends ahead of a time limit, and distlab.train checkpoints on it (distlab.preemption) instead of dying.
    if forward_usr1:  # a one-shot check (the fingerprint) has nothing to save: torchrun's defaults do
        flags.append(["--signals-to-handle", FORWARDED_SIGNALS])
    if log_dir is not None:
        flags.append(["--log-dir", log_dir])
    if tee:
        flags.append(["--tee", "3"])
    return flags


def _rendezvous_of(spec: LaunchSpec) -> dict[str, Any]:
    """The spec's fields that say how its nodes meet, as torchrun_flags' keywords."""
    return dict(nnodes=spec.nnodes, rendezvous=spec.rendezvous, node_rank=spec.node_rank,
                master_addr=spec.master_addr, master_port=spec.master_port, rdzv_endpoint=spec.rdzv_endpoint,
                rdzv_id=spec.rdzv_id)


# ---------------------------------------------------------------------- text helpers

def plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}{'es' if word.endswith('s') else 's'}"


def command_text(spec: LaunchSpec) -> str:
    return " ".join([spec.python, "-m", spec.module, *map(quote, spec.args)])


def _node_ranks(spec: LaunchSpec) -> str:
    first = spec.node_rank * spec.nproc_per_node
    last = first + spec.nproc_per_node - 1
    return f"global rank {first}" if first == last else f"global ranks {first}-{last}"


def _placement(spec: LaunchSpec) -> str:
    """One line: which node this is and how the nodes meet."""
    if spec.rendezvous == "standalone":
        return "One node; standalone rendezvous (a local store on a free port)."
    where = f" on {spec.hosts[spec.node_rank]}" if spec.hosts else ""
    if spec.rendezvous == "static":
        role = "the master: it listens on the port" if spec.node_rank == 0 else "connects to the master"
        return (f"Node {spec.node_rank} of {spec.nnodes}{where} ({_node_ranks(spec)}; {role}); "
                f"static rendezvous at {spec.master_addr}:{spec.master_port}.")
    hosts_store = (f"the node at {spec.rendezvous_host} hosts the store")
    return (f"Node script {spec.node_rank} of {spec.nnodes}{where}; c10d rendezvous at {spec.rdzv_endpoint} "
            f"(id {spec.rdzv_id}; {hosts_store}; node ranks are assigned as nodes join).")


# ---------------------------------------------------------------------- the script

def python_lines(spec: LaunchSpec) -> list[str]:
    """The lines that pick the interpreter: the spec's, unless $PYTHON is set."""
    out = ["# The interpreter for torchrun and, through it, every rank. Override: PYTHON=/path/to/python"]
    if quote(spec.python) == spec.python:  # nothing to quote: safe inside "${PYTHON:-...}"
        out += [f'PYTHON="${{PYTHON:-{spec.python}}}"']
    else:
        out += [f"default_python={quote(spec.python)}", 'PYTHON="${PYTHON:-${default_python}}"']
    return out + [""]


def host_check_lines(spec: LaunchSpec) -> list[str]:
    """With a static rendezvous and each node's host known: refuse to start on another host. A node rank
    started twice (a copied script) makes two "node 0"s, each waiting for a node that never joins."""
    if spec.rendezvous != "static" or not spec.hosts or spec.nnodes < 2:
        return []
    # Only the assignment line differs between the nodes' scripts.
    return ["# The host this node rank belongs on. Started elsewhere (a copied script, a node rank given twice)",
            "# torchrun would wait for the missing node until its timeout: refuse at once instead.",
            "# DISTLAB_SKIP_HOST_CHECK=1 skips this (hosts given by a name other than `hostname`).",
            f"node_rank={spec.node_rank} node_host={quote(spec.hosts[spec.node_rank])}",
            'this_host="$(hostname 2>/dev/null || true)"',
            'known_as=" ${this_host} $(hostname -I 2>/dev/null || true) "',
            'if [[ "${DISTLAB_SKIP_HOST_CHECK:-0}" != 1 && "${known_as}" != *" ${node_host} "* ]]; then',
            '  echo "distlab: wrong node rank: node rank ${node_rank} belongs on ${node_host}, but this host is'
            ' ${this_host}; start the node script whose node rank belongs to this host" >&2',
            f"  exit {HOST_MISMATCH_EXIT}",
            "fi",
            ""]


def env_lines(spec: LaunchSpec) -> list[str]:
    """The commented exports of the spec's environment (its network preset's first), or no lines."""
    env = spec.effective_env
    if spec.max_restarts:
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if not env:
        return []
    out = ["# Environment for torchrun and every rank."]
    for name, value in env.items():
        note = spec.env_note(name) or ENV_NOTES.get(name) or "set by the launch spec"
        out += [f"# {name}: {note}", f"export {name}={quote(value)}"]
    return out + [""]


def render_script(spec: LaunchSpec) -> str:
    """The bash script for `spec.node_rank` (for several nodes, it lives in `<name>/nodeN.sh`)."""
    spec.validate()
    title = spec.description or f"{spec.module} under torchrun"
    shape = f"{plural(spec.nnodes, 'node')} x {plural(spec.nproc_per_node, 'process')}, world size {spec.world_size}"
    out = [
        "#!/usr/bin/env bash",
        f"# {title}",
        "#",
        f"# Runs `{command_text(spec)}`",
        f"# under torchrun on {shape}.",
        f"# {_placement(spec)}",
        f"# Hard limit: {spec.timeout_s} s, then SIGTERM; SIGKILL {spec.kill_after_s} s later. "
        "Exit status 124: limit hit.",
        f"# Per-rank logs: {spec.log_dir}/ (a subfolder per run); the console shows every rank, prefixed [defaultN]:.",
        "#",
        f"# {GENERATED_MARK} from a LaunchSpec: change the spec and regenerate, not this file.",
    ]
    if spec.network:
        out.append(f"# Network preset: {spec.network} (lib/distlab/launch/network_presets.yaml).")
    out += literal_note([*spec.args, *spec.effective_env.values(), spec.log_dir, spec.python, spec.repo_root or ""])
    out += ["set -euo pipefail", ""]
    if spec.repo_root is not None:
        rel = posixpath.normpath(spec.repo_root if spec.nnodes == 1 else f"../{spec.repo_root}")
        out += ["# Paths below are relative to the repository root, wherever this script is started from.",
                f'cd -- "$(dirname -- "${{BASH_SOURCE[0]}}")"/{quote(rel)}', ""]
    else:
        out += ["# Paths below are relative to the directory this script is started from.", ""]
    out += host_check_lines(spec)
    out += python_lines(spec)
    out += env_lines(spec)
    out += ["# torchrun writes each rank's stdout and stderr here (--tee 3 also shows them below).",
            f"mkdir -p -- {quote(spec.log_dir)}",
            "",
            "# The hard limit, distlab.launch.watchdog (GNU `timeout`'s contract; macOS has no `timeout`): after",
            f"# {spec.timeout_s} s torchrun's process group gets SIGTERM, which torchrun forwards to the ranks it "
            "started",
            f"# (each in a session of its own); SIGKILL {spec.kill_after_s} s later, after torchrun's own "
            f"{spec.shutdown_timeout_s} s shutdown grace,",
            "# to torchrun and any rank still running. Exit status 124: limit hit. Without a limit, a job whose",
            "# peer died can wait in a rendezvous or a collective forever, holding GPUs on every node. Ctrl-C,",
            "# SIGTERM and SIGHUP reach torchrun through the watchdog, however this script was started.",
            "# exec: nothing runs after.",
            f'exec "$PYTHON" -m distlab.launch.watchdog --timeout-s {spec.timeout_s} '
            f"--kill-after-s {spec.kill_after_s} -- \\",
            '  "$PYTHON" -m torch.distributed.run \\']
    flags = torchrun_flags(spec.nproc_per_node, **_rendezvous_of(spec), max_restarts=spec.max_restarts,
                           log_dir=spec.log_dir)
    for group in flags:
        out.append("  " + " ".join(map(quote, group)) + " \\")
    out.append("  " + " ".join(["-m", quote(spec.module), *map(quote, spec.args)]))
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------- a multi-node folder's README

def _fingerprint_command(spec: LaunchSpec, node_rank: int) -> str:
    """The same rendezvous, one rank per node, running the software fingerprint instead."""
    rendezvous = {**_rendezvous_of(spec), "node_rank": node_rank, "rdzv_id": "distlab-fp"}
    parts = ["python", "-m", "torch.distributed.run"]
    parts += [flag for group in torchrun_flags(1, **rendezvous, tee=False, forward_usr1=False) for flag in group]
    env = spec.effective_env
    if "GLOO_SOCKET_IFNAME" in env:  # the fingerprint talks gloo: pin its interface as the job does
        parts.insert(0, f"GLOO_SOCKET_IFNAME={env['GLOO_SOCKET_IFNAME']}")
    parts += ["-m", "distlab.workers.fingerprint", "--out", "build/runs/envcheck/fingerprint.json"]
    return " ".join(map(quote, parts))


def render_readme(spec: LaunchSpec, name: str) -> str:
    """README.md of a multi-node folder: which host runs which script, in what order, checks first."""
    spec.validate()
    host, port = spec.rendezvous_host, spec.rendezvous_port
    title = spec.description or f"{spec.module} under torchrun"
    lines = [
        f"# {name}: {spec.nnodes} nodes x {plural(spec.nproc_per_node, 'process')} (world size {spec.world_size})",
        "",
        f"{title}. {GENERATED_MARK}: change the spec and regenerate rather than editing these files.",
        "",
        f"Every node runs `{command_text(spec)}` under torchrun, "
        + (f"with a static rendezvous at `{host}:{port}` (node 0 listens there)."
           if spec.rendezvous == "static" else
           f"with a c10d rendezvous at `{spec.rdzv_endpoint}` (id `{spec.rdzv_id}`; the node at `{host}` "
           "hosts the store)."),
        "",
        "| script | run on | node | ranks |",
        "|---|---|---|---|",
    ]
    for r in range(spec.nnodes):
        node = spec.for_node(r)
        if spec.hosts:
            where = f"`{spec.hosts[r]}`"
        elif spec.rendezvous == "static":
            where = f"`{host}`" if r == 0 else f"any other node (not `{host}`)"
        else:
            where = f"`{host}`" if r == 0 else "any other node"
        if spec.rendezvous == "static" and r == 0:
            where += " (the master, listens on " + str(port) + ")"
        elif spec.rendezvous == "c10d" and (spec.hosts[r] == host if spec.hosts else r == 0):
            where += " (hosts the rendezvous store on " + str(port) + ")"
        ranks = (_node_ranks(node) if spec.rendezvous == "static"
                 else f"{plural(spec.nproc_per_node, 'rank')}, numbered at rendezvous")
        lines.append(f"| `node{r}.sh` | {where} | {r} | {ranks} |")
    order = ("Start `node0.sh` on the master first, then the others"
             if spec.rendezvous == "static" else
             f"Start the script on `{host}` first (it hosts the store), then the others")
    lines += [
        "",
        "## Before the first run",
        "",
        "1. The same checkout, at the same commit, and the same Python environment on every node"
        + (" (each script changes to the repository root itself)." if spec.repo_root is not None else
           " (start each script from the directory its relative paths assume)."),
        f"2. `{host}` must be reachable from every node on TCP port {port}: with the job started on "
        f"`{host}`, `nc -zv {host} {port}` from each other node must connect (open the firewall, e.g. "
        f"`sudo ufw allow {port}/tcp`). NCCL and gloo then open further ports between all nodes: allow "
        "the cluster's subnet.",
    ]
    env = spec.effective_env
    ifnames = [n for n in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") if n in env]
    if ifnames:
        values = ", ".join(f"{n}={env[n]}" for n in ifnames)
        lines.append(f"3. The scripts set {values}: that must be the interface carrying the cluster's "
                     "addresses on every node (`ip -br addr`); change the spec and regenerate if it is not.")
    lines += [
        "",
        "Then check that every node reaches the rendezvous and runs the same software stack with the "
        "fingerprint job (one rank per node, gloo over TCP; see `distlab.workers.launcher.run_fingerprint`), "
        "from the repository root, on each node:",
        "",
        "```bash",
    ]
    for r in range(spec.nnodes):
        lines.append(f"# node {r}" + (f" ({spec.hosts[r]})" if spec.hosts else ""))
        lines.append(_fingerprint_command(spec, r))
    lines += [
        "```",
        "",
        "Global rank 0 prints a table of versions per rank and flags every field that must match "
        "but does not (torch, CUDA/ROCm, NCCL, Python, ...); it also writes the table to "
        "`build/runs/envcheck/fingerprint.json` on its node.",
        "",
        "## Run",
        "",
        f"{order}, within the rendezvous timeout (10 minutes by default): every node waits until all "
        f"{spec.nnodes} have joined. Each script stops its node's job after {spec.timeout_s} s at the "
        "latest (exit status 124). If one node fails, the others fail at their next collective or "
        "reach their limit; Ctrl-C on a node stops its ranks.",
        "",
        f"Per-rank logs go to `{spec.log_dir}/` on each node; secrets such as HF_TOKEN come from "
        "your environment (`HF_TOKEN=... ./node0.sh`), never from these files.",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------- files

def render_files(spec: LaunchSpec, name: str) -> dict[str, str]:
    """Relative path -> content of everything write_scripts writes for `spec` under `name`."""
    check_output_name(name)
    spec.validate()
    if spec.nnodes == 1:
        return {f"{name}.sh": render_script(spec)}
    files = {f"{name}/node{r}.sh": render_script(spec.for_node(r)) for r in range(spec.nnodes)}
    files[f"{name}/README.md"] = render_readme(spec, name)
    return files


def write_scripts(spec: LaunchSpec, out_dir: str | Path, name: str) -> list[Path]:
    """Write `<name>.sh` (one node) or `<name>/node0.sh ... README.md` (several); return the paths."""
    out_dir = Path(out_dir)
    return [write_file(out_dir / rel, text, root=out_dir) for rel, text in render_files(spec, name).items()]
