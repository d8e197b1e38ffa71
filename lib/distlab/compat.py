"""Every private or internal torch and DeepSpeed symbol distlab touches, in one place.

Public APIs cover what the tutorial teaches; a few measurements and one DeepSpeed feature need
more (which SDPA kernel PyTorch picks, the pipeline schedules' send/receive helpers, DeepSpeed's
instruction table, its layer partitioner, ZeRO's partition buffers). Each is listed in `SYMBOLS`
with the version it was checked against, and reached only through the accessors below. A symbol
that a release renames makes the accessor raise `PrivateAPIMissing` naming it, and the test over
`SYMBOLS` fails on upgrade: a figure is never silently drawn from a zero.

Tests (tests/unit/test_compat.py): every listed symbol exists in the installed versions, and no other
module of distlab reaches a private attribute of torch or DeepSpeed.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import re
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable

import torch

TORCH_CHECKED = "2.13.0"
DEEPSPEED_CHECKED = "0.19.8"


@dataclass(frozen=True)
class PrivateSymbol:
    package: str  # the distribution: torch or deepspeed
    owner: str  # module, or module:Class
    name: str
    instance: bool  # set on instances in the owner's code (checked in its source), not a class attribute
    checked: str  # the version it was checked against
    used_for: str

    @property
    def qualname(self) -> str:
        return f"{self.owner.replace(':', '.')}.{self.name}"


def _torch(owner: str, name: str, used_for: str, instance: bool = False) -> PrivateSymbol:
    return PrivateSymbol("torch", owner, name, instance, TORCH_CHECKED, used_for)


def _ds(owner: str, name: str, used_for: str, instance: bool = False) -> PrivateSymbol:
    return PrivateSymbol("deepspeed", owner, name, instance, DEEPSPEED_CHECKED, used_for)


_PIPE_SCHEDULES = "torch.distributed.pipelining.schedules"
_PIPE_STAGE = "torch.distributed.pipelining.stage:_PipelineStageBase"
_DS_PIPE_ENGINE = "deepspeed.runtime.pipe.engine:PipelineEngine"
_DS_PIPE_MODULE = "deepspeed.runtime.pipe.module:PipelineModule"
_ZERO2 = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer"
_ZERO3 = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3"

SYMBOLS: tuple[PrivateSymbol, ...] = (
    _torch("torch", "_fused_sdp_choice", "chapter 04's table of the SDPA backend PyTorch dispatches to"),
    _torch("torch.distributed", "_all_gather_base", "timing every collective (older all-gather name)"),
    _torch("torch.distributed", "_reduce_scatter_base", "timing every collective (older reduce-scatter name)"),
    _torch("torch.utils._python_dispatch", "TorchDispatchMode", "counting the collectives DTensor issues (ch. 07)"),
    _torch("torch:ops.aten", "_scaled_dot_product_flash_attention_for_cpu",
           "per-document attention on a CPU, its log-sum-exp kept for the backward (distlab.attention)"),
    _torch("torch:ops.aten", "_scaled_dot_product_flash_attention_for_cpu_backward",
           "per-document attention's backward on a CPU (distlab.attention)"),
    _torch("torch._dynamo", "maybe_mark_dynamic", "a compiled block takes the document count as a symbol"),
    _torch("torch._dynamo.config", "error_on_recompile", "the MFU ladder's compile rungs: a recompile is an error"),
    _torch("torch", "_foreach_copy_", "fp32 master weights copied into the bf16 weights in one call"),
    _torch(_PIPE_SCHEDULES, "_batch_p2p", "timing each stage-to-stage send/receive of a pipeline step"),
    _torch(_PIPE_SCHEDULES, "_wait_batch_p2p", "timing each stage-to-stage send/receive of a pipeline step"),
    _torch(_PIPE_STAGE, "forward_one_chunk", "time-stamping each micro-batch forward on a stage"),
    _torch(_PIPE_STAGE, "backward_one_chunk", "time-stamping each micro-batch backward on a stage"),
    _ds(_DS_PIPE_ENGINE, "_INSTRUCTION_MAP", "global-norm clipping across stages, and the pipeline timeline"),
    _ds(_DS_PIPE_ENGINE, "pipe_buffers", "bytes of each activation send/receive", instance=True),
    _ds(_DS_PIPE_ENGINE, "grad_layer", "bytes of each gradient receive", instance=True),
    _ds(_DS_PIPE_MODULE, "_partition_layers", "placing the same layers per stage as the torch pipeline"),
    _ds(_DS_PIPE_MODULE, "_set_bounds", "placing the same layers per stage as the torch pipeline"),
    _ds(_DS_PIPE_MODULE, "_topo", "this rank's stage coordinate while partitioning", instance=True),
    _ds("deepspeed.runtime.engine:DeepSpeedEngine", "_zero3_consolidated_16bit_state_dict",
        "saving a ZeRO-3 model as one from_pretrained folder"),
    _ds(_ZERO2, "grads_in_partition", "ZeRO-2 state measurement: gradient partition", instance=True),
    _ds(_ZERO2, "averaged_gradients", "ZeRO-2 state measurement: gradients before partitioning", instance=True),
    _ds(_ZERO2, "single_partition_of_fp32_groups", "ZeRO-2 state measurement: fp32 master partition",
        instance=True),
    _ds(_ZERO2, "ipg_buckets", "ZeRO-2 state measurement: reduce buckets", instance=True),
    _ds(_ZERO3, "fp32_partitioned_groups_flat", "ZeRO-3 state measurement: fp32 master partition", instance=True),
    _ds(_ZERO3, "grad_partitions_flat_buffer", "ZeRO-3 state measurement: gradient partition", instance=True),
    _ds(_ZERO3, "ipg_buckets", "ZeRO-3 state measurement: reduce buckets", instance=True),
    _ds("deepspeed.runtime.zero.partition_parameters", "ds_tensor",
        "ZeRO-3 state measurement: a parameter's own partition", instance=True),
)
NAMES = frozenset(s.name for s in SYMBOLS)


class PrivateAPIMissing(Exception):
    """A private symbol distlab relies on is not in the installed torch/DeepSpeed."""


def _installed(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _missing(sym: PrivateSymbol) -> PrivateAPIMissing:
    return PrivateAPIMissing(f"{sym.qualname} is not in {sym.package} {_installed(sym.package)} (distlab checked it "
                             f"against {sym.checked}; used for {sym.used_for}). Update distlab/compat.py.")


def _symbol(owner: str, name: str) -> PrivateSymbol:
    return next(s for s in SYMBOLS if s.owner == owner and s.name == name)


def _owner(sym: PrivateSymbol) -> Any:
    module, _, path = sym.owner.partition(":")  # "module:Class", or "module:attr.attr" (torch:ops.aten)
    obj = importlib.import_module(module)
    for part in path.split(".") if path else ():
        obj = getattr(obj, part)
    return obj


def is_present(sym: PrivateSymbol) -> bool:
    """Class/module attributes by lookup; attributes set on instances by an assignment in the owner's source."""
    try:
        owner = _owner(sym)
    except (ImportError, AttributeError):
        return False
    if not sym.instance:
        return hasattr(owner, sym.name)
    return re.search(rf"\.{re.escape(sym.name)}\s*(:[^=\n]+)?=", inspect.getsource(owner)) is not None


def missing_symbols() -> list[str]:
    return [f"{s.qualname} (checked against {s.package} {s.checked})" for s in SYMBOLS if not is_present(s)]


def _get(obj: Any, owner: str, name: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _missing(_symbol(owner, name)) from None


def _module_attr(owner: str, name: str) -> Any:
    return _get(importlib.import_module(owner), owner, name)


# ----------------------------------------------------------------------------- torch

def fused_sdp_choice(q, k, v, attn_mask, dropout_p: float, is_causal: bool) -> int:
    """The SDPBackend index scaled_dot_product_attention dispatches to for these inputs."""

    return int(_get(torch, "torch", "_fused_sdp_choice")(q, k, v, attn_mask, dropout_p, is_causal))


def collective_names() -> tuple[str, ...]:
    """torch.distributed's collectives that move tensor payloads, public and legacy-private names."""
    public = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
              "all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_reduce_coalesced",
              "all_gather_coalesced", "reduce")
    return public + ("_all_gather_base", "_reduce_scatter_base")


def torch_dispatch_mode() -> type:
    """The base class of a mode that sees every op the dispatcher runs (distlab.measure.collectives)."""
    return _module_attr("torch.utils._python_dispatch", "TorchDispatchMode")


@contextlib.contextmanager
def patched_pipeline_p2p(wrap_batch: Callable, wrap_wait: Callable):
    """Replace the pipeline schedules' batched send/receive helper and its wait for the duration:
    `wrap_batch(original)` and `wrap_wait(original)` return the replacements."""
    module = importlib.import_module(_PIPE_SCHEDULES)
    batch, wait = _module_attr(_PIPE_SCHEDULES, "_batch_p2p"), _module_attr(_PIPE_SCHEDULES, "_wait_batch_p2p")
    module._batch_p2p, module._wait_batch_p2p = wrap_batch(batch), wrap_wait(wait)
    try:
        yield
    finally:
        module._batch_p2p, module._wait_batch_p2p = batch, wait


def wrap_stage_chunks(stage, wrap_forward: Callable, wrap_backward: Callable) -> None:
    """Wrap one PipelineStage's per-micro-batch forward and backward (on the instance only)."""
    stage.forward_one_chunk = wrap_forward(_get(stage, _PIPE_STAGE, "forward_one_chunk"))
    stage.backward_one_chunk = wrap_backward(_get(stage, _PIPE_STAGE, "backward_one_chunk"))


def cpu_flash_attention(query, key, value, causal: bool, scale: float):
    """(output, log-sum-exp) of PyTorch's CPU flash attention, the pair its backward needs."""
    kernel = _get(torch.ops.aten, "torch:ops.aten", "_scaled_dot_product_flash_attention_for_cpu")
    return kernel(query, key, value, 0.0, causal, scale=scale)


def cpu_flash_attention_backward(grad_out, query, key, value, out, log_sum_exp, causal: bool, scale: float):
    """(grad query, grad key, grad value) of cpu_flash_attention."""
    kernel = _get(torch.ops.aten, "torch:ops.aten", "_scaled_dot_product_flash_attention_for_cpu_backward")
    return kernel(grad_out, query, key, value, out, log_sum_exp, 0.0, causal, scale=scale)


def mark_varying(tensor: torch.Tensor, dim: int) -> None:
    """Tell torch.compile that this dimension varies from call to call (no specialisation on its first value)."""
    _module_attr("torch._dynamo", "maybe_mark_dynamic")(tensor, dim)


def fail_on_recompile() -> None:
    """From now on a compiled function that would recompile raises instead, naming the guard that failed."""
    config = importlib.import_module("torch._dynamo.config")
    _get(config, "torch._dynamo.config", "error_on_recompile")
    config.error_on_recompile = True


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for every i, batched in as few kernels as the device allows."""
    _get(torch, "torch", "_foreach_copy_")(dst, src)


# ----------------------------------------------------------------------------- transformers

def attn_implementation(config) -> str | None:
    """The attention a transformers model runs, as its config resolved it: transformers keeps it private (no
    public getter in 5.x), and distlab.lm_loss must know whether a decoder uses per-document attention."""
    return getattr(config, "_attn_implementation", None)


# ----------------------------------------------------------------------------- DeepSpeed pipeline

def instruction_map(engine) -> dict:
    """A copy of the pipeline engine's instruction -> method table."""
    return dict(_get(type(engine), _DS_PIPE_ENGINE, "_INSTRUCTION_MAP"))


def set_instruction_map(engine, mapping: dict) -> None:
    """Give this engine (not its class) its own instruction table."""
    _get(type(engine), _DS_PIPE_ENGINE, "_INSTRUCTION_MAP")
    engine._INSTRUCTION_MAP = mapping


def pipe_buffer(engine, kind: str, buffer_id: int):
    return _get(engine, _DS_PIPE_ENGINE, "pipe_buffers")[kind][buffer_id]


def received_grad(engine):
    return _get(engine, _DS_PIPE_ENGINE, "grad_layer")


def pipeline_module_with_parts(base_cls):
    """A PipelineModule subclass that places layers by explicit boundaries `parts` (stage s owns
    specs parts[s]:parts[s+1]) instead of DeepSpeed's partition methods."""
    for name in ("_partition_layers", "_set_bounds"):
        _get(base_cls, _DS_PIPE_MODULE, name)

    class PartsPipelineModule(base_cls):
        def __init__(self, parts: list[int], *args, **kwargs):
            object.__setattr__(self, "distlab_parts", list(parts))  # before PipelineModule partitions
            super().__init__(*args, **kwargs)

        def _partition_layers(self, method="uniform"):
            self.parts = list(self.distlab_parts)
            stage = _get(self, _DS_PIPE_MODULE, "_topo").get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    return PartsPipelineModule


# ----------------------------------------------------------------------------- DeepSpeed ZeRO

def zero3_full_state_dict(engine, exclude_frozen: bool) -> dict:
    """ZeRO-3 weights gathered layer by layer onto rank 0 (empty dict on the others)."""
    fn = _get(engine, "deepspeed.runtime.engine:DeepSpeedEngine", "_zero3_consolidated_16bit_state_dict")
    return fn(exclude_frozen_parameters=exclude_frozen)


def zero_optimizer_buffers(optimizer, stage: int, params=()) -> dict[str, list]:
    """The tensors a ZeRO optimizer keeps for this rank, by what they hold (a missing attribute
    raises PrivateAPIMissing instead of counting 0):

      partitions  stage 3: each of `params`' own partition (`ds_tensor`), in the order given
      gradients   stage 2: `grads_in_partition` (whole tensors touching this rank's partition) and
                  `averaged_gradients`; stage 3: the flat fp32 partition buffer
      master      the fp32 master copy of this rank's partition of the trained weights
      buckets     the reduce buckets (`ipg_buckets`)
    A buffer DeepSpeed has released right now (None) is left out of every list but `partitions`."""
    if stage >= 3:
        partition_owner = "deepspeed.runtime.zero.partition_parameters"
        out = {"partitions": [_get(p, partition_owner, "ds_tensor") for p in params],
               "gradients": [_get(optimizer, _ZERO3, "grad_partitions_flat_buffer")],
               "master": list(_get(optimizer, _ZERO3, "fp32_partitioned_groups_flat"))}
        buckets = _get(optimizer, _ZERO3, "ipg_buckets")
    else:
        gradients = [_get(optimizer, _ZERO2, "grads_in_partition")]
        for group in _get(optimizer, _ZERO2, "averaged_gradients").values():
            gradients += list(group or [])
        out = {"partitions": [], "gradients": gradients,
               "master": list(_get(optimizer, _ZERO2, "single_partition_of_fp32_groups"))}
        buckets = _get(optimizer, _ZERO2, "ipg_buckets")
    out["buckets"] = []
    for bucket in buckets.values():
        buffer = bucket.buffer  # stage 2: a list of tensors; stage 3: one tensor or None
        out["buckets"] += list(buffer) if isinstance(buffer, (list, tuple)) else [buffer]
    # partitions stay aligned with `params`; elsewhere a released buffer (None) is dropped
    return {name: tensors if name == "partitions" else [t for t in tensors if torch.is_tensor(t)]
            for name, tensors in out.items()}
