"""What this machine has, read rather than assumed, and the `auto` parameters each chapter derives from it.

A workshop reader runs the chapters on a Linux laptop as a normal user, on macOS, on a 1-core cloud VM, on a
box with one GPU or on a node with several. `describe()` reads what this one has (usable cores, GPUs and their
memory, root or not, the operating system, Slurm, the tools network namespaces need, a C++ compiler);
`auto_parameters()` turns that into the world sizes, devices, dtypes and tolerances a chapter runs with; a
`Sections` log lets a chapter skip what the machine lacks with one printed line and list at its end what ran.

    here = describe()
    auto = auto_parameters(here)         # auto.rank_device, auto.nproc, auto.world_sizes, auto.loss_rtol, ...
    sections = Sections(here)
    if sections.run("5. The emulated LAN", "netns"):   # False, and one line printed, where it cannot run
        ...

`python -m distlab.machine` prints this machine and its parameters; `--examples` the five machines a workshop
brings.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path

from distlab.cli import run_main

# Tolerances by the dtype the compared runs compute in. fp32 on a CPU rounds the same way in every run
# (only the order of a sum differs between strategies); bf16 keeps 8 bits of mantissa, and two GPU kernels
# need not round alike: the looser values are what the GPU profiles set.
TOLERANCES = {
    "fp32": {"loss_rtol": 1e-4, "loss_atol": 1e-5, "check_rtol": 1e-6},
    "bf16-autocast": {"loss_rtol": 0.05, "loss_atol": 0.05, "check_rtol": 1e-3},
}
MAX_CPU_WORLD = 4  # the largest CPU world size in a scaling sweep: each rank costs a core for minutes
MAX_OVERSUBSCRIBED = 8  # ranks of the oversubscription demo, at most: beyond, minutes of waiting teach nothing new


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int


@dataclass(frozen=True)
class Machine:
    """One machine's facts. Tests build their own (a macOS laptop, a GPU node) to check what each gets."""

    system: str  # platform.system(): "Linux", "Darwin", "Windows"
    cores: int  # cores this process may run on (a container or a Slurm allocation can give fewer)
    gpus: tuple[Gpu, ...] = ()
    root: bool = False
    slurm: bool = False  # slurmctld, slurmd, sbatch and munged on PATH (Debian: slurm-wlm, munge)
    network_tools: bool = False  # `ip` and `tc` on PATH (Debian: iproute2)
    compiler: bool = False  # a C++ compiler and Python's headers: DeepSpeed builds its CPU op with them

    @property
    def netns(self) -> bool:
        """Network namespaces with shaped links (chapters 05 and 08): Linux, root and iproute2."""
        return self.system == "Linux" and self.root and self.network_tools

    @property
    def slurm_cluster(self) -> bool:
        """A Slurm cluster started on this machine (chapter 06): the daemons, run as root on Linux."""
        return self.system == "Linux" and self.root and self.slurm

    def missing(self, need: str) -> str | None:
        """Why this machine cannot do `need` and how to get it, in a few words; None when it can.
        Needs: "root", "linux", "netns", "slurm", "compiler", "gpu", "gpus:N", "cores:N"."""
        name, _, count = need.partition(":")
        if name == "cores":
            n = int(count)
            return None if self.cores >= n else f"{n} cores (this machine gives {self.cores})"
        if name == "gpus" or name == "gpu":
            n = int(count or 1)
            return None if len(self.gpus) >= n else f"{n} GPU{'s' if n > 1 else ''} (this machine has {len(self.gpus)})"
        reasons = {
            "linux": (self.system == "Linux", f"Linux (this is {self.system})"),
            "root": (self.root, "root (run the notebook server with sudo, or on a VM you own)"),
            "netns": (self.netns, "network namespaces: Linux, root and iproute2 (`sudo apt install iproute2`)"),
            "slurm": (self.slurm_cluster, "a local Slurm cluster: Linux, root and `sudo apt install slurm-wlm munge`"),
            "compiler": (self.compiler, "a C++ compiler and Python's headers (Debian/Ubuntu: `sudo apt install "
                                        "build-essential python3-dev`; macOS: `xcode-select --install`)"),
        }
        if name not in reasons:
            raise ValueError(f"need {need!r}: expected one of {', '.join([*reasons, 'gpu', 'gpus:N', 'cores:N'])}")
        ok, why = reasons[name]
        return None if ok else why

    def timing_skip(self, ranks: int, rank_device: str = "cpu") -> str | None:
        """Why a timing claim over `ranks` processes cannot hold here (None: it can). Ranks that share a core
        or a GPU wait for each other, so a speed-up or a latency comparison only means something with a
        device of their own for every rank."""
        need = f"gpus:{ranks}" if rank_device == "cuda" else f"cores:{ranks}"
        lacking = self.missing(need)
        return None if lacking is None else f"needs {lacking}: ranks would share"

    def table(self) -> list[tuple[str, str]]:
        """(fact, value) rows for a notebook's opening."""
        kinds = {g: sum(1 for h in self.gpus if h == g) for g in self.gpus}  # a node's GPUs are usually alike
        gpus = ", ".join(f"{n} x {g.name} ({g.memory_bytes / 2**30:.1f} GiB)" for g, n in kinds.items()) or "none"
        return [("system", self.system), ("usable cores", str(self.cores)), ("GPUs", gpus),
                ("root", yes(self.root)), ("network namespaces (root, ip, tc)", yes(self.netns)),
                ("Slurm cluster (root, slurm-wlm, munge)", yes(self.slurm_cluster)),
                ("C++ compiler and Python headers", yes(self.compiler))]


def yes(flag: bool) -> str:
    return "yes" if flag else "no"


def describe() -> Machine:
    """This machine, as a chapter's `auto` parameters see it."""
    # deferred: torch only to list the GPUs; the machine's other facts and the tests' machines need none
    import torch

    gpus = tuple(Gpu(torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory)
                 for i in range(torch.cuda.device_count())) if torch.cuda.is_available() else ()
    return Machine(system=platform.system(), cores=usable_cores(), gpus=gpus,
                   root=hasattr(os, "geteuid") and os.geteuid() == 0,
                   slurm=all(shutil.which(t) for t in ("slurmctld", "slurmd", "sbatch", "munged")),
                   network_tools=all(shutil.which(t) for t in ("ip", "tc")),
                   compiler=has_compiler())


def usable_cores() -> int:
    """Cores this process may run on: the affinity mask where the system has one (Linux), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity masks
        return os.cpu_count() or 1


def has_compiler() -> bool:
    """A C++ compiler on PATH ($CXX first) and Python.h where this interpreter's headers belong."""
    compilers = [os.environ.get("CXX", ""), "c++", "g++", "clang++"]
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return any(c and shutil.which(c.split()[0]) for c in compilers) and headers.is_file()


@dataclass(frozen=True)
class AutoParameters:
    """What `auto` means for each parameter on one machine. A notebook replaces each "auto" value with the
    field of the same meaning; an explicit value (a papermill profile's, or the reader's) always wins."""

    device: str  # the single-device runs (chapter 01): the GPU where there is one
    dtype: str
    rank_device: str  # the ranks of a distributed run: GPUs only where each rank gets its own
    rank_dtype: str
    nproc: int  # ranks of a sharded, pipelined or tensor-parallel run
    world_sizes: list[int]  # the scaling sweep (chapter 02)
    oversubscribe: int  # ranks of the more-ranks-than-cores demo (0: not run, and why in `notes`)
    loss_rtol: float  # two strategies' losses, relative (rank_dtype)
    loss_atol: float  # two strategies' losses, absolute (rank_dtype)
    check_rtol: float  # the hand-written loop against distlab.train (dtype)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def auto_parameters(machine: Machine) -> AutoParameters:
    """The world sizes, devices, dtypes and tolerances a chapter runs with on `machine`."""
    gpus = len(machine.gpus)
    notes = []
    device = "cuda" if gpus else "cpu"
    dtype = "bf16-autocast" if gpus else "fp32"  # on a CPU the loss-equality checks need fp32's rounding
    if gpus >= 2:
        rank_device, nproc = "cuda", min(gpus, 8)
        world_sizes = [k for k in (1, 2, 4, 8) if k <= gpus]
        oversubscribe = 0
        notes.append(f"distributed runs: one rank per GPU, up to {nproc}")
    else:
        # two ranks cannot share one GPU under NCCL: with one GPU (or none) the ranks are CPU processes on gloo
        rank_device, nproc = "cpu", 2
        world_sizes = [k for k in (1, 2, 4) if k <= max(2, min(machine.cores, MAX_CPU_WORLD))]
        if gpus == 1:
            notes.append("one GPU: single-device runs use it; distributed runs use 2 CPU ranks on gloo "
                         "(NCCL gives each rank a GPU of its own)")
        if machine.cores < 2:
            oversubscribe = 0
            notes.append(f"{machine.cores} core: 2 ranks already share it, so timing claims are skipped and "
                         "there is no separate oversubscription demo")
        elif 2 * machine.cores <= MAX_OVERSUBSCRIBED:
            oversubscribe = 2 * machine.cores
        else:
            oversubscribe = 0
            notes.append(f"{machine.cores} cores: the oversubscription demo would need {2 * machine.cores} ranks; "
                         "skipped")
    rank_dtype = "bf16-autocast" if rank_device == "cuda" else "fp32"
    return AutoParameters(device=device, dtype=dtype, rank_device=rank_device, rank_dtype=rank_dtype,
                          nproc=nproc, world_sizes=world_sizes, oversubscribe=oversubscribe,
                          loss_rtol=TOLERANCES[rank_dtype]["loss_rtol"], loss_atol=TOLERANCES[rank_dtype]["loss_atol"],
                          check_rtol=TOLERANCES[dtype]["check_rtol"], notes=notes)


def tolerance(name: str, choice) -> float:
    """TOLERANCES[...][name] for a resolved distlab.device.DeviceChoice: fp32 where it computes in fp32
    throughout, the bf16 values wherever a 16-bit type stores or autocasts. `check_rtol` compares two runs of
    the same arithmetic: on a CPU they round alike in any dtype, so only a GPU (whose kernels need not) gets
    the looser value."""
    if name == "check_rtol" and choice.device.type == "cpu":
        return TOLERANCES["fp32"][name]
    exact = choice.autocast_dtype is None and str(choice.dtype) == "torch.float32"
    return TOLERANCES["fp32" if exact else "bf16-autocast"][name]


def fitting_global_batch(micro_batch_size: int, ranks, at_least: int = 8) -> int:
    """The rows of one optimizer step that every rank count in `ranks` splits evenly into micro-batches (the
    same global batch at every world size, so the runs train alike): `at_least` where that already splits,
    else the smallest multiple of it that does (0 in `ranks`, a run not made, is left out)."""
    rows = at_least
    for k in ranks:
        if k:
            rows = math.lcm(rows, micro_batch_size * k)
    return rows


def pick(value, auto_value):
    """A parameter's value: the automatic one where the notebook's parameter says "auto"."""
    return auto_value if isinstance(value, str) and value == "auto" else value


class Sections:
    """Which sections of a chapter ran on this machine, and why the others did not.

    `run(title, *needs)` is True when the machine has every need; otherwise it prints one line (the section,
    what is missing, how to get it) and returns False, and the chapter goes on. `claim(claim, *why_nots)` does
    the same for one assertion inside a section that ran (a timing claim without a core per rank, a claim about
    link rates on unshaped links). `table()` lists them all."""

    def __init__(self, machine: Machine):
        self.machine = machine
        self.rows: list[tuple[str, str]] = []

    def run(self, title: str, *needs: str) -> bool:
        lacking = [why for why in map(self.machine.missing, needs) if why]
        if lacking:
            self.skip(title, "needs " + "; ".join(lacking))
            return False
        self.rows.append((title, "ran"))
        return True

    def skip(self, title: str, reason: str) -> None:
        print(f"skipped: {title}: {reason}")
        self.rows.append((title, f"skipped: {reason}"))

    def claim(self, claim: str, *why_nots: str | None) -> bool:
        """True when no reason stops `claim` from being checked here (each of `why_nots` is None, e.g.
        `machine.timing_skip(ranks)`); else ONE printed line with the first reason, a row, and False."""
        why = next((w for w in why_nots if w), None)
        if why is None:
            return True
        print(f"not checked: {claim}: {why}")
        self.rows.append((claim, f"not checked: {why}"))
        return False

    def table(self) -> list[tuple[str, str]]:
        return list(self.rows)


def example_machines() -> dict[str, Machine]:
    """The machines a workshop brings, and the one the book is built on."""
    return {
        "Linux laptop, 4 cores, normal user": Machine("Linux", 4, compiler=True),
        "Linux laptop, 8 cores, normal user": Machine("Linux", 8, compiler=True),
        "macOS laptop, 10 cores": Machine("Darwin", 10, compiler=True),
        "cloud VM, 1 core": Machine("Linux", 1),
        "one GPU (24 GiB), 16 cores": Machine("Linux", 16, (Gpu("NVIDIA L4", 24 * 2**30),), compiler=True),
        "GPU node, 8 x 80 GiB, 64 cores": Machine("Linux", 64, tuple(Gpu("NVIDIA H100", 80 * 2**30)
                                                                     for _ in range(8)), compiler=True),
        "the book's build VM, 2 cores, root": Machine("Linux", 2, root=True, slurm=True, network_tools=True,
                                                      compiler=True),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab.machine", description=__doc__.splitlines()[0])
    parser.add_argument("--examples", action="store_true", help="the auto parameters of the machines a workshop brings")
    args = parser.parse_args(argv)
    machines = example_machines() if args.examples else {"this machine": describe()}
    keys = ["device", "dtype", "rank_device", "rank_dtype", "nproc", "world_sizes", "oversubscribe",
            "loss_rtol", "loss_atol", "check_rtol"]
    for name, m in machines.items():
        auto = auto_parameters(m)
        print(f"{name}: " + ", ".join(f"{k}={v}" for k, v in m.table()))
        print("  auto: " + ", ".join(f"{k}={getattr(auto, k)}" for k in keys))
        for note in auto.notes:
            print(f"  note: {note}")
    return 0


if __name__ == "__main__":
    run_main(main)
