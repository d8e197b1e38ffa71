"""DeepSpeed's start-up and configs, shared by the ZeRO strategies and the DeepSpeed pipeline.

First use: DeepSpeed JIT-compiles a small C++ shared-memory communication op when its comm backend
starts on a Linux CPU (about a minute on two cores). The build is cached in TORCH_EXTENSIONS_DIR, which
this module points at a persistent folder of this machine and environment (`extensions_dir()`) unless
already set, and rank 0 says so before it starts when the cache is cold. `make deepspeed-op` (`python -m
distlab.strategies.deepspeed_runtime`, `prebuild_comm_op()`) builds it ahead of time; `make test` and
`make book` do, so CI pays for it once per environment.

Before DeepSpeed starts, a run checks what the build needs (`preflight`): a C++ compiler, Python's headers
and ninja when the cache is cold, and no build lock left by a killed build (torch would wait for it
forever, even with the op cached). What is missing ends the run with one line (`DeepSpeedOpError`) instead
of a compiler traceback or a silent hang; `deepspeed_unavailable_reason()` gives a chapter the same line
so that it can skip its DeepSpeed section.

Configs are derived from the run's TrainConfig, never written by hand: train_batch_size is always
micro-batch x accumulation x data-parallel size, so it agrees with what the loop feeds.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import logging
import os
import shlex
import shutil
import sys
import sysconfig
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from distlab.cli import run_main
from distlab.config import ZERO3_PERSISTENCE_THRESHOLD, zero_bucket_elements

SHM_OP = "deepspeed_shm_comm"
# torch's JIT build holds SHM_OP/lock while it compiles (about a minute here) and every other builder waits
# for it to vanish, forever. A build killed midway leaves the lock behind; one older than this is stale.
STALE_LOCK_S = 600
# torch's FileBaton closes its descriptor a moment before it deletes the lock: a lock that nobody holds is
# looked at again after this long before it is judged left behind.
LOCK_SETTLE_S = 1.0
# What torch's build runs when $CXX is unset is `c++`; g++ and clang++ stand in where only they exist.
COMPILERS = ("c++", "g++", "clang++")


class DeepSpeedOpError(ValueError):
    """DeepSpeed's comm op cannot be built or loaded here; the message is one line saying what to do. A
    ValueError, so `python -m distlab.*` commands end with that line (distlab.cli), not a traceback."""


# ----------------------------------------------------------------------------- the JIT op cache

def extensions_dir() -> Path:
    """Where torch caches JIT-built C++ extensions for distlab: $TORCH_EXTENSIONS_DIR if set, else
    $DISTLAB_TORCH_EXTENSIONS_DIR, else ~/.cache/distlab/torch_extensions/<python-torch-deepspeed-env>.
    A build is only valid for the versions it was compiled against and for the environment it was
    compiled in: its build.ninja names the environment's torch and DeepSpeed sources, and torch compiles
    again whenever another environment's paths stand there (which fails where no compiler is), so two
    clones or venvs on one machine keep builds of their own."""
    for var in ("TORCH_EXTENSIONS_DIR", "DISTLAB_TORCH_EXTENSIONS_DIR"):
        if os.environ.get(var):
            return Path(os.environ[var])
    try:
        ds = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        ds = "none"
    env = hashlib.sha256(str(Path(sys.prefix).resolve()).encode()).hexdigest()[:8]
    tag = (f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__.split('+')[0]}"
           f"-deepspeed{ds}-env{env}")
    return Path.home() / ".cache" / "distlab" / "torch_extensions" / tag


def use_extensions_cache() -> Path:
    """Point torch's extension builds at the persistent cache (before DeepSpeed builds anything)."""
    path = extensions_dir()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(path)
    return path


def comm_op_cached(path: Path | None = None) -> bool:
    path = path or extensions_dir()
    return (path / SHM_OP / f"{SHM_OP}.so").exists()


def build_lock(path: Path | None = None) -> Path:
    """The lock torch's JIT build of the comm op holds (torch.utils.file_baton.FileBaton)."""
    return (path or extensions_dir()) / SHM_OP / "lock"


def lock_holders(lock: Path) -> list[int] | None:
    """The processes of this machine that hold `lock` open; None where /proc cannot tell (not Linux).

    torch's FileBaton creates the lock with O_CREAT | O_EXCL and keeps that descriptor open until the build
    ends; the kernel closes it when the builder dies, SIGKILL included. So a lock that no process holds was
    left by a dead build, unless a build on another machine sharing the folder made it. Other users'
    processes cannot be read, and need not be: the cache lives under this user's home."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    try:
        target = lock.stat()
    except FileNotFoundError:
        return []
    holders = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:  # gone meanwhile, or another user's
            continue
        for fd in fds:
            try:
                if not os.readlink(fd).endswith("/lock"):  # a cheap look first: most descriptors are not it
                    continue
                found = fd.stat()
            except OSError:
                continue
            if (found.st_dev, found.st_ino) == (target.st_dev, target.st_ino):
                holders.append(int(entry.name))
                break
    return holders


def _remove_if_same(lock: Path, judged: os.stat_result) -> bool:
    """Unlink `lock` only if it is still the file that was judged stale: a build may have started meanwhile
    and made a new lock of its own at the same path (a new inode), and that one must stay."""
    try:
        now = lock.stat()
    except FileNotFoundError:
        return False
    if (now.st_ino, now.st_mtime_ns) != (judged.st_ino, judged.st_mtime_ns):
        return False
    lock.unlink(missing_ok=True)
    return True


def remove_stale_build_lock(path: Path | None = None, max_age_s: float = STALE_LOCK_S) -> Path | None:
    """Remove the comm op's build lock when it is older than any real build and no process of this machine
    holds it (a killed build left it, and every later build would wait for it forever); return the removed
    lock, else None."""
    lock = build_lock(path)
    try:
        judged = lock.stat()
    except FileNotFoundError:
        return None
    age = time.time() - judged.st_mtime
    if age < max_age_s or lock_holders(lock):  # a build may hold it right now, even a slow one
        return None
    if not _remove_if_same(lock, judged):
        return None
    print(f"removed a stale build lock {lock} ({age / 60:.0f} min old: a killed build left it)", flush=True)
    return lock


def lock_problem(path: Path | None = None, *, announce: bool = True, settle_s: float = LOCK_SETTLE_S,
                 max_age_s: float = STALE_LOCK_S) -> str | None:
    """Would torch wait forever on the comm op's build lock? The one line that says so, else None.

    A lock held by a live process here is a real build: it is left alone and the run waits for it (said
    once when `announce`). A lock nobody here holds is looked at again after `settle_s` (a finishing build
    closes it just before deleting it); still there and older than any real build, it is removed, as
    `make deepspeed-op` does; younger, the caller gets the line naming it and how to clear it, within
    seconds, instead of a wait without end. Where /proc cannot tell (not Linux), only the age decides."""
    lock = build_lock(path)
    if not lock.exists():
        return None
    holders = lock_holders(lock)
    if holders is None:
        remove_stale_build_lock(path, max_age_s)
        return None
    if holders:
        if announce:
            print(f"[distlab] waiting for DeepSpeed's op build in process {holders[0]} (it holds {lock})",
                  flush=True)
        return None
    time.sleep(settle_s)
    try:
        judged = lock.stat()
    except FileNotFoundError:
        return None  # the build finished
    if lock_holders(lock):
        return None  # a new build took it meanwhile
    if time.time() - judged.st_mtime >= max_age_s:
        remove_stale_build_lock(path, max_age_s)
        return None
    return (f"{lock} is held by no process on this machine: a DeepSpeed op build killed midway left it, and "
            f"every run would wait for it forever; remove it (rm {lock}) and run again, unless another machine "
            f"that shares this folder is building the op right now")


# ----------------------------------------------------------------------------- what the build needs

def _find_compiler() -> str | None:
    """The C++ compiler torch's build would run: $CXX (its first word: `ccache g++` runs ccache) when set,
    else the first of COMPILERS on PATH; None when there is none."""
    cxx = os.environ.get("CXX", "").strip()
    if cxx:
        try:
            first = shlex.split(cxx)[0]
        except ValueError:  # unbalanced quotes: the shell ninja runs it with would fail on it too
            return None
        return shutil.which(first)
    return next(filter(None, map(shutil.which, COMPILERS)), None)


def _find_ninja() -> str | None:
    """ninja on PATH, or beside this interpreter (the venv's bin, where the lock's `ninja` wheel puts it, is
    not on PATH when nobody activated the venv: `.venv/bin/python -m ...`, make)."""
    here = Path(sys.executable).parent / "ninja"
    return shutil.which("ninja") or (str(here) if os.access(here, os.X_OK) else None)


def python_include_dir() -> Path:
    """Where the build looks for Python.h: the scheme torch's cpp_extension reads (posix_prefix)."""
    scheme = "nt" if os.name == "nt" else "posix_prefix"
    return Path(sysconfig.get_path("include", scheme=scheme))


def _os_family(os_release: Path) -> str:
    """"debian", "fedora" or "" from /etc/os-release's ID and ID_LIKE (Ubuntu is ID_LIKE=debian)."""
    try:
        fields = dict(line.split("=", 1) for line in os_release.read_text().splitlines() if "=" in line)
    except OSError:
        return ""
    ids = " ".join(fields.get(k, "").strip('"') for k in ("ID", "ID_LIKE")).split()
    if {"debian", "ubuntu"} & set(ids):
        return "debian"
    if {"fedora", "rhel", "centos"} & set(ids):
        return "fedora"
    return ""


def _install_hint(compiler: bool, headers: bool, include: Path, os_release: Path) -> str:
    """What to install for the missing compiler and/or headers, on this system (all three where unknown)."""
    if sys.platform == "darwin":
        return "install Apple's command line tools: xcode-select --install"
    if headers and not str(include).startswith("/usr/"):
        # Only the system's own Python gets its headers from python3-dev; any other ships them itself.
        own = f"reinstall the Python at {sys.base_prefix} with its headers (include/)"
        if not compiler:
            return own
        headers, tail = False, f"; and {own}"
    else:
        tail = ""
    debian = " ".join(["build-essential"] * compiler + ["python3-dev"] * headers)
    fedora = " ".join(["gcc-c++"] * compiler + ["python3-devel"] * headers)
    family = _os_family(os_release)
    if family == "debian":
        return f"to install: sudo apt-get install {debian}{tail}"
    if family == "fedora":
        return f"to install: sudo dnf install {fedora}{tail}"
    return (f"to install (Debian/Ubuntu: sudo apt-get install {debian}; Fedora: sudo dnf install {fedora}; "
            f"macOS: xcode-select --install){tail}")


def toolchain_problem(*, include: Path | None = None, os_release: Path = Path("/etc/os-release")) -> str | None:
    """What stops torch from compiling DeepSpeed's comm op here (a C++ compiler, Python.h, ninja), as one
    line naming what is missing and what to install; None when nothing does."""
    include = include or python_include_dir()
    missing = []
    cxx = os.environ.get("CXX", "").strip()
    no_compiler = _find_compiler() is None
    if no_compiler:
        missing.append(f"no C++ compiler $CXX ({cxx!r})" if cxx else "no C++ compiler (c++, g++ or clang++)")
    no_headers = not (include / "Python.h").is_file()
    if no_headers:
        missing.append(f"no Python.h in {include}")
    steps = []
    if no_compiler or no_headers:
        steps.append(_install_hint(no_compiler, no_headers, include, os_release))
    if _find_ninja() is None:
        missing.append("no ninja")
        steps.append("pip install ninja (make env installs it)")
    if not missing:
        return None
    return f"DeepSpeed's communication op cannot be compiled here: {', '.join(missing)}; {'; '.join(steps)}"


def _use_toolchain() -> None:
    """Make torch's build find what _find_compiler and _find_ninja found: torch runs `ninja` from PATH and
    `c++` unless $CXX names another compiler."""
    ninja = _find_ninja()
    if ninja and not shutil.which("ninja"):
        os.environ["PATH"] = os.pathsep.join([str(Path(ninja).parent), os.environ.get("PATH", "")])
    if not os.environ.get("CXX", "").strip() and not shutil.which("c++"):
        compiler = _find_compiler()
        if compiler:
            os.environ["CXX"] = compiler


def _problem(path: Path, *, cold: bool, announce: bool) -> str | None:
    """The one line that stops DeepSpeed's comm op from loading here, else None. A cold cache needs the
    whole toolchain; a warm one still runs ninja (torch re-checks the build at every load) and takes the
    build lock."""
    if cold:
        problem = toolchain_problem()
    else:
        problem = None if _find_ninja() else "DeepSpeed's communication op cannot load: no ninja; pip install ninja"
    return problem or lock_problem(path, announce=announce)


def preflight(path: Path, *, cold: bool, announce: bool = True) -> None:
    """Before DeepSpeed builds or loads its comm op: raise DeepSpeedOpError with one line when it cannot
    (no compiler, no Python.h, no ninja, a lock left by a killed build), instead of a 50-line compiler
    traceback or a wait without end; otherwise point torch's build at the tools found."""
    problem = _problem(path, cold=cold, announce=announce)
    if problem:
        raise DeepSpeedOpError(problem)
    _use_toolchain()


def comm_op_needed() -> bool:
    """Does DeepSpeed build its shared-memory comm op here (CPU accelerator on Linux)?"""
    from deepspeed.accelerator import get_accelerator  # deferred: DeepSpeed is optional, and its import is slow

    return get_accelerator().device_name() == "cpu" and sys.platform == "linux"


def deepspeed_unavailable_reason() -> str | None:
    """Why a DeepSpeed run (zero2, zero3, ds_pipeline) cannot start on this machine, as the one line a
    chapter prints when it skips its DeepSpeed section; None when it can run.

        if (reason := deepspeed_unavailable_reason()):
            print(f"DeepSpeed's runs are skipped: {reason}")

    A missing DeepSpeed, or what its comm op needs and this machine lacks (see preflight). A lock left by
    a killed build older than any real build is removed on the way, as a run would."""
    if importlib.util.find_spec("deepspeed") is None:
        return "DeepSpeed is not installed in this environment; make env installs it (requirements.lock)"
    try:
        needed = comm_op_needed()
    except ImportError as e:
        return f"DeepSpeed does not import here ({e}); make env reinstalls it"
    if not needed:
        return None
    path = extensions_dir()
    return _problem(path, cold=not comm_op_cached(path), announce=False)


def prebuild_comm_op() -> Path:
    """Build (or load from the cache) DeepSpeed's shared-memory comm op in this process."""
    path = use_extensions_cache()
    import deepspeed  # deferred: DeepSpeed is optional, and its import is slow
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator().device_name()
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder") if comm_op_needed() else None
    if builder is None:
        print(f"DeepSpeed's {accelerator} accelerator builds no shared-memory comm op on {sys.platform}: "
              f"nothing to build")
        return path
    cold = not comm_op_cached(path)
    preflight(path, cold=cold)
    if cold:
        print(f"compiling DeepSpeed's communication op into {path} (first use only, about a minute)...", flush=True)
    t0 = time.perf_counter()
    builder.load(verbose=False)
    print(f"DeepSpeed {deepspeed.__version__} comm op {'built' if cold else 'cached'} in {path} "
          f"({time.perf_counter() - t0:.1f}s)", flush=True)
    return path


def init_deepspeed(strategy, cache: Path) -> None:
    """deepspeed.init_distributed on the strategy's torch process group, saying so on the main rank
    when DeepSpeed is about to compile its comm op (a cold cache), instead of hanging silently; one line
    and no start when the op cannot be built or a killed build's lock would block it (preflight)."""
    import deepspeed  # deferred: DeepSpeed is optional, and its import is slow
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    cold = False
    if comm_op_needed():
        cold = not comm_op_cached(cache)
        preflight(cache, cold=cold, announce=strategy.is_main)  # every rank: each would build or wait
    if cold and strategy.is_main:
        print(f"[distlab] compiling DeepSpeed's communication op (first use only, about a minute; "
              f"cached in {cache})...", flush=True)
    t0 = time.perf_counter()
    deepspeed.init_distributed(dist_backend=strategy.backend)
    if cold and strategy.is_main:
        print(f"[distlab] DeepSpeed's communication op is ready ({time.perf_counter() - t0:.0f}s)", flush=True)


# ----------------------------------------------------------------------------- the config

def deepspeed_config(cfg, data_parallel_size: int, stage: int, *, bf16: bool = False, on_gpu: bool = False,
                     n_trained: int | None = None) -> dict[str, Any]:
    """The DeepSpeed config of a run, derived from its TrainConfig and data-parallel size.

    train_batch_size is computed (micro x accumulation x data-parallel size), so it always agrees
    with what the loop feeds. Buckets are DeepSpeed's 5e8 elements, or the trained weight count
    when smaller (memory.zero_bucket_elements; the planner models the same buffers). No optimizer
    or scheduler section: the engine gets distlab's torch AdamW, and the schedule stays distlab's."""
    if stage not in (2, 3):
        raise ValueError(f"ZeRO stage {stage}: distlab runs stage 2 or 3")
    accum = cfg.micro_steps(data_parallel_size)
    bucket = zero_bucket_elements(n_trained) if n_trained else int(5e8)
    zero: dict[str, Any] = {"stage": stage, "contiguous_gradients": True, "overlap_comm": on_gpu,
                            "reduce_bucket_size": bucket}
    if stage == 2:
        zero["allgather_bucket_size"] = bucket
    else:
        zero.update({"stage3_prefetch_bucket_size": bucket,
                     "stage3_param_persistence_threshold": ZERO3_PERSISTENCE_THRESHOLD,
                     "stage3_gather_16bit_weights_on_model_save": True})
    if cfg.zero_offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    config = {
        "train_batch_size": cfg.micro_batch_size * accum * data_parallel_size,
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": cfg.max_grad_norm,
        "zero_optimization": zero,
        # distlab passes torch's AdamW: "untested" for DeepSpeed, which prefers its own (compiled) Adam
        "zero_allow_untested_optimizer": True,
        # offload with torch's AdamW on the CPU partitions (DeepSpeedCPUAdam would compile first)
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if bf16:
        config["bf16"] = {"enabled": True}  # model in bf16, fp32 master weights in the optimizer
    return config


def pipeline_config(cfg, bf16: bool) -> dict[str, Any]:
    """The DeepSpeed pipeline engine's config: data-parallel size 1, m = grad_accum micro-batches,
    ZeRO stage 0 (stages 2/3 are incompatible with the pipeline engine)."""
    m = cfg.micro_steps(1)
    config: dict[str, Any] = {
        "train_batch_size": cfg.micro_batch_size * m,  # data-parallel size 1
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": m,
        # fp32: distlab clips by the global norm across stages; bf16: DeepSpeed's BF16 optimizer does
        "gradient_clipping": cfg.max_grad_norm if bf16 else 0.0,
        "zero_optimization": {"stage": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "pipeline": {"activation_checkpoint_interval": 0},
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


# ----------------------------------------------------------------------------- make deepspeed-op

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m distlab.strategies.deepspeed_runtime",
        description="Build DeepSpeed's shared-memory comm op into this environment's cache (make deepspeed-op).")
    parser.add_argument("--optional", action="store_true",
                        help="where the op cannot be built here, print why in one line and exit 0 (make book "
                             "goes on; the chapters skip their DeepSpeed runs with the same line)")
    args = parser.parse_args(argv)
    if args.optional and (reason := deepspeed_unavailable_reason()):
        print(f"skipped: {reason}", flush=True)
        return 0
    prebuild_comm_op()
    return 0


if __name__ == "__main__":
    run_main(main)
