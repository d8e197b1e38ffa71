"""FSDP2 (`torch.distributed.fsdp.fully_shard`): every rank keeps only a shard of each weight,
its gradient and its optimizer state, and gathers whole layers just in time.

What changes against DDP: instead of one wrapper that all-reduces gradients, `fully_shard` is
applied to each decoder layer and then to the root module (embedding, final norm, LM head: tied
in the tiny model, one parameter, sharded once by the root). Each parameter becomes a DTensor cut
on dim 0 over a 1-D device mesh of all ranks. Forward all-gathers one layer's weights, runs it and
frees them again; backward all-gathers them once more and reduce-scatters the gradients, so each
rank ends the step with the gradient shard of its own weight shard and updates only that.

On GPUs with bf16 autocast, a MixedPrecisionPolicy gathers the weights in bf16 and reduces the
gradients in fp32; on CPU (fp32) there is no policy. Accumulation uses
`set_requires_gradient_sync(False)` (FSDP2's `no_sync`): gradients of non-final micro-steps stay
unsharded and local, and the final micro-step reduce-scatters their sum. Clipping needs
nothing new: on DTensors `clip_grad_norm_` computes shard norms and all-reduces them. Checkpoints are sharded
(`torch.distributed.checkpoint`: every rank writes its own shard); `save_model` gathers a full
state dict on rank 0 and writes a normal adapter or model folder that `from_pretrained` loads.

Loading shards too: prepare_run builds a weightless model (on the meta device), `fully_shard` cuts it there,
and each rank then allocates and reads from the files only its own shards (distlab.sharded_load; the order is
distlab.strategies.base.parallelize's); no rank ever holds the whole model. A 4-bit base (FSDP + QLoRA) is read
one quantised weight at a time, packed, and cut. Random presets and int8 bases still load whole, then shard.

The cut itself is `apply_fsdp` (fsdp_tp applies it along the "dp" dimension of its 2-D mesh), and the sharded
checkpoint `save_sharded_state` / `load_sharded_state` (fsdp_tp's too).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from distlab.device import DeviceChoice
from distlab.safe_load import check_dcp
from distlab.strategies.base import DistributedStrategy, save_consolidated
from distlab.strategies.split import decoder_layers


def offload_policy(cpu_offload: bool, device: torch.device | str) -> OffloadPolicy:
    """FSDP2's CPUOffloadPolicy when asked for (fsdp_cpu_offload): every shard, its gradient and its optimizer
    state live in pinned host memory and the optimizer steps there; each layer's shard is copied to the GPU
    for its all-gather. It needs an accelerator to copy to, so it is refused on a CPU device, with the reason."""
    if not cpu_offload:
        return OffloadPolicy()  # FSDP2's "no offload"
    kind = torch.device(device).type
    if kind != "cuda":
        raise ValueError(f"fsdp_cpu_offload=true needs a GPU: FSDP2's CPUOffloadPolicy copies each layer's shard "
                         f"to an accelerator; on {kind} the weights are in host memory already, so there is "
                         "nothing to offload")
    return CPUOffloadPolicy(pin_memory=True)


def mixed_precision(choice: DeviceChoice) -> MixedPrecisionPolicy:
    if choice.autocast_dtype is None:
        return MixedPrecisionPolicy()  # fp32 (CPU): gather and reduce in the weights' dtype
    return MixedPrecisionPolicy(param_dtype=choice.autocast_dtype, reduce_dtype=torch.float32)


def apply_fsdp(model: torch.nn.Module, mesh, choice: DeviceChoice, reshard_after_forward: bool = True,
               cpu_offload: bool = False) -> None:
    """`fully_shard` each decoder layer, then the root, over `mesh` (in place): a layer's weights are gathered
    whole only for its forward and its backward, and its gradients reduce-scattered. fsdp's cut over all ranks,
    fsdp_tp's over the "dp" dimension of its mesh (each tensor-parallel slice sharded again)."""
    mp = mixed_precision(choice)
    offload = offload_policy(cpu_offload, choice.device)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp,
                    offload_policy=offload)
    # The root takes everything not in a layer: embedding, final norm and LM head (the same
    # tensor when tied, so it is sharded once). The root keeps its weights gathered between
    # forward and backward (FSDP2's default for the root): backward needs them first.
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)


def gradient_sync(model: torch.nn.Module, sync: bool):
    """The context of one micro-step: FSDP2's `no_sync` (gradients kept unsharded and local) unless `sync`."""
    return contextlib.nullcontext() if sync else _no_gradient_sync(model)


class FSDPStrategy(DistributedStrategy):
    name = "fsdp"
    shards_checkpoint = True
    loads_shards = True  # prepare_run builds it weightless; `parallelize` shards it, then fills each rank's part

    def __init__(self) -> None:
        super().__init__()
        self.cfg = None
        self.mesh = None

    def setup(self, cfg) -> None:
        super().setup(cfg)
        self.cfg = cfg
        device_type = "cuda" if self.backend == "nccl" else "cpu"
        self.mesh = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("dp",))
        self.meter.watch_collectives()  # times every all-gather and reduce-scatter FSDP2 issues

    def shard(self, model: torch.nn.Module, choice: DeviceChoice, cfg) -> None:
        apply_fsdp(model, self.mesh, choice, cfg.fsdp_reshard_after_forward, cfg.fsdp_cpu_offload)

    def fill_device(self, choice: DeviceChoice, cfg):
        return "cpu" if cfg.fsdp_cpu_offload else choice.device  # offloaded shards live on the host

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # fully_shard changes the module's class in place; there is no wrapper

    def sync_context(self, model, sync: bool):
        return gradient_sync(model, sync)

    # --- saving
    def save_training_state(self, model, optimizer, path: Path) -> None:
        save_sharded_state(model, optimizer, path, lora=bool(self.cfg and self.cfg.lora))

    def load_training_state(self, model, optimizer, path: Path) -> None:
        load_sharded_state(model, optimizer, path, lora=bool(self.cfg and self.cfg.lora))

    def save_model(self, model: torch.nn.Module, path: Path, tokenizer=None) -> None:
        """A consolidated adapter (LoRA) or model folder, written by rank 0 from a gathered state dict."""
        # LoRA: gather only the adapters (the frozen base model is the one from_pretrained already has)
        lora = bool(self.cfg and self.cfg.lora)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                   ignore_frozen_params=lora))
        if self.is_main:
            save_consolidated(model, full, path, tokenizer)
        self.barrier()


def _state_options(lora: bool, **kw) -> StateDictOptions:
    # LoRA: the frozen base weights never change, the checkpoint holds only what is trained.
    return StateDictOptions(ignore_frozen_params=lora, **kw)


def save_sharded_state(model, optimizer, path: Path, lora: bool) -> None:
    """Sharded: every rank writes its own shards of the trained weights and optimizer state."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_state_options(lora))
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path / "dcp"))


def load_sharded_state(model, optimizer, path: Path, lora: bool) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_state_options(lora))
    state = {"model": model_sd, "optimizer": optim_sd}
    check_dcp(path / "dcp")  # DCP unpickles its metadata and non-tensor entries as they come: plain data only
    dcp.load(state, checkpoint_id=str(path / "dcp"))  # fills the shards in place, with resharding
    # LoRA: the state holds only the trained tensors (dcp.load checked each one was in the
    # checkpoint); non-strict so the frozen base weights, left out on purpose, are not "missing".
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_state_options(lora, strict=not lora))


@contextlib.contextmanager
def _no_gradient_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
