"""DeepSpeed's start-up and configs, shared by the ZeRO strategies and the DeepSpeed pipeline.

First use: DeepSpeed JIT-compiles a small C++ shared-memory communication op when its comm backend
starts (about a minute on two cores). The build is cached in TORCH_EXTENSIONS_DIR, which this
module points at a persistent per-machine folder (`extensions_dir()`) unless already set, and rank
0 says so before it starts when the cache is cold. `make deepspeed-op` (`prebuild_comm_op()`) builds it
ahead of time; `make test` and `make book` do, so CI pays for it once per machine.

Configs are derived from the run's TrainConfig, never written by hand: train_batch_size is always
micro-batch x accumulation x data-parallel size, so it agrees with what the loop feeds.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from distlab.config import ZERO3_PERSISTENCE_THRESHOLD, zero_bucket_elements

SHM_OP = "deepspeed_shm_comm"
# torch's JIT build holds SHM_OP/lock while it compiles (about a minute here) and every other builder waits
# for it to vanish, forever. A build killed midway leaves the lock behind; one older than this is stale.
STALE_LOCK_S = 600


# ----------------------------------------------------------------------------- the JIT op cache

def extensions_dir() -> Path:
    """Where torch caches JIT-built C++ extensions for distlab: $TORCH_EXTENSIONS_DIR if set, else
    $DISTLAB_TORCH_EXTENSIONS_DIR, else ~/.cache/distlab/torch_extensions/<python-torch-deepspeed>
    (a build is only valid for the versions it was compiled against)."""
    for var in ("TORCH_EXTENSIONS_DIR", "DISTLAB_TORCH_EXTENSIONS_DIR"):
        if os.environ.get(var):
            return Path(os.environ[var])
    try:
        ds = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        ds = "none"
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__.split('+')[0]}-deepspeed{ds}"
    return Path.home() / ".cache" / "distlab" / "torch_extensions" / tag


def use_extensions_cache() -> Path:
    """Point torch's extension builds at the persistent cache (before DeepSpeed builds anything)."""
    path = extensions_dir()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(path)
    return path


def comm_op_cached(path: Path | None = None) -> bool:
    path = path or extensions_dir()
    return (path / SHM_OP / f"{SHM_OP}.so").exists()


def remove_stale_build_lock(path: Path | None = None, max_age_s: float = STALE_LOCK_S) -> Path | None:
    """Remove the comm op's build lock when it is older than any real build (a killed build left it, and
    every later build would wait for it forever); return the removed lock, else None."""
    lock = (path or extensions_dir()) / SHM_OP / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    if age < max_age_s:
        return None
    lock.unlink(missing_ok=True)
    print(f"removed a stale build lock {lock} ({age / 60:.0f} min old: a killed build left it)", flush=True)
    return lock


def comm_op_needed() -> bool:
    """Does DeepSpeed build its shared-memory comm op here (CPU accelerator on Linux)?"""
    from deepspeed.accelerator import get_accelerator  # deferred: DeepSpeed is optional, and its import is slow

    return get_accelerator().device_name() == "cpu" and sys.platform == "linux"


def prebuild_comm_op() -> Path:
    """Build (or load from the cache) DeepSpeed's shared-memory comm op in this process."""
    path = use_extensions_cache()
    remove_stale_build_lock(path)
    import deepspeed  # deferred: DeepSpeed is optional, and its import is slow
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        print(f"DeepSpeed's {get_accelerator().device_name()} accelerator builds no shared-memory comm op")
        return path
    cold = not comm_op_cached(path)
    if cold:
        print(f"compiling DeepSpeed's communication op into {path} (first use only, about a minute)...", flush=True)
    t0 = time.perf_counter()
    builder.load(verbose=False)
    print(f"DeepSpeed {deepspeed.__version__} comm op {'built' if cold else 'cached'} in {path} "
          f"({time.perf_counter() - t0:.1f}s)", flush=True)
    return path


def init_deepspeed(strategy, cache: Path) -> None:
    """deepspeed.init_distributed on the strategy's torch process group, saying so on the main rank
    when DeepSpeed is about to compile its comm op (a cold cache), instead of hanging silently."""
    import deepspeed  # deferred: DeepSpeed is optional, and its import is slow
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    cold = comm_op_needed() and not comm_op_cached(cache)
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
