"""The memory of loading: what one rank holds while the model loads, beside what a step holds.

A run fits a GPU only if both fit: `peak_bytes` is the larger of the two. Sharding divides what a rank
keeps; whether it also divides what a rank loads depends on how the weights arrive (distlab.sharded_load,
strategies.zero, strategies.staged):

  path         strategies                         device, at the worst moment of loading
  whole        single, ddp, zero2; and fsdp, tp,  the whole model; fsdp, tp and fsdp_tp also the shards of
               fsdp_tp for an int8 base or a      the layer being cut (its whole tensors are freed once cut,
               folder without safetensors         one layer after another)
  stage        pipeline, ds_pipeline              its stage (the other stages are dropped on the host)
  slices       fsdp, tp, fsdp_tp                  its own slices (allocated empty, filled slice by slice); over
                                                  a 4-bit base (fsdp), also one whole weight being packed; on the
                                                  host, LoRA's adapters whole (drawn on every rank from one seed
                                                  before the model is cut, read from until every slice is filled)
  partitioned  zero3                              its partition (and a tied LM head's, built untied), plus one
                                                  module's tensors gathered whole to be filled (twice that on
                                                  a CPU: gloo stages the gather): `partitioned_peak`

A quantised base loaded whole is quantised by bitsandbytes inside from_pretrained: the whole quantised replica,
plus the weight being packed (the largest is the worst): in the run's dtype, and its packed bytes. FSDP over a
4-bit base (FSDP + QLoRA) reads each quantised weight whole instead, one at a time, packs it on the device in
the run's dtype and keeps its rows of the packed bytes (distlab.sharded_load): beyond its share, a rank holds
that same one weight being packed. On a CPU, bitsandbytes' kernel allocates QUANTISE_SCRATCH_BYTES per element
while it packs, instead of the packed bytes.

The host side, per rank: transformers memory-maps a safetensors checkpoint, and the pages a rank reads count
in its resident memory, in the file's dtype: all of it (whole, stage; partitioned: rank 0 alone reads the
values, the other ranks only the keys and shapes). The slices path reads each slice with plain reads into a
buffer of its own instead (distlab.sharded_load.read_part), freed once copied: beyond what it keeps, a rank
holds the largest slice in the file's dtype (over a 4-bit base, or the largest quantised weight read whole,
if larger). On a GPU the whole and stage paths also build the model on the host before it moves; a quantised
load sends each tensor to the GPU as it reads it. On a CPU the device is the host: one process holds both.
"""

from __future__ import annotations

from dataclasses import dataclass

from distlab.config import PIPELINE_STRATEGIES
from distlab.planning.plan import (
    held_elements,
    is_quantised,
    plan_memory,
    quantisation_of,
    quantised_tensor_bytes,
    resolve_precision,
)
from distlab.planning.shapes import config_value, model_shape, parameter_count, parameter_layout

SLICE_STRATEGIES = ("fsdp", "tp", "fsdp_tp")  # read only their slices from a safetensors checkpoint
SHARDED_STRATEGIES = (*SLICE_STRATEGIES, "zero3")  # keep a part of every tensor
WHOLE_KEYS = ("dtype", "weight_bytes", "trainable_bytes", "lora_r", "lora_targets", "optimizer", "double_quant",
              "activation_bytes")  # what the one-device plan of the whole model takes from the run's settings


# bitsandbytes' CPU kernel packing one fp32 weight: its temporaries and output, bytes per element (measured on a
# 4096 x 4096 fp32 weight, bitsandbytes 0.50: 10.2; a bf16 weight adds its fp32 copy, 4 more)
QUANTISE_SCRATCH_BYTES = 10


def load_path(strategy: str, *, quantization: str | None = None, safetensors: bool = True) -> str:
    """How `strategy` loads (the table above): "whole", "stage", "slices" or "partitioned". `quantization`:
    the base's bitsandbytes format ("nf4", "int8"), None for a float base."""
    if strategy in PIPELINE_STRATEGIES:
        return "stage"
    if strategy in SLICE_STRATEGIES and quantization in (None, "nf4") and safetensors:
        return "slices"
    if strategy == "zero3" and quantization is None:
        return "partitioned"
    return "whole"


@dataclass
class LoadPeak:
    """One rank's memory while the model loads, in bytes."""

    strategy: str
    path: str  # a key of load_path's table
    device: float  # on its device at the worst moment (on a CPU run: part of `host`)
    host: float  # added to the rank's process: checkpoint pages read, the model built on the host, casts
    kept: float  # the weights and adapters it keeps once loaded (the step plan's)
    whole: float  # the whole model's weights and adapters, as one device holds them


def plan_load(config, *, strategy: str = "single", world_size: int = 1, rank: int | None = None,
              checkpoint_bytes: float = 2, safetensors: bool = True, on_gpu: bool = True, **plan_kwargs) -> LoadPeak:
    """What one rank holds while `config` loads for `strategy` on `world_size` ranks (see the module's table).
    plan_kwargs: plan_memory's settings of the run (dtype, lora_r, tp_size, ...). checkpoint_bytes: bytes per
    weight in the checkpoint file (2: bf16, as published models and distlab's saved presets are). rank None: the
    rank that keeps the most."""
    step = plan_memory(config, strategy=strategy, world_size=world_size, rank=rank, **plan_kwargs)
    one = plan_memory(config, strategy="single", **{k: v for k, v in plan_kwargs.items() if k in WHOLE_KEYS})
    kept, whole = step.weights + step.adapter_weights, one.weights + one.adapter_weights
    lora = bool(plan_kwargs.get("lora_r"))
    quantization = quantisation_of(plan_kwargs.get("dtype"), plan_kwargs.get("weight_bytes"))
    quantised = quantization is not None
    prec = resolve_precision(strategy, plan_kwargs.get("dtype"), lora=lora,
                             optimizer=plan_kwargs.get("optimizer", "adamw"),
                             weight_bytes=plan_kwargs.get("weight_bytes"),
                             trainable_bytes=plan_kwargs.get("trainable_bytes"),
                             activation_bytes=plan_kwargs.get("activation_bytes"))
    value_bytes = prec.weight_bytes if lora else prec.trainable_bytes  # a base weight as the run holds it
    file_whole = parameter_count(config) * checkpoint_bytes
    path = load_path(strategy, quantization=quantization, safetensors=safetensors)
    if quantised:  # bitsandbytes packs the quantised weights one at a time, whichever way they arrive
        # with adapters, so the base is frozen: bitsandbytes quantises frozen projections only (QLoRA is LoRA)
        layout = parameter_layout(config, plan_kwargs.get("lora_r") or 1, plan_kwargs.get("lora_targets"))
        packing = max(p.numel for p in layout if is_quantised(p))  # elements of the largest quantised weight
        run_bytes = 2 if on_gpu else 4  # the dtype it is read as and packed from: bf16 on a GPU, fp32 on a CPU
        # on a GPU: the weight in the run's dtype and its packed bytes; in one CPU process: its cast to the run's
        # dtype (if the file's differs) and the CPU kernel's temporaries
        packing_per_element = (run_bytes + 0.5) if on_gpu else \
            ((run_bytes if run_bytes != checkpoint_bytes else 0) + QUANTISE_SCRATCH_BYTES)
        packing_bytes = packing * packing_per_element
    if path == "slices":
        device = kept + (packing_bytes if quantised else 0.0)
        host = slices_fill_host(config, strategy, world_size, kept, prec, checkpoint_bytes, on_gpu, plan_kwargs,
                                quantization, packing_per_element if quantised else 0.0)
    elif path == "partitioned":  # transformers: rank 0 copies the values in while each module is gathered
        device, host = partitioned_peak(config, kept, value_bytes, checkpoint_bytes, world_size,
                                        reads_file=rank in (None, 0), on_gpu=on_gpu)
    elif path == "stage":
        device, pages = kept, file_whole
        host = pages + (whole if on_gpu else whole - kept)  # built whole on the host, the other stages dropped
    else:  # whole
        cutting = kept / config_value(config, "num_hidden_layers") if strategy in SHARDED_STRATEGIES else 0.0
        device = whole + cutting + (packing_bytes if quantised else 0.0)
        pages = file_whole
        host = pages + (whole if on_gpu and not quantised else 0.0)
    if path == "slices" and lora:  # the adapters as drawn, whole (distlab.sharded_load.defer_weights keeps them)
        host += one.adapter_weights
    if not on_gpu and path not in ("partitioned", "slices"):  # (those two follow the one process's memory)
        host += device
    return LoadPeak(strategy, path, device, host, kept, whole)


def slices_fill_host(config, strategy: str, world_size: int, kept: float, prec, checkpoint_bytes: float,
                     on_gpu: bool, plan_kwargs: dict, quantization: str | None, packing_per_element: float) -> float:
    """The host's part of a slices load (distlab.sharded_load.fill): each tensor, in the model's order, is read
    into a buffer of its own in the file's dtype (its slice; a quantised weight whole, to be packed) and freed
    once copied, so on a GPU the host holds the largest such read. On a CPU the device is the host: when tensor
    i is read, the slices filled before it are held too (allocated empty, a page is held once written), so the
    peak is the largest of (what is filled through i) + (what i reads, and packs)."""
    layout = parameter_layout(config, plan_kwargs.get("lora_r"), plan_kwargs.get("lora_targets"))
    held = held_elements(layout, strategy, world_size, plan_kwargs.get("tp_size"),
                         plan_kwargs.get("vocab_parallel", False))
    packs = [quantization is not None and is_quantised(p) for p in layout]
    # the adapters are not read: they are copied from the whole ones drawn before the model was cut
    reads = [0.0 if "lora_" in p.name else (p.numel if pack else h) * checkpoint_bytes
             for p, h, pack in zip(layout, held, packs)]
    if on_gpu:
        return max(reads)
    scratch = [p.numel * packing_per_element if pack else 0.0 for p, pack in zip(layout, packs)]
    kept_each = [h * (prec.trainable_bytes if p.trainable else quantised_tensor_bytes(p, quantization) / p.numel
                      if quantization else prec.weight_bytes) for p, h in zip(layout, held)]
    total, filled, peak = sum(kept_each), 0.0, 0.0
    for keeps, read, extra in zip(kept_each, reads, scratch):
        filled += keeps
        peak = max(peak, kept * filled / total + read + extra)  # `kept` as the step plan counts it, in order
    return peak


def partitioned_peak(config, kept: float, value_bytes: float, checkpoint_bytes: float, world_size: int,
                     reads_file: bool, on_gpu: bool) -> tuple[float, float]:
    """ZeRO-3's load as from_pretrained runs it under deepspeed.zero.Init: (device, host) at the worst moment.
    Every tensor is built and partitioned at once; a tied LM head is built as a tensor of its own, partitioned
    too, and dropped only when it is tied after loading. Then module after module, in the model's order, the
    module's tensors are gathered whole, rank 0 copies their values in from the checkpoint (whose pages stay
    mapped until the load ends) and they are partitioned again. Gloo's all-gather (a CPU run) stages its
    output in a buffer of its own, as large again (measured: +1,040 MiB while one 519 MiB tensor is gathered);
    NCCL gathers into the output. On a CPU the device is the host: the host value is the one process's peak."""
    s = model_shape(config)
    held = kept + (s["vocab"] * s["h"] * value_bytes / world_size if s["tied"] else 0.0)
    modules: dict[str, int] = {}  # elements per module, in the order transformers fills them
    for p in parameter_layout(config, None):
        module = p.name.rsplit(".", 1)[0]
        modules[module] = modules.get(module, 0) + p.numel
    copies = 1 if on_gpu else 2
    device = held + max(modules.values()) * value_bytes * copies
    if on_gpu:
        return device, (parameter_count(config) * checkpoint_bytes if reads_file else 0.0)
    host, pages = held, 0.0
    for numel in modules.values():
        gathered = numel * value_bytes
        host = max(host, held + pages + gathered * copies)  # while it is gathered
        pages += numel * checkpoint_bytes if reads_file else 0.0
        host = max(host, held + pages + gathered)  # while rank 0 copies its values in
    return device, host


def peak_bytes(config, *, strategy: str = "single", world_size: int = 1, **plan_kwargs) -> float:
    """A rank's device peak over the whole run: the larger of loading (`plan_load`) and a training step
    (`plan_memory`). Every "fits" verdict compares this with a card's usable memory."""
    step = plan_memory(config, strategy=strategy, world_size=world_size, **plan_kwargs)
    return max(step.total, plan_load(config, strategy=strategy, world_size=world_size, **plan_kwargs).device)
