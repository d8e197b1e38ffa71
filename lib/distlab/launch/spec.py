"""The launch spec: what to run under torchrun, on how many nodes and processes, with which
rendezvous and environment, checked field by field before anything is written.

A LaunchSpec is the one description every launch target is written from (torchrun.py writes bash
scripts that run torchrun; other writers can sit beside it). An invalid spec raises
LaunchSpecError naming the field, at construction and again before writing.

Secrets never go into a spec (its scripts are committed and copied between machines): the rule for
names and values, and the character and length rules every string follows, are distlab.launch.shell's,
shared by every writer. Pass secrets through the caller's environment, which the script inherits:
`HF_TOKEN=... launch/run_4gpu.sh`, or log in once per node (`huggingface-cli login`).

`network` names a network preset (distlab.launch.network: lan-ethernet, cloud-no-rdma,
rdma-infiniband): its NCCL and gloo variables are exported before the spec's own `env`, which wins
for a variable both set (`effective_env`), each with the preset's reason as its comment.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Sequence

from distlab.config import PIPELINE_STRATEGIES, STRATEGY_NAMES
from distlab.launch.network import NetworkPresetError, get_preset
from distlab.launch.shell import NAME_RE, SpecError, check_env, check_fields, check_module, check_text, show

RENDEZVOUS = ("standalone", "static", "c10d")
TP_STRATEGIES = ("tp", "fsdp_tp")  # the strategies that take a tensor-parallel size
TORCHRUN_SHUTDOWN_S = 30  # torchrun's default --shutdown-timeout (TORCH_ELASTIC_SHUTDOWN_TIMEOUT)

_HOST_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9_.-]*)$")  # name, IPv4, [IPv6]

# torchrun sets these for every rank, and the script sets PYTHON itself: a spec must not.
RESERVED_ENV = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "PYTHON", "PYTHON_EXEC",
}


class LaunchSpecError(SpecError):
    """An invalid LaunchSpec; `.field` names the offending field."""

    spec = "LaunchSpec"


@dataclass
class LaunchSpec:
    """What to run under torchrun, where, and how: one node's view of a job (`node_rank`)."""

    module: str = "distlab.train"  # run as `python -m module args...` on every rank
    args: list[str] = field(default_factory=list)
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0  # write_scripts() writes one script per node rank
    rendezvous: str = "standalone"  # standalone (one node) | static (master_addr:port) | c10d
    master_addr: str | None = None  # static: node 0's address, reachable from every node
    master_port: int = 29500  # static: the port node 0 listens on
    rdzv_endpoint: str | None = None  # c10d: "host:port" of the node that hosts the rendezvous store
    rdzv_id: str = "distlab"  # c10d: the job's id, the same on every node
    max_restarts: int = 0  # torchrun restarts the whole worker group up to this many times
    env: dict[str, str] = field(default_factory=dict)  # exported for torchrun and every rank
    env_notes: dict[str, str] = field(default_factory=dict)  # why, for names not in torchrun.ENV_NOTES
    log_dir: str = "logs/torchrun"  # torchrun --log-dir: one subfolder per run, a file per rank
    timeout_s: int = 3600  # hard limit on the whole job (see torchrun.py's docstring)
    kill_after_s: int = 60  # then SIGKILL this long after the SIGTERM
    strategy: str | None = None  # for validation; None: read `--set strategy=X` from args if any
    pipeline_stages: int | None = None  # pipeline only: the world splits into data-parallel groups of it
    tp_size: int | None = None  # fsdp_tp: ranks per tensor-parallel group (default 2); tp: all ranks
    sequence_parallel: bool = False  # tp / fsdp_tp: activations between blocks cut along the sequence
    global_batch_size: int | None = None  # with micro_batch_size: must divide by micro x data-parallel size
    micro_batch_size: int | None = None
    python: str = "python"  # the interpreter; $PYTHON in the caller's environment overrides it
    description: str = ""  # one line for the header, e.g. "tiny LoRA with DDP on 2 CPU ranks"
    repo_root: str | None = None  # the repo root relative to write_scripts' out_dir; None: no cd
    hosts: list[str] = field(default_factory=list)  # optional: the host of each node rank, for README
    network: str | None = None  # a network preset's name (distlab.launch.network); env overrides its values

    def __post_init__(self) -> None:
        self.args = list(self.args)
        self.env = dict(self.env)
        self.env_notes = dict(self.env_notes)
        self.hosts = list(self.hosts)
        self.validate()

    # ------------------------------------------------------------------ derived values
    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def data_parallel_size(self) -> int:
        if self.effective_strategy in PIPELINE_STRATEGIES and self.pipeline_stages:
            return self.world_size // self.pipeline_stages
        if self.effective_strategy == "tp":
            return 1  # tensor parallelism: every rank sees every row
        if self.effective_strategy == "fsdp_tp":
            return self.world_size // (self.tp_size or 2)  # the ranks of one tp group see the same rows
        return self.world_size

    @property
    def effective_strategy(self) -> str | None:
        return self.strategy or strategy_in_args(self.args)

    @property
    def rendezvous_host(self) -> str | None:
        if self.rendezvous == "static":
            return self.master_addr
        if self.rendezvous == "c10d" and self.rdzv_endpoint:
            return self.rdzv_endpoint.rpartition(":")[0]
        return None

    @property
    def rendezvous_port(self) -> int | None:
        if self.rendezvous == "static":
            return self.master_port
        if self.rendezvous == "c10d" and self.rdzv_endpoint:
            return int(self.rdzv_endpoint.rpartition(":")[2])
        return None

    @property
    def shutdown_timeout_s(self) -> int:
        """Seconds torchrun gives its ranks between SIGTERM and SIGKILL when it stops them."""
        return int(self.env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", TORCHRUN_SHUTDOWN_S))

    @property
    def effective_env(self) -> dict[str, str]:
        """What the scripts export: the network preset's variables (if any), then `env` over them."""
        preset = get_preset(self.network).env if self.network is not None else {}
        return {**preset, **self.env}

    def env_note(self, name: str) -> str | None:
        """Why `name` is set: the spec's own note, else the network preset's reason (None: neither)."""
        if name in self.env_notes:
            return self.env_notes[name]
        if self.network is not None:
            return get_preset(self.network).reasons.get(name)
        return None

    def for_node(self, node_rank: int) -> LaunchSpec:
        return dataclasses.replace(self, node_rank=node_rank)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        # Every string first (control characters, length, secrets): the checks below may quote a value.
        check_fields(LaunchSpecError, self)
        check_module(LaunchSpecError, "module", self.module)
        for i, a in enumerate(self.args):
            if not isinstance(a, str):
                raise LaunchSpecError("args", f"args[{i}] = {show(a)} is not a string")
        for name in ("nproc_per_node", "nnodes", "timeout_s", "kill_after_s"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("node_rank", self.node_rank, minimum=0)
        if self.node_rank >= self.nnodes:
            raise LaunchSpecError("node_rank", f"{self.node_rank} is not below nnodes={self.nnodes} "
                                               f"(node ranks run 0..{self.nnodes - 1})")
        _check_int("max_restarts", self.max_restarts, minimum=0)
        self._validate_rendezvous()
        if self.network is not None:
            try:
                get_preset(self.network)
            except NetworkPresetError as e:
                raise LaunchSpecError("network", str(e)) from None
        self._validate_env()
        shutdown = self.env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(TORCHRUN_SHUTDOWN_S))
        if not shutdown.isdigit():
            raise LaunchSpecError("env", f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={shutdown!r} is not a whole number "
                                         "of seconds")
        if self.kill_after_s <= int(shutdown):
            raise LaunchSpecError("kill_after_s", f"{self.kill_after_s} s must outlast torchrun's shutdown timeout "
                                                  f"({shutdown} s), or a SIGKILLed torchrun orphans its ranks")
        check_text(LaunchSpecError, "log_dir", self.log_dir)
        check_text(LaunchSpecError, "python", self.python)
        check_text(LaunchSpecError, "description", self.description, allow_empty=True)
        if self.repo_root is not None:
            check_text(LaunchSpecError, "repo_root", self.repo_root)
            if self.repo_root.startswith("/"):
                raise LaunchSpecError("repo_root", "must be relative to the scripts' folder, not absolute")
        self._validate_strategy()

    def _validate_rendezvous(self) -> None:
        if self.rendezvous not in RENDEZVOUS:
            raise LaunchSpecError("rendezvous", f"unknown rendezvous {self.rendezvous!r}; "
                                                f"one of {', '.join(RENDEZVOUS)}")
        if self.rendezvous == "standalone":
            if self.nnodes > 1:
                raise LaunchSpecError("nnodes", f"standalone rendezvous runs on one node, not {self.nnodes}; "
                                                "use rendezvous='static' or 'c10d' with a reachable host")
            if self.master_addr is not None or self.rdzv_endpoint is not None:
                raise LaunchSpecError("rendezvous", "standalone picks a local port itself; master_addr and "
                                                    "rdzv_endpoint belong to 'static' and 'c10d'")
        elif self.rendezvous == "static":
            if self.rdzv_endpoint is not None:
                raise LaunchSpecError("rdzv_endpoint", "static rendezvous uses master_addr and master_port")
            _check_host("master_addr", self.master_addr)
            _check_port("master_port", self.master_port)
            if self.max_restarts and self.nnodes > 1:
                raise LaunchSpecError("max_restarts", "a static rendezvous cannot re-form the group across "
                                                      "nodes after a failure; use rendezvous='c10d' to restart")
        else:  # c10d
            if self.master_addr is not None:
                raise LaunchSpecError("master_addr", "c10d rendezvous uses rdzv_endpoint='host:port'")
            if not isinstance(self.rdzv_endpoint, str) or ":" not in self.rdzv_endpoint:
                raise LaunchSpecError("rdzv_endpoint", f"c10d needs 'host:port' of the rendezvous host, got "
                                                       f"{self.rdzv_endpoint!r}")
            host, _, port = self.rdzv_endpoint.rpartition(":")
            _check_host("rdzv_endpoint", host)
            if not port.isdigit():
                raise LaunchSpecError("rdzv_endpoint", f"port {port!r} in {self.rdzv_endpoint!r} is not a number")
            _check_port("rdzv_endpoint", int(port))
            if not isinstance(self.rdzv_id, str) or not NAME_RE.match(self.rdzv_id):
                raise LaunchSpecError("rdzv_id", f"{self.rdzv_id!r}: use letters, digits, '_', '.', '-'")
        if self.hosts:
            if len(self.hosts) != self.nnodes:
                raise LaunchSpecError("hosts", f"{len(self.hosts)} hosts for nnodes={self.nnodes}")
            for h in self.hosts:
                _check_host("hosts", h)
            if self.rendezvous == "static" and self.hosts[0] != self.master_addr:
                raise LaunchSpecError("hosts", f"node 0 runs the static rendezvous, so hosts[0] must be "
                                               f"master_addr {self.master_addr!r}, not {self.hosts[0]!r}")
            if self.rendezvous == "c10d" and self.rendezvous_host not in self.hosts:
                raise LaunchSpecError("hosts", f"the rendezvous host {self.rendezvous_host!r} is none of the nodes")

    def _validate_env(self) -> None:
        check_env(LaunchSpecError, "env", self.effective_env, RESERVED_ENV,
                  "is set by torchrun or by the script itself (the interpreter is LaunchSpec.python)")
        for name, note in self.env_notes.items():
            if name not in self.env:
                raise LaunchSpecError("env_notes", f"{name} is not in env")
            check_text(LaunchSpecError, "env_notes", note, what=name)

    def _validate_strategy(self) -> None:
        in_args = strategy_in_args(self.args)
        known = ", ".join(STRATEGY_NAMES)
        if self.strategy is not None and self.strategy not in STRATEGY_NAMES:
            raise LaunchSpecError("strategy", f"unknown strategy {self.strategy!r}; one of {known}")
        if in_args is not None and in_args not in STRATEGY_NAMES:
            raise LaunchSpecError("args", f"--set strategy={in_args}: unknown; one of {known}")
        if self.strategy is not None and in_args is not None and in_args != self.strategy:
            raise LaunchSpecError("strategy", f"{self.strategy!r} but args say --set strategy={in_args}")
        strategy, world = self.effective_strategy, self.world_size
        if strategy == "single" and world != 1:
            raise LaunchSpecError("strategy", f"'single' runs one process, but the world size is {world} "
                                              f"({self.nnodes} node(s) x {self.nproc_per_node})")
        if strategy in PIPELINE_STRATEGIES:
            if self.pipeline_stages is None:
                raise LaunchSpecError("pipeline_stages", "the pipeline strategy needs the number of stages")
            _check_int("pipeline_stages", self.pipeline_stages, minimum=2)
            if world % self.pipeline_stages:
                raise LaunchSpecError("pipeline_stages", f"world size {world} is not divisible into "
                                                         f"{self.pipeline_stages} stages")
        elif self.pipeline_stages is not None:
            raise LaunchSpecError("pipeline_stages", f"only for the pipeline strategies, not {strategy!r}")
        check_tp_size(LaunchSpecError, self.tp_size, strategy, world)
        if self.sequence_parallel and strategy not in TP_STRATEGIES:
            raise LaunchSpecError("sequence_parallel", f"only for the tensor-parallel strategies, not {strategy!r}")
        if self.micro_batch_size is not None:
            _check_int("micro_batch_size", self.micro_batch_size, minimum=1)
        if self.global_batch_size is not None:
            _check_int("global_batch_size", self.global_batch_size, minimum=1)
            if self.micro_batch_size is None:
                raise LaunchSpecError("micro_batch_size", "needed to check global_batch_size")
            per_step = self.micro_batch_size * self.data_parallel_size
            if self.global_batch_size % per_step:
                raise LaunchSpecError("global_batch_size",
                                      f"{self.global_batch_size} is not divisible by micro_batch_size x "
                                      f"data-parallel size = {self.micro_batch_size} x {self.data_parallel_size}")


def check_tp_size(error: type[SpecError], tp_size, strategy: str | None, world: int) -> None:
    """The tensor-parallel size against the strategy and the world size, one rule for every writer (torchrun
    here, Slurm in sbatch.py): `tp` splits over all ranks; `fsdp_tp` needs at least two tp groups (default
    size 2); no other strategy takes one."""
    if tp_size is not None:
        if isinstance(tp_size, bool) or not isinstance(tp_size, int):
            raise error("tp_size", f"{show(tp_size)} is not an integer")
        if tp_size < 1:
            raise error("tp_size", f"{tp_size} is below 1")
        if strategy == "tp" and tp_size != world:
            raise error("tp_size", f"'tp' splits over all {world} ranks; {tp_size} needs fsdp_tp")
        if strategy not in TP_STRATEGIES:
            raise error("tp_size", f"only for the tensor-parallel strategies, not {strategy!r}")
    if strategy == "fsdp_tp" and (world % (tp_size or 2) or world == (tp_size or 2)):
        raise error("tp_size", f"fsdp_tp needs the world size ({world}) a multiple of the tp size "
                               f"({tp_size or 2}) with at least two tp groups")


def strategy_in_args(args: Sequence[str]) -> str | None:
    """The last `--set strategy=X` of a distlab.train command line (as distlab.train reads it), or None."""
    return setting_in_args(args, "strategy")


def check_output_name(name) -> None:
    """A name written files are called after (`<name>.sh`, `<name>/`): one plain path component."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise LaunchSpecError("name", f"{show(name)}: use letters, digits, '_', '.', '-' (no folders)")


def setting_in_args(args: Sequence[str], key: str) -> str | None:
    """The last `--set <key>=X` of a distlab.train command line (as distlab.train reads it), or None."""
    found = None
    for prev, cur in zip(["", *args], args):
        text = cur[len("--set="):] if cur.startswith("--set=") else (cur if prev == "--set" else None)
        if text is not None and text.split("=", 1)[0].strip() == key and "=" in text:
            found = text.split("=", 1)[1].strip()
    return found


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LaunchSpecError(name, f"{value!r} is not an integer")
    if value < minimum:
        raise LaunchSpecError(name, f"{value} is below {minimum}")


def _check_host(name: str, host) -> None:
    if not isinstance(host, str) or not host.strip():
        raise LaunchSpecError(name, f"needs a host name or address, got {host!r}")
    if not _HOST_RE.match(host):
        raise LaunchSpecError(name, f"{host!r} is not a host name or address")


def _check_port(name: str, port) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 1024 <= port <= 65535:
        raise LaunchSpecError(name, f"port {port!r} is outside 1024-65535")
