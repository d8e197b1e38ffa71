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
     reading just that slice of each tensor with plain reads at its offsets in the file (`read_part`), one
     tensor at a time (`fill`). Not through a memory map: the pages of a mapped file that a rank touches
     count in its resident memory while the file is open, and how many the kernel maps around each one
     depends on what the page cache holds (the same FSDP QLoRA load held 630 or 714 MiB per rank here).
     A DTensor says which slice it holds (its offsets and sizes, as torch.distributed.checkpoint asks for
     them), so the same reader serves fsdp, tp and fsdp_tp.

What is not in the files is kept, small, on the CPU from step 1: the LoRA adapters (initialised from the
seeded random generator in exactly the order a whole load draws them, so every strategy starts from
bit-identical adapters) and the rotary embedding's `inv_freq` buffers (non-persistent: computed from the
config, never saved). A tied embedding and LM head stay one parameter throughout.

Random presets (distlab.models.RANDOM_PRESETS) have no folder: they are built whole from a seeded
init, so every strategy, single and ddp included, starts from the same weights; they keep the whole-model
path (a quantised preset is read from the folder it is saved to once, as a whole quantised load reads it).

A 4-bit (QLoRA, nf4) base is built with bitsandbytes' Linear4bit layers, exactly as from_pretrained builds it
(transformers' own quantizer replaces the layers), and each quantised weight is read whole, one at a time,
quantised on the run's device with the call from_pretrained makes (`quantize_4bit`), and cut: the rank keeps
its own rows of the packed bytes and the small per-block scales (bitsandbytes' QuantState, which stays whole on
every layer, as FSDP + QLoRA keeps it after a whole load). Bit for bit what a whole load holds, without a
whole 4-bit replica on any rank: the most it holds beyond its share is one weight being packed.

ZeRO-3 loads its own way (`zero3_init`): transformers' from_pretrained builds the model under
`deepspeed.zero.Init`, so each parameter is partitioned over the ranks as soon as it is created.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from distlab.attention import resolve
from distlab.model_build import quiet_hf
from distlab.models import RANDOM_PRESETS, keep_4bit_layout, quant_state_parts, random_preset_folder, resolve_model


def whole_model_reason(cfg) -> str | None:
    """Why a run must load the whole model on every rank, or None when its weights can be read in shards."""
    if cfg.quantization not in ("none", "nf4"):
        return f"an {cfg.quantization} base (bitsandbytes quantises it inside from_pretrained)"
    if cfg.model in RANDOM_PRESETS and cfg.quantization == "none":
        return "a random preset (built whole from a seeded init, as every strategy builds it)"
    folder = weights_folder(cfg)
    if not (folder / "model.safetensors").is_file() and not (folder / "model.safetensors.index.json").is_file():
        return f"{folder} holds no safetensors checkpoint (the only format a rank can read a slice of)"
    return None


def weights_folder(cfg) -> Path:
    """The folder a run's weights are read from: the model's, or for a quantised random preset the folder
    it is saved to once (what a whole quantised load reads: distlab.models.random_preset_folder)."""
    if cfg.model in RANDOM_PRESETS:
        return Path(random_preset_folder(cfg.model))
    return model_folder(cfg.model)


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
    load_dtype: torch.dtype = torch.float32  # what from_pretrained reads every tensor as: the run's dtype
    # a 4-bit base: file key -> quantize_4bit's settings for that weight (blocksize, quant_type, ...)
    quantised: dict[str, dict] = field(default_factory=dict)


QUANT_SETTINGS = ("blocksize", "compress_statistics", "quant_type", "quant_storage")  # of a Params4bit


def empty_model(folder: Path, dtype: torch.dtype, attn_implementation: str, quantization=None):
    """The model in `folder`, built from its config with weightless parameters: each a CPU tensor of the
    right shape and dtype that repeats one element (stride 0), so it takes no memory. CPU rather than
    meta so that PEFT, which creates each adapter on its base layer's device, leaves the adapters on the
    CPU with their values (`defer_weights` then moves every parameter to meta).

    `quantization` (a 4-bit BitsAndBytesConfig): the layers from_pretrained would quantise become bitsandbytes'
    Linear4bit, each weight a placeholder of its packed bytes; the other layers' placeholders are fp32 already,
    the dtype QLoRA's preparation casts them to (cast from a stride-0 placeholder, each would be allocated)."""
    # deferred: transformers is slow to import
    from transformers import AutoConfig, AutoModelForCausalLM

    quiet_hf()  # as load_model: no progress bars, no deprecation notices that are not ours to fix
    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    attn_implementation = resolve(attn_implementation)
    with torch.device("meta"):  # draws nothing from the random generator, allocates nothing
        lm = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    if quantization is not None:
        _quantised_layers(lm, quantization, dtype)
    for module in lm.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if is_4bit(p):  # the packed bytes' shape: what quantize_4bit returns, (elements / 2, 1) for uint8
                rows = -(-p.numel() * 4 // (8 * p.quant_storage.itemsize))
                placeholder = type(p)(torch.empty((), dtype=p.quant_storage).expand(rows, 1), requires_grad=False,
                                      module=module, bnb_quantized=True,  # else moving it would quantise it
                                      **{k: getattr(p, k) for k in QUANT_SETTINGS})
                setattr(module, name, placeholder)
                continue
            as_dtype = torch.float32 if quantization is not None and p.dtype in (torch.float16, torch.bfloat16) \
                else p.dtype
            # each tied parameter once; swapping keeps it the same object, so still tied
            torch.utils.swap_tensors(p, torch.nn.Parameter(torch.empty((), dtype=as_dtype).expand(p.shape),
                                                           requires_grad=p.requires_grad))
    decoder = lm.get_decoder()
    decoder.rotary_emb = type(decoder.rotary_emb)(config=lm.config)  # real buffers, computed from the config
    unknown = [name for name, b in lm.named_buffers() if b.is_meta]
    if unknown:
        raise NotImplementedError(f"a sharded load cannot compute the buffers {unknown[:3]} of {type(lm).__name__}")
    return lm


def _quantised_layers(lm, quantization, dtype: torch.dtype) -> None:
    """Replace the layers from_pretrained quantises with bitsandbytes' 4-bit ones, on meta: the same call
    from_pretrained makes (transformers' quantizer, in the run's dtype), so the same layers, skipped layers
    and settings, and the same flags on the model (is_loaded_in_4bit: PEFT and k-bit preparation read it)."""
    from transformers.modeling_utils import local_torch_dtype  # deferred: transformers is slow to import
    from transformers.quantizers import AutoHfQuantizer  # deferred: as above

    quantizer = AutoHfQuantizer.from_config(quantization, pre_quantized=False)
    with torch.device("meta"), local_torch_dtype(dtype):
        quantizer.preprocess_model(lm, dtype=dtype, device_map=None)
    lm.hf_quantizer = quantizer
    quantizer.postprocess_model(lm)
    keep_4bit_layout(lm)  # as distlab.models.load_model does after a whole load


def is_4bit(t: torch.Tensor) -> bool:
    """Whether `t` is a bitsandbytes 4-bit weight (Params4bit), without importing bitsandbytes."""
    return all(hasattr(t, k) for k in QUANT_SETTINGS)


def defer_weights(model: torch.nn.Module, folder: Path, load_dtype: torch.dtype) -> torch.nn.Module:
    """Move a CausalLMWithLoss built on `empty_model` to meta, keeping (on the CPU) the values of the tensors
    the files do not hold; `fill` reads the rest, as `load_dtype`, once the strategy has sharded the model."""
    in_file = set(weight_files(folder))
    extras, quantised, unpacked = {}, {}, {}
    for name, t in named_tensors(model):
        if is_4bit(t):
            layer = model.causal_lm.get_submodule(name.rsplit(".", 1)[0])
            quantised[file_key(name)] = {k: getattr(t, k) for k in QUANT_SETTINGS}
            unpacked[id(t)] = (layer.out_features, layer.in_features)
        if file_key(name) in in_file:
            continue
        if t.numel() > 1 and not any(t.stride()):
            raise ValueError(f"{folder}: no tensor {file_key(name)!r} in the model's safetensors files")
        # LoRA adapters and non-persistent buffers (small): their values, kept without a copy (a freed copy would
        # stay in the heap through the load), as swapping the parameter to meta below leaves this view intact
        extras[name] = t.detach()
    for p in model.parameters():
        meta = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
        if id(p) in unpacked:  # models.count_parameters counts the weights a packed placeholder stands for
            meta.quantised_shape = unpacked[id(p)]
        torch.utils.swap_tensors(p, meta)
    model.pending_weights = PendingWeights(folder, extras, load_dtype, quantised)
    return model


def is_pending(model: torch.nn.Module) -> bool:
    """Whether the model has no weights yet (built by `defer_weights`): a strategy shards it before `fill`."""
    return getattr(model, "pending_weights", None) is not None


def fill(model: torch.nn.Module, device: torch.device | str, log_as: str = "",
         quantise_on: torch.device | str | None = None) -> dict:
    """Allocate this rank's part of every (sharded) tensor on `device` and read it in; returns what was read:
    bytes_read (from the files), largest_read (one slice, or one whole 4-bit weight), bytes_held (every tensor
    this rank allocated, a 4-bit layer's QuantState included) and file_bytes (the whole model in the files).
    A 4-bit base's weights are quantised on `quantise_on` (the run's device, where from_pretrained quantises;
    default `device`). Prints one line on rank 0 when `log_as` names the strategy."""
    pending: PendingWeights = model.pending_weights
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # each parameter stays one object: tied stay tied
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    files = weight_files(pending.folder)
    report = {"bytes_read": 0, "largest_read": 0, "bytes_held": 0, "file_bytes": 0}
    headers = {path: read_header(path) for path in set(files.values())}
    report["file_bytes"] = sum(path.stat().st_size for path in headers)
    with contextlib.ExitStack() as stack:
        # packing a weight allocates and frees blocks of MBs between the small ones kept: each given back at once
        stack.enter_context(large_blocks_returned() if pending.quantised else contextlib.nullcontext())
        with torch.no_grad():
            for name, t in named_tensors(model):
                local = t.to_local() if isinstance(t, DTensor) else t
                index = tuple(slice(o, o + s) for o, s in zip(*_local_box(t)))
                key = file_key(name)
                if name in pending.extras:
                    local.copy_(pending.extras[name][index])
                elif key in pending.quantised:
                    whole = read_whole(files[key], key)
                    layer = model.causal_lm.get_submodule(name.rsplit(".", 1)[0])
                    state = _quantise_into(local, index, whole, pending.quantised[key], pending.load_dtype,
                                           quantise_on or device, layer, sharded=isinstance(t, DTensor))
                    _count_read(report, whole)
                    report["bytes_held"] += sum(v.numel() * v.element_size() for v in quant_state_parts(state))
                    del whole, state
                    return_freed_memory()
                else:
                    part = read_part(files[key], headers[files[key]], key, index)
                    # as from_pretrained reads it, in the run's dtype; a layer QLoRA's preparation keeps in fp32 goes
                    # through the run's dtype first (bf16-rounded, as after a whole load and the preparation's cast)
                    local.copy_(part if local.dtype == pending.load_dtype else part.to(pending.load_dtype))
                    _count_read(report, part)
                report["bytes_held"] += local.numel() * local.element_size()
    model.pending_weights = None
    model.load_report = report
    if log_as and (not dist.is_initialized() or dist.get_rank() == 0):
        mb = 1 / 2**20
        print(f"[distlab] {log_as}: loaded this rank's shard of the weights only: read "
              f"{report['bytes_read'] * mb:.1f} MiB of the files' {report['file_bytes'] * mb:.1f} MiB", flush=True)
    return report


def _glibc():
    """The C library when it is glibc (it has malloc_trim), else None (macOS, musl)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


GLIBC = _glibc()


def return_freed_memory() -> None:
    """Give freed heap memory back to the system. Packing a weight allocates and frees buffers of tens of MB
    (the weight read whole, its fp32 copy, the kernel's temporaries); glibc serves such sizes from its heap
    once its mmap threshold has risen (after the first large free), and the small blocks a rank keeps (its
    packed rows, the scales) land above the freed ones, so without a trim the process's resident memory grows
    by the freed transients of every weight packed. A no-op where the C library is not glibc."""
    if GLIBC is not None:
        GLIBC.malloc_trim(0)


# glibc's mallopt parameters (malloc.h), and the values its dynamic rule settles on after the first large free on a
# 64-bit system: blocks from 32 MiB up get their own mapping, and the heap's top is trimmed above twice that
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
SETTLED_MMAP_THRESHOLD, SETTLED_TRIM_THRESHOLD = 32 << 20, 64 << 20


@contextlib.contextmanager
def large_blocks_returned(threshold: int = 1 << 20):
    """While open, glibc gives every block of `threshold` bytes or more a mapping of its own, so freeing it returns
    it to the system at once. ZeRO-3's load allocates each tensor whole (built, or gathered to be filled), keeps
    its partition and frees the rest; between the large frees lie the small blocks a rank keeps, so with glibc's
    default rule (blocks under 32 MiB from the heap once a large one was freed) the freed tensors stay resident,
    more on one rank than another from run to run (the 0.5B shape on 2 CPU ranks: 0.3 to 0.8 GiB above the
    same load with this context). On closing, the thresholds are those the default rule would have reached
    (so a step allocates as it would have), and what is free is returned. Nothing where the C library is not
    glibc."""
    if GLIBC is None:
        yield
        return
    GLIBC.mallopt(M_MMAP_THRESHOLD, threshold)
    try:
        yield
    finally:
        GLIBC.mallopt(M_MMAP_THRESHOLD, SETTLED_MMAP_THRESHOLD)
        GLIBC.mallopt(M_TRIM_THRESHOLD, SETTLED_TRIM_THRESHOLD)
        return_freed_memory()


def _count_read(report: dict, read: torch.Tensor) -> None:
    size = read.numel() * read.element_size()
    report["bytes_read"] += size
    report["largest_read"] = max(report["largest_read"], size)


def _quantise_into(local: torch.Tensor, index: tuple, whole: torch.Tensor, settings: dict, load_dtype: torch.dtype,
                   device, layer: torch.nn.Module, sharded: bool):
    """Quantise one whole weight as from_pretrained does (read as the run's dtype, packed on the run's device
    by the same bitsandbytes call: bit for bit its bytes and scales), keep this rank's rows of the packed bytes
    in `local`, and give the layer its QuantState, whole. Returns the state."""
    import bitsandbytes  # deferred: only a 4-bit base needs it

    packed, state = bitsandbytes.functional.quantize_4bit(
        whole.to(device=device, dtype=load_dtype).contiguous(), **settings)
    local.copy_(packed[index])
    layer.quant_state = state  # where Linear4bit's forward finds it for a weight FSDP gathers (a plain tensor)
    if not sharded:  # a weight no strategy cut: a 4-bit parameter again, as a whole load leaves it
        layer.weight = bitsandbytes.nn.Params4bit(local.detach(), requires_grad=False, quant_state=state, module=layer,
                                                  bnb_quantized=True, **settings)
    return state


SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def read_header(path: Path) -> tuple[int, dict]:
    """(where the tensors' bytes start, the header's entries) of a safetensors file."""
    with open(path, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        return 8 + header_size, json.loads(f.read(header_size))


def read_whole(path: Path, key: str) -> torch.Tensor:
    """One tensor of a safetensors file, read into its own memory (`read_part` of all of it)."""
    header = read_header(path)
    return read_part(path, header, key, tuple(slice(0, n) for n in header[1][key]["shape"]))


def read_part(path: Path, header: tuple[int, dict], key: str, index: tuple[slice, ...]) -> torch.Tensor:
    """The block `index` (one slice of step 1 per dimension) of one tensor of a safetensors file, read into
    its own memory with plain reads, without mapping the file: mapped, the pages read would stay in the
    process's resident memory while the file is open, as many as the kernel chose to map. The block is read
    as runs of consecutive bytes: one run when only the first dimension is cut (FSDP's rows), one per row
    when a later one is (a row-parallel weight's columns)."""
    data_start, entries = header
    entry = entries[key]
    if entry["dtype"] not in SAFETENSORS_DTYPES:
        raise ValueError(f"{path}: tensor {key!r}: dtype {entry['dtype']!r} is not a floating-point weight's")
    dtype, shape = SAFETENSORS_DTYPES[entry["dtype"]], list(entry["shape"])
    start, end = entry["data_offsets"]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if end - start != math.prod(shape) * itemsize:
        raise ValueError(f"{path}: tensor {key!r}: {end - start} bytes for shape {shape} of {entry['dtype']}")
    box = [range(*sl.indices(n)) for sl, n in zip(index, shape)]
    if any(r.step != 1 for r in box) or len(box) != len(shape):
        raise ValueError(f"{path}: tensor {key!r}: a block of {index} is not one slice per dimension")
    # the dimensions past `cut` are whole: each combination of indices before it starts one run of bytes
    cut = max([d for d, r in enumerate(box) if len(r) != shape[d]], default=0)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    run = len(box[cut]) * strides[cut] * itemsize if shape else itemsize
    out = torch.empty([len(r) for r in box], dtype=dtype)
    raw = out.view(-1).view(torch.uint8).numpy()
    with open(path, "rb") as f:
        for n, lead in enumerate(itertools.product(*box[:cut])):
            first = sum(i * strides[d] for d, i in enumerate(lead)) + (box[cut].start * strides[cut] if shape else 0)
            f.seek(data_start + start + first * itemsize)
            if f.readinto(raw[n * run:(n + 1) * run]) != run:
                raise ValueError(f"{path}: tensor {key!r} is cut short (the file ends inside its bytes)")
    return out


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
        with large_blocks_returned():  # every tensor is built or gathered whole, then freed: give each one back
            yield live
    finally:
        del live
