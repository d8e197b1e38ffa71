"""Loading that shards: each rank reads only its own part of the weights, never the whole model.

The plain way to start a sharded run is to load the whole model on every rank and then shard it: for a
moment each rank holds a full replica, which is exactly what sharding was meant to avoid (a model too
big for one device cannot even start). The way round it, in three steps:

  1. build the model with no weights: every parameter on the "meta" device (a shape and a dtype, no
     memory), with the same LoRA adapters, activation checkpointing and loss module as a whole load
     (`empty_model`, `defer_weights`, called by distlab.prepare);
  2. shard it on meta: `fully_shard` and the tensor-parallel plan only decide who holds which slice,
     which needs shapes, not values (strategies.base.parallelize);
  3. allocate only this rank's slices (`to_empty`) and fill each one from the safetensors files,
     reading just that slice of each tensor (`safe_open(...).get_slice`), one tensor at a time
     (`fill`). A DTensor says which slice it holds (its offsets and sizes, as
     torch.distributed.checkpoint asks for them), so the same reader serves fsdp, tp and fsdp_tp.

What is not in the files is kept, small, on the CPU from step 1: the LoRA adapters (initialised from the
seeded random generator in exactly the order a whole load draws them, so every strategy starts from
bit-identical adapters) and the rotary embedding's `inv_freq` buffers (non-persistent: computed from the
config, never saved). A tied embedding and LM head stay one parameter throughout.

Random presets (distlab.models.RANDOM_PRESETS) have no folder: they are built whole from a seeded
init, so every strategy, single and ddp included, starts from the same weights; they keep the whole-model
path. So do quantised (QLoRA) bases: bitsandbytes quantises inside from_pretrained.

ZeRO-3 loads its own way (`zero3_init`): transformers' from_pretrained builds the model under
`deepspeed.zero.Init`, so each parameter is partitioned over the ranks as soon as it is created.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from distlab.attention import resolve
from distlab.model_build import quiet_hf
from distlab.models import RANDOM_PRESETS, resolve_model


def whole_model_reason(cfg) -> str | None:
    """Why a run must load the whole model on every rank, or None when its weights can be read in shards."""
    if cfg.quantization != "none":
        return "a quantised base (bitsandbytes quantises inside from_pretrained)"
    if cfg.model in RANDOM_PRESETS:
        return "a random preset (built whole from a seeded init, as every strategy builds it)"
    folder = model_folder(cfg.model)
    if not (folder / "model.safetensors").is_file() and not (folder / "model.safetensors.index.json").is_file():
        return f"{folder} holds no safetensors checkpoint (the only format a rank can read a slice of)"
    return None


def model_folder(model: str | None) -> Path:
    """The local folder of a model: distlab's names and folders as they resolve, a Hub id through the Hub's
    cache (its config and safetensors files: what from_pretrained would fetch)."""
    name = resolve_model(model)
    if Path(name).is_dir():
        return Path(name)
    from huggingface_hub import snapshot_download  # deferred: only a Hub id needs it

    return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors"]))


@dataclass
class PendingWeights:
    """What `fill` needs once the model is sharded: the folder to read, and the tensors no file holds."""

    folder: Path
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # name in the model -> its CPU value


def empty_model(model: str | None, dtype: torch.dtype, attn_implementation: str):
    """The model `model` names, built from its config with weightless parameters: each a CPU tensor of the
    right shape and dtype that repeats one element (stride 0), so it takes no memory. CPU rather than
    meta so that PEFT, which creates each adapter on its base layer's device, leaves the adapters on the
    CPU with their values (`defer_weights` then moves every parameter to meta)."""
    # deferred: transformers is slow to import
    from transformers import AutoConfig, AutoModelForCausalLM

    quiet_hf()  # as load_model: no progress bars, no deprecation notices that are not ours to fix
    config = AutoConfig.from_pretrained(model_folder(model), trust_remote_code=False)
    attn_implementation = resolve(attn_implementation)
    with torch.device("meta"):  # draws nothing from the random generator, allocates nothing
        lm = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    for p in lm.parameters():  # each tied parameter once; swapping keeps it the same object, so still tied
        torch.utils.swap_tensors(p, torch.nn.Parameter(torch.empty((), dtype=p.dtype).expand(p.shape),
                                                       requires_grad=p.requires_grad))
    decoder = lm.get_decoder()
    decoder.rotary_emb = type(decoder.rotary_emb)(config=lm.config)  # real buffers, computed from the config
    unknown = [name for name, b in lm.named_buffers() if b.is_meta]
    if unknown:
        raise NotImplementedError(f"a sharded load cannot compute the buffers {unknown[:3]} of {type(lm).__name__}")
    return lm


def defer_weights(model: torch.nn.Module, model_name: str | None) -> torch.nn.Module:
    """Move a CausalLMWithLoss built on `empty_model` to meta, keeping (on the CPU) the values of the tensors
    the files do not hold; `fill` reads the rest once the strategy has sharded the model."""
    folder = model_folder(model_name)
    in_file = set(weight_files(folder))
    extras = {}
    for name, t in named_tensors(model):
        if file_key(name) in in_file:
            continue
        if t.numel() > 1 and not any(t.stride()):
            raise ValueError(f"{folder}: no tensor {file_key(name)!r} in the model's safetensors files")
        extras[name] = t.detach().clone()  # LoRA adapters and non-persistent buffers: small
    for p in model.parameters():
        torch.utils.swap_tensors(p, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                       requires_grad=p.requires_grad))
    model.pending_weights = PendingWeights(folder, extras)
    return model


def is_pending(model: torch.nn.Module) -> bool:
    """Whether the model has no weights yet (built by `defer_weights`): a strategy shards it before `fill`."""
    return getattr(model, "pending_weights", None) is not None


def fill(model: torch.nn.Module, device: torch.device | str, log_as: str = "") -> dict:
    """Allocate this rank's part of every (sharded) tensor on `device` and read it in; returns what was read:
    bytes_read (from the files), largest_read (one slice), bytes_held (every tensor this rank allocated) and
    file_bytes (the whole model in the files). Prints one line on rank 0 when `log_as` names the strategy."""
    pending: PendingWeights = model.pending_weights
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # each parameter stays one object: tied stay tied
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    files = weight_files(pending.folder)
    report = {"bytes_read": 0, "largest_read": 0, "bytes_held": 0, "file_bytes": 0}
    with contextlib.ExitStack() as stack:
        opened = {path: stack.enter_context(safe_open(str(path), framework="pt")) for path in set(files.values())}
        report["file_bytes"] = sum(path.stat().st_size for path in opened)
        with torch.no_grad():
            for name, t in named_tensors(model):
                local = t.to_local() if isinstance(t, DTensor) else t
                index = tuple(slice(o, o + s) for o, s in zip(*_local_box(t)))
                if name in pending.extras:
                    local.copy_(pending.extras[name][index])
                else:
                    part = opened[files[file_key(name)]].get_slice(file_key(name))[index]
                    local.copy_(part)  # casts to the model's dtype, as from_pretrained does
                    report["bytes_read"] += part.numel() * part.element_size()
                    report["largest_read"] = max(report["largest_read"], part.numel() * part.element_size())
                report["bytes_held"] += local.numel() * local.element_size()
    model.pending_weights = None
    model.load_report = report
    if log_as and (not dist.is_initialized() or dist.get_rank() == 0):
        mb = 1 / 2**20
        print(f"[distlab] {log_as}: loaded this rank's shard of the weights only: read "
              f"{report['bytes_read'] * mb:.1f} MiB of the files' {report['file_bytes'] * mb:.1f} MiB", flush=True)
    return report


def named_tensors(model: torch.nn.Module):
    """(name inside the transformers model, tensor) for every parameter (a tied one once) and buffer."""
    lm = model.causal_lm
    yield from lm.named_parameters()
    yield from lm.named_buffers()


def file_key(name: str) -> str:
    """The checkpoint's name for a tensor of the (possibly LoRA-wrapped) model: PEFT moves a wrapped
    projection's weight to `<proj>.base_layer.weight`."""
    return name.replace(".base_layer.", ".")


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or a sharded checkpoint's index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json "
                                "(only a safetensors checkpoint can be read a part at a time)")
    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}


def _local_box(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """(offsets, sizes) of this rank's block of `t` in the whole tensor; a plain tensor is its own block.
    A DTensor answers with the method torch.distributed.checkpoint calls for the same purpose."""
    if not isinstance(t, DTensor):
        return [0] * t.dim(), list(t.shape)
    (chunk,) = t.__create_chunk_list__()
    return list(chunk.offsets), list(chunk.sizes)


@contextlib.contextmanager
def zero3_init(ds_config: dict, dtype: torch.dtype):
    """ZeRO-3's sharded load: while this context is open, transformers' from_pretrained builds the model under
    `deepspeed.zero.Init` (it asks transformers.integrations for a live HfDeepSpeedConfig), so every parameter
    is partitioned over the ranks as it is created and filled. Closed after loading, so that nothing built
    later in the process (a sweep's next run, a model built for comparison) is partitioned by surprise.

    zero.Init creates the parameters in the dtype of the config's precision section (fp32 without one), and
    the engine leaves a model built under it as it is: the loading config names `dtype`, the dtype the run
    stores its weights in (bf16 weights trained in DeepSpeed's fp32 mode keep 2 bytes, as a whole load does)."""
    # deferred: transformers is slow to import, and only ZeRO-3 needs it here
    from transformers.integrations import HfDeepSpeedConfig

    precision = {"bf16": {"enabled": dtype == torch.bfloat16}, "fp16": {"enabled": dtype == torch.float16}}
    live = HfDeepSpeedConfig({**ds_config, **precision})  # transformers keeps a weak reference: this one lives
    try:
        yield live
    finally:
        del live
