"""DeepSpeed ZeRO stage 2 and stage 3, launched with torchrun like every other strategy.

`deepspeed.initialize` wraps the same CausalLMWithLoss and the same torch AdamW that the other
strategies build (no DeepSpeed-native optimizer: that would JIT-compile fused Adam first), with a
config written by `deepspeed_runtime.deepspeed_config` from the run's TrainConfig, never by hand:
train_batch_size = micro-batch x accumulation x data-parallel size.

  stage 2   weights stay whole on every rank; gradients are reduce-scattered into per-rank
            partitions of one flat buffer, and each rank keeps the fp32 master copy and the AdamW
            moments of its partition only, updates it, then all-gathers the updated weights.
  stage 3   weights are partitioned too: each layer's are all-gathered just before its forward
            and backward and released after; tensors under DeepSpeed's persistence threshold
            (100k elements: norms, biases, LoRA adapters) stay whole on every rank. It also loads
            partitioned (`load_context`): from_pretrained runs under deepspeed.zero.Init, so no rank
            ever holds the whole model, not even while loading.

How it maps onto the loop's hooks. DeepSpeed wants `engine.backward(loss)` then `engine.step()`
after *every* micro-batch; step() applies the optimizer only at the accumulation boundary (from
its own micro-step counter and gradient_accumulation_steps). The engine owns the
optimizer step, so ZeRO overrides the interface's whole `train_step`: step() after each non-final
micro-batch (a no-op apart from the counter), then the boundary call, which clips (the config's
gradient_clipping), updates and zeroes the gradients. backward() runs with
scale_wrt_gas=False: DeepSpeed would otherwise divide by the accumulation steps, and distlab's
loss is already normalised by the global batch's label tokens. The engine is ZeRO's step of
distlab.strategies.base.parallelize (`wrap`): it takes the torch AdamW and distlab's cosine schedule
built on it, and steps that schedule once per optimizer step; DeepSpeed re-points the AdamW's param
groups at its fp32 partitions, and the schedule sets the lr in those same groups.

DeepSpeed's start-up (its JIT-compiled comm op, cached) and config live in
distlab.strategies.deepspeed_runtime, shared with the DeepSpeed pipeline.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from distlab import compat, sharded_load
from distlab.data import model_inputs
from distlab.device import DeviceChoice
from distlab.jsonio import strict_json
from distlab.models import whole_shape
from distlab.safe_load import check_deepspeed
from distlab.strategies.base import DistributedStrategy, save_consolidated
from distlab.strategies.deepspeed_runtime import deepspeed_config, init_deepspeed, use_extensions_cache


class ZeroStrategy(DistributedStrategy):
    name = "zero"
    shards_checkpoint = True
    stage = 2

    def __init__(self) -> None:
        super().__init__()
        self.cfg = None
        self.engine = None
        self.ds_config: dict[str, Any] | None = None
        self.placed_as_loaded = False  # stage 3: the model was built under deepspeed.zero.Init

    def setup(self, cfg) -> None:
        cache = use_extensions_cache()
        super().setup(cfg)  # torch's process group first (gloo on CPU, nccl on GPUs); DeepSpeed adopts it
        self.cfg = cfg
        self.meter.watch_collectives()  # before DeepSpeed's comm backend starts: it keeps references to them
        init_deepspeed(self, cache)

    def load_context(self, cfg, choice: DeviceChoice):
        """Stage 3 loads partitioned: from_pretrained builds the model under deepspeed.zero.Init (through
        transformers' HfDeepSpeedConfig), so no rank ever holds the whole model. Stage 2 keeps whole weights
        on every rank anyway: it loads as one device does."""
        if self.stage < 3:
            return super().load_context(cfg, choice)
        self.placed_as_loaded = True
        # the weights' dtype once the engine holds them: DeepSpeed's bf16 mode casts to bf16, else the run's
        bf16_mode = choice.autocast_dtype == torch.bfloat16
        return sharded_load.zero3_init(self.engine_config(cfg, choice), torch.bfloat16 if bf16_mode else choice.dtype)

    def engine_config(self, cfg, choice: DeviceChoice, n_trained: int | None = None) -> dict[str, Any]:
        return deepspeed_config(cfg, self.data_parallel_size, self.stage, bf16=choice.autocast_dtype == torch.bfloat16,
                                on_gpu=choice.device.type == "cuda", n_trained=n_trained)

    # `compile` is left out: DeepSpeed hooks every module for its own partitioning (and has its own
    # engine.compile()); compiling the layers under those hooks has not been tried here
    compiles_layers = False

    def optimizer_options(self, cfg) -> dict:
        return {}  # the plain torch AdamW the engine takes over: fused_optimizer has not been tried under DeepSpeed

    def wrap(self, model: torch.nn.Module, optimizer, scheduler, choice: DeviceChoice, cfg):
        import deepspeed  # deferred: DeepSpeed is optional, and its import is slow

        if self.placed_as_loaded and choice.autocast_dtype == torch.bfloat16:
            # DeepSpeed's bf16 mode casts a module to bf16, but skips one built under zero.Init (its weights
            # are bf16 already); PEFT's adapters came after, in fp32. Cast them as stage 2 and the planner do.
            for p in model.parameters():
                if not hasattr(p, "ds_id") and p.is_floating_point() and p.dtype != torch.bfloat16:
                    p.data = p.data.to(torch.bfloat16)
        n_trained = sum(whole_shape(p).numel() for p in model.parameters() if p.requires_grad)
        self.ds_config = self.engine_config(cfg, choice, n_trained)
        if self.is_main:
            out = Path(cfg.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / "ds_config.json").write_text(strict_json(self.ds_config, indent=2) + "\n")
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.ds_config)
        self.engine = engine
        # the loop steps the engine's optimizer; the schedule stays on the torch AdamW inside it
        return engine, engine.optimizer, scheduler

    def unwrap(self, model):
        return model.module

    def forward_context(self, choice: DeviceChoice):
        """Torch autocast for fp32 models; DeepSpeed's bf16 mode already holds the model in bf16."""
        if (self.ds_config or {}).get("bf16", {}).get("enabled"):
            return contextlib.nullcontext()
        return super().forward_context(choice)

    def train_step(self, model, micro_batches, choice: DeviceChoice, global_label_tokens: int,
                   optimizer, scheduler, max_grad_norm: float) -> tuple[torch.Tensor, float]:
        scale = self.data_parallel_size / global_label_tokens
        local = torch.zeros((), dtype=torch.float64, device=choice.device)  # read at logging steps only
        last = len(micro_batches) - 1
        for i, batch in enumerate(micro_batches):
            with self.forward_context(choice):
                loss_sum = model(**model_inputs(batch, choice.device))
            model.backward(loss_sum * scale, scale_wrt_gas=False)
            if i < last:
                model.step()  # not the boundary: DeepSpeed only counts the micro-step
            local += loss_sum.detach().double() / global_label_tokens
        if not model.is_gradient_accumulation_boundary():
            raise RuntimeError("DeepSpeed's micro-step counter is out of step with distlab's accumulation "
                               f"(gradient_accumulation_steps={model.gradient_accumulation_steps()})")
        self.meter.state_point(model, optimizer)  # ZeRO's gradient partitions exist only until the step
        model.step()  # clips to gradient_clipping, updates the partitions, gathers weights, zeroes grads
        scheduler.step()
        norm = model.get_global_grad_norm()
        return local, float(norm) if norm is not None else float("nan")

    # --- saving
    def save_training_state(self, model, optimizer, path: Path) -> None:
        """DeepSpeed's own checkpoint: each rank writes its optimizer partition (and, stage 3, its
        weight partition); LoRA runs leave the frozen base weights out."""
        model.save_checkpoint(str(path / "deepspeed"), tag="state", save_latest=False,
                              exclude_frozen_parameters=bool(self.cfg and self.cfg.lora))

    def load_training_state(self, model, optimizer, path: Path) -> None:
        check_deepspeed(path / "deepspeed")  # DeepSpeed unpickles whatever the files hold: plain data only
        load_path, _ = model.load_checkpoint(str(path / "deepspeed"), tag="state", load_optimizer_states=True,
                                             load_lr_scheduler_states=False,
                                             load_module_strict=not (self.cfg and self.cfg.lora))
        if load_path is None:
            raise RuntimeError(f"{path}: no DeepSpeed checkpoint to resume from")

    def save_model(self, model, path: Path, tokenizer=None) -> None:
        if self.stage < 3:  # whole weights on every rank: rank 0 saves as on one device
            return super().save_model(model, path, tokenizer)
        # gathered layer by layer onto rank 0; LoRA: only the adapters
        full = compat.zero3_full_state_dict(model, exclude_frozen=bool(self.cfg and self.cfg.lora))
        if self.is_main:
            save_consolidated(model.module, full, path, tokenizer)
        self.barrier()


class Zero2Strategy(ZeroStrategy):
    name = "zero2"
    stage = 2


class Zero3Strategy(ZeroStrategy):
    name = "zero3"
    stage = 3
