"""What a rank actually holds, read from the live tensors: bytes of weights, LoRA adapters, gradients,
optimizer state and buffers (chapter 01 on one device, chapter 03 per rank under FSDP and ZeRO).

`measure_state(model, optimizer)` is the one state measurer. It takes a plain module (also inside
DDP), an FSDP2 module (a DTensor counts only its local shard) or a DeepSpeed ZeRO-2/3 engine
(DeepSpeed's own partitions, flat buffers and fp32 master copies). Call it inside a step, where the
gradients and the optimizer state both exist. Every storage is counted once, in the first category
that holds it, and a view into a flat buffer counts the whole buffer: that is what the rank holds.

`measure_activation_memory` counts what autograd saves for the backward pass.
(distlab.step_memory.measure_training_memory builds a run and measures one real step with both.)
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch.nn.parallel import DistributedDataParallel

from distlab import compat
from distlab.models import quant_state_parts
from distlab.results.schema import MemoryBreakdown

# ----------------------------------------------------------------------------- counting storages

def local_tensor(t):
    """The part of a tensor this rank stores: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def owned_bytes(tensors, seen: set | None = None) -> int:
    """Bytes of the storages behind `tensors`, each storage counted once (also across calls sharing
    `seen`). A view into a flat buffer (DeepSpeed's partitions, FSDP2's padded shards) counts the
    whole buffer: that is what the rank holds. Empty tensors (released ZeRO-3 weights) count 0."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = local_tensor(t)
        if t.numel() == 0:
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), str(t.device))
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def optimizer_state_tensors(optimizer) -> list[torch.Tensor]:
    """The tensors of a torch optimizer's state (moments), leaving out 0-d step counters, and the fp32 masters
    of a distlab.master_weights optimizer (state it keeps beside its inner optimizer's)."""
    out = list(getattr(optimizer, "master_params", ()))
    for state in getattr(optimizer, "state", {}).values():
        out += [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
    return out


def quant_state_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The constants bitsandbytes keeps beside each quantised weight, outside the module's parameters: a 4-bit
    weight's per-block absmax and NF4 code table (double-quantised: the 8-bit scales' own fp32 absmax, offset
    and code table too), an int8 weight's per-row fp32 scales (SCB). Empty for a model that is not quantised.
    Read from the weights and from their modules: under FSDP2 a weight is a DTensor shard that no longer
    carries its state, and bitsandbytes' Linear4bit keeps the same state whole on the module (`quant_state`)."""
    out = []
    holders = [*model.parameters(), *(m for m in model.modules() if getattr(m, "quant_state", None) is not None)]
    for holder in holders:
        out += quant_state_parts(getattr(holder, "quant_state", None))
        if torch.is_tensor(getattr(holder, "SCB", None)):
            out.append(holder.SCB)
    return out


def base_weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the frozen base: {"quantised": the quantised layers' stored values + constants, "unquantised": the
    tensors left in floating point (embeddings, norms, biases, LM head)}. All under "unquantised" if none is."""
    frozen = [p for p in dict.fromkeys(model.parameters()) if not p.requires_grad]
    packed = [p for p in frozen if hasattr(p, "quant_state") or hasattr(p, "SCB")]
    seen: set = set()
    quantised = owned_bytes(packed + quant_state_tensors(model), seen)
    return {"quantised": quantised, "unquantised": owned_bytes(frozen, seen)}


def _frozen_and_trained(params: Iterable[torch.Tensor]) -> tuple[list, list, list]:
    """(every parameter once, frozen ones, trained ones), in model order."""
    params = list(dict.fromkeys(params))
    return params, [p for p in params if not p.requires_grad], [p for p in params if p.requires_grad]


# ----------------------------------------------------------------------------- the one measurer

def measure_state(model: torch.nn.Module, optimizer=None) -> MemoryBreakdown:
    """Bytes of weights, adapters, gradients and optimizer state (and, under DeepSpeed, its reduce
    buckets as buffers) this process holds. Activations are left at 0 (measure_activation_memory).

    model: a plain module, a DistributedDataParallel wrapper, an FSDP2 (`fully_shard`) module or a
    DeepSpeed engine (recognised by its `zero_optimization_stage`). optimizer: the torch optimizer
    (None: no optimizer state); for an engine, its own ZeRO optimizer `engine.optimizer` (or None)."""
    if hasattr(model, "zero_optimization_stage"):
        if optimizer is not None and optimizer is not model.optimizer:
            raise ValueError(f"measure_state: a DeepSpeed engine's state is read from its own ZeRO optimizer; "
                             f"pass engine.optimizer or None, not a {type(optimizer).__name__}")
        return _measure_zero_engine(model, model.optimizer)
    if isinstance(model, DistributedDataParallel):
        model = model.module
    params, frozen, trained = _frozen_and_trained(model.parameters())
    seen: set = set()
    lora = bool(frozen)
    return MemoryBreakdown(
        weights=owned_bytes((frozen if lora else params) + quant_state_tensors(model), seen),
        adapter_weights=owned_bytes(trained, seen) if lora else 0,
        gradients=owned_bytes((p.grad for p in trained), seen),
        optimizer_state=owned_bytes(optimizer_state_tensors(optimizer) if optimizer is not None else [], seen))


def _measure_zero_engine(engine, optimizer) -> MemoryBreakdown:
    """Bytes this rank holds under DeepSpeed ZeRO, from the engine's own buffers.

    stage 2: weights are whole (trained ones are views into one flat buffer per optimizer group);
      gradients live in `grads_in_partition` (whole tensors that touch this rank's partition);
      optimizer state is the fp32 master partition plus the AdamW moments on it.
    stage 3: weights are each tensor's partition (`ds_tensor`, the trained ones inside one flat
      buffer) plus whatever is gathered right now (persistent small tensors); gradients are the
      flat fp32 partition buffer; optimizer state the fp32 master partition (a copy even for an fp32
      model in DeepSpeed 0.19.8) plus the moments.
    The reduce buckets are reported as buffers."""
    stage = engine.zero_optimization_stage()
    params, frozen, trained = _frozen_and_trained(engine.module.parameters())
    lora = bool(frozen)
    internals = compat.zero_optimizer_buffers(optimizer, stage, params)
    internals["moments"] = optimizer_state_tensors(optimizer.optimizer)  # the wrapped torch AdamW's state
    seen: set = set()
    if stage >= 3:
        # a rank holds each tensor's partition, plus the whole tensor while it is gathered (persistent ones)
        held = {id(p): [partition, p.data] for p, partition in zip(params, internals["partitions"])}
        weights = owned_bytes([t for p in (frozen if lora else params) for t in held[id(p)]], seen)
        adapters = owned_bytes([t for p in trained for t in held[id(p)]], seen) if lora else 0
        gradients = owned_bytes(internals["gradients"], seen)
    else:
        weights = owned_bytes(frozen if lora else params, seen)
        adapters = owned_bytes(trained, seen) if lora else 0
        gradients = owned_bytes(internals["gradients"] + [p.grad for p in trained], seen)
    state = owned_bytes(internals["master"] + internals["moments"], seen)
    return MemoryBreakdown(weights=weights, adapter_weights=adapters, gradients=gradients, optimizer_state=state,
                           buffers=owned_bytes(internals["buckets"], seen))


# ----------------------------------------------------------------------------- activations and one real step

def _saved_tensor_bytes(tensors) -> int:
    """numel x element size of each tensor, once per (storage, dtype). Unlike owned_bytes this counts
    the tensor rather than its whole storage: autograd saves slices and views of larger buffers."""
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def measure_activation_memory(model: torch.nn.Module, loss_fn) -> int:
    """Bytes of distinct tensors autograd saves for backward during `loss_fn(model)`.

    Parameters are excluded (they are counted as weights); a tensor saved by several ops is
    counted once. This is the activation memory a device must hold at the peak of the forward."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in param_ptrs:
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model)
    total = _saved_tensor_bytes(saved)
    saved.clear()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return total
