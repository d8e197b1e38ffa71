"""DeepSpeed ZeRO stage 2 and stage 3, launched with torchrun like every other strategy.

`deepspeed.initialize` wraps the same CausalLMWithLoss and the same torch AdamW that the other
strategies build (no DeepSpeed-native optimizer: that would JIT-compile fused Adam first), with a
config written by `deepspeed_config` from the run's TrainConfig, never by hand:
train_batch_size = micro-batch x accumulation x data-parallel size.

  stage 2   weights stay whole on every rank; gradients are reduce-scattered into per-rank
            partitions of one flat buffer, and each rank keeps the fp32 master copy and the AdamW
            moments of its partition only, updates it, then all-gathers the updated weights.
  stage 3   weights are partitioned too: each layer's are all-gathered just before its forward
            and backward and released after; tensors under DeepSpeed's persistence threshold
            (100k elements: norms, biases, LoRA adapters) stay whole on every rank.

How it maps onto the loop's hooks. DeepSpeed wants `engine.backward(loss)` then `engine.step()`
after *every* micro-batch; step() applies the optimizer only at the accumulation boundary (from
its own micro-step counter and gradient_accumulation_steps). So forward_backward calls step()
after each non-final micro-batch (a no-op apart from the counter), and the strategy's step()
makes the boundary call, which clips, updates and zeroes the gradients. backward() runs with
scale_wrt_gas=False: DeepSpeed would otherwise divide by the accumulation steps, and distlab's
loss is already normalised by the global batch's label tokens. distlab's cosine schedule is built
on the torch AdamW *after* initialize, whose param groups DeepSpeed re-pointed at its fp32
partitions, and steps once per optimizer step.

First use: DeepSpeed JIT-compiles a small C++ shared-memory communication op when its comm backend
starts (about a minute on two cores). The build is cached in TORCH_EXTENSIONS_DIR, which this
module points at a persistent per-machine folder (`extensions_dir()`) unless already set, and rank
0 says so before it starts when the cache is cold. `make deepspeed-op` (`prebuild_comm_op()`) builds it
ahead of time; `make test` and `make book` do, so CI pays for it once per machine.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from ..data import model_inputs
from ..device import DeviceChoice, autocast
from .fsdp import CollectiveTimedStrategy, evaluate_in_lockstep, save_consolidated
from .single import cosine_with_warmup

SHM_OP = "deepspeed_shm_comm"


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


def comm_op_needed() -> bool:
    """Does DeepSpeed build its shared-memory comm op here (CPU accelerator on Linux)?"""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu" and sys.platform == "linux"


def prebuild_comm_op() -> Path:
    """Build (or load from the cache) DeepSpeed's shared-memory comm op in this process."""
    path = use_extensions_cache()
    import deepspeed
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
    import deepspeed
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
    from ..memory import ZERO3_PERSISTENCE_THRESHOLD, zero_bucket_elements

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


# ----------------------------------------------------------------------------- the strategy

class ZeroStrategy(CollectiveTimedStrategy):
    name = "zero"
    stage = 2

    def __init__(self) -> None:
        super().__init__()
        self.cfg = None
        self.engine = None
        self.ds_config: dict[str, Any] | None = None
        self.measured_state = None

    def setup(self, cfg) -> None:
        cache = use_extensions_cache()
        super().setup(cfg)  # torch's process group first (gloo on CPU, nccl on GPUs); DeepSpeed adopts it
        self.cfg = cfg
        self.start_timer(cfg)  # before DeepSpeed's comm backend starts: it keeps references to the collectives
        init_deepspeed(self, cache)

    def prepare(self, model: torch.nn.Module, choice: DeviceChoice, cfg):
        import deepspeed

        model = model.to(choice.device)
        optimizer = self.make_optimizer(model, cfg.lr, cfg.weight_decay)
        n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.ds_config = deepspeed_config(cfg, self.data_parallel_size, self.stage,
                                          bf16=choice.autocast_dtype == torch.bfloat16,
                                          on_gpu=choice.device.type == "cuda", n_trained=n_trained)
        if self.is_main:
            out = Path(cfg.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / "ds_config.json").write_text(json.dumps(self.ds_config, indent=2) + "\n")
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.ds_config)
        self.engine = engine
        # The schedule drives the torch AdamW inside the engine, whose groups now hold DeepSpeed's
        # fp32 partitions: one scheduler.step() per optimizer step changes the lr DeepSpeed uses.
        scheduler = cosine_with_warmup(optimizer, cfg.warmup_steps, cfg.max_steps)
        return engine, engine.optimizer, scheduler

    def unwrap(self, model):
        return model.module

    def forward_backward(self, model, micro_batches, choice: DeviceChoice, global_label_tokens: int) -> float:
        scale = self.data_parallel_size / global_label_tokens
        local = 0.0
        last = len(micro_batches) - 1
        for i, batch in enumerate(micro_batches):
            with self._cast(choice):
                loss_sum = model(**model_inputs(batch, choice.device))
            model.backward(loss_sum * scale, scale_wrt_gas=False)
            if i < last:
                model.step()  # not the boundary: DeepSpeed only counts the micro-step
            local += loss_sum.item() / global_label_tokens
        return local

    def _cast(self, choice: DeviceChoice):
        """Torch autocast for fp32 models; DeepSpeed's bf16 mode already holds the model in bf16."""
        if (self.ds_config or {}).get("bf16", {}).get("enabled"):
            return contextlib.nullcontext()
        return autocast(choice)

    def evaluate(self, model, data, choice: DeviceChoice, batch_size: int = 8) -> float:
        # ZeRO-3 gathers weights in every forward: all ranks must run as many as the busiest one
        return evaluate_in_lockstep(self, model, data, choice, batch_size, cast=self._cast)

    def step(self, model, optimizer, scheduler, max_grad_norm: float) -> float:
        if not model.is_gradient_accumulation_boundary():
            raise RuntimeError("DeepSpeed's micro-step counter is out of step with distlab's accumulation "
                               f"(gradient_accumulation_steps={model.gradient_accumulation_steps()})")
        if self.cfg is not None and self.cfg.measure_state:
            self.measured_state = measure_zero_state(model)  # gradients exist only until the step
        model.step()  # clips to gradient_clipping, updates the partitions, gathers weights, zeroes grads
        scheduler.step()
        norm = model.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    # --- saving
    def save_training_state(self, model, optimizer, path: Path) -> None:
        """DeepSpeed's own checkpoint: each rank writes its optimizer partition (and, stage 3, its
        weight partition); LoRA runs leave the frozen base weights out."""
        model.save_checkpoint(str(path / "deepspeed"), tag="state", save_latest=False,
                              exclude_frozen_parameters=bool(self.cfg and self.cfg.lora))

    def load_training_state(self, model, optimizer, path: Path) -> None:
        load_path, _ = model.load_checkpoint(str(path / "deepspeed"), tag="state", load_optimizer_states=True,
                                             load_lr_scheduler_states=False,
                                             load_module_strict=not (self.cfg and self.cfg.lora))
        if load_path is None:
            raise RuntimeError(f"{path}: no DeepSpeed checkpoint to resume from")

    def save_model(self, model, path: Path, tokenizer=None) -> None:
        if self.stage < 3:  # whole weights on every rank: rank 0 saves as on one device
            return super().save_model(model, path, tokenizer)
        # gathered layer by layer onto rank 0; LoRA: only the adapters
        full = model._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=bool(self.cfg and self.cfg.lora))
        if self.is_main:
            save_consolidated(model.module, full, path, tokenizer)
        self.barrier()


class Zero2Strategy(ZeroStrategy):
    name = "zero2"
    stage = 2


class Zero3Strategy(ZeroStrategy):
    name = "zero3"
    stage = 3


# ----------------------------------------------------------------------------- what a rank owns

def measure_zero_state(engine):
    """Bytes of weights, adapters, gradients and optimizer state this rank holds under DeepSpeed
    ZeRO, from the engine's own buffers (memory.owned_bytes: each storage once, first category wins).

    stage 2: weights are whole (trained ones are views into one flat buffer per optimizer group);
      gradients live in `grads_in_partition` (whole tensors that touch this rank's partition);
      optimizer state is the fp32 master partition plus the AdamW moments on it.
    stage 3: weights are each tensor's partition (`ds_tensor`, the trained ones inside one flat
      buffer) plus whatever is gathered right now (persistent small tensors); gradients are the
      flat fp32 partition buffer; optimizer state the fp32 master partition (a copy even for an fp32
      model in DeepSpeed 0.19.8) plus the moments.
    The reduce buckets are reported as buffers."""
    from ..memory import MemoryBreakdown, optimizer_state_tensors, owned_bytes

    opt = engine.optimizer
    params = list(dict.fromkeys(engine.module.parameters()))
    frozen = [p for p in params if not p.requires_grad]
    trained = [p for p in params if p.requires_grad]
    lora = bool(frozen)
    seen: set = set()
    if engine.zero_optimization_stage() >= 3:
        held = lambda ps: [t for p in ps for t in (getattr(p, "ds_tensor", None), p.data)]
        weights = owned_bytes(held(frozen if lora else params), seen)
        adapters = owned_bytes(held(trained), seen) if lora else 0
        grads = owned_bytes([getattr(opt, "grad_partitions_flat_buffer", None)], seen)
        master = list(getattr(opt, "fp32_partitioned_groups_flat", []))
    else:
        weights = owned_bytes(frozen if lora else params, seen)
        adapters = owned_bytes(trained, seen) if lora else 0
        grad_tensors = [getattr(opt, "grads_in_partition", None)] + [p.grad for p in trained]
        for group in getattr(opt, "averaged_gradients", {}).values():
            grad_tensors += list(group or [])
        grads = owned_bytes(grad_tensors, seen)
        master = list(getattr(opt, "single_partition_of_fp32_groups", []))
    state = owned_bytes(master + optimizer_state_tensors(opt.optimizer), seen)
    buffers = []
    for bucket in getattr(opt, "ipg_buckets", {}).values():
        buf = getattr(bucket, "buffer", None)
        buffers += list(buf) if isinstance(buf, (list, tuple)) else [buf]
    return MemoryBreakdown(weights=weights, adapter_weights=adapters, gradients=grads, optimizer_state=state,
                           buffers=owned_bytes([b for b in buffers if torch.is_tensor(b)], seen))
