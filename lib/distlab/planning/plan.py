"""The bytes one rank holds while training, per parallelism strategy, from the model config alone:
`plan_memory` (chapter 03) and its one-device case `estimate_training_memory` (chapter 01).

Each strategy has one planner function, picked from `PLANNERS` by name; they share the resolved
inputs (`PlanSetup`: the parameter layout and the bytes per value). The layouts are the ones the
installed FSDP2 and DeepSpeed really use (per-parameter dim-0 shards; flat, padded partitions with
fp32 master copies), checked against measured per-rank bytes in tests/launches/test_fsdp_zero.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from distlab.config import (
    LORA_TARGETS,
    PIPELINE_STRATEGIES,
    STRATEGY_NAMES,
    ZERO3_PERSISTENCE_THRESHOLD,
    zero_bucket_elements,
)
from distlab.layer_split import split_layers
from distlab.planning.shapes import (
    ParamSpec,
    activation_bytes_estimate,
    layer_index,
    model_shape,
    optimizer_groups,
    parameter_layout,
)
from distlab.results.schema import MemoryBreakdown

# Optimizer state per trained weight with fp32 moments: AdamW's two (8 bytes), none for SGD, 8-bit AdamW's 2.
MOMENT_BYTES = {"adamw": 8, "sgd": 0, "adamw8bit": 2}
FP32_BYTES = 4  # an fp32 value: DeepSpeed's master copy of the trained weights, fp32 gradient buffers
ZERO_ALIGNMENT = 2  # ZeRO-1/2 pad each flat group to a multiple of 2 x world (DeepSpeed's nccl_start_alignment_factor)
ZERO_STRATEGIES = ("zero2", "zero3")

# dtype -> (bytes per stored weight, bytes per activation value). "bf16-autocast" keeps fp32 weights
# and computes in bf16 (torch autocast); DeepSpeed's bf16 mode instead stores the model in bf16 and
# keeps an fp32 master copy of the trained weights in its optimizer. int8/4bit/nf4/fp16 are planning
# shapes only (quantised or fp16 base weights); the trainer accepts TRAINER_DTYPES.
DTYPE_BYTES = {"fp32": (4, 4), "bf16-autocast": (4, 2), "fp16-autocast": (4, 2), "bf16": (2, 2), "fp16": (2, 2),
               "int8": (1, 2), "4bit": (0.5, 2), "nf4": (0.5, 2)}
# The dtypes distlab.train accepts (besides "auto"), planned exactly as the trainer lays them out (`precision`).
TRAINER_DTYPES = ("fp32", "bf16-autocast", "bf16", "fp16-autocast")

# A quantised base as bitsandbytes stores it (transformers' BitsAndBytesConfig, then PEFT's
# prepare_model_for_kbit_training), measured against this formula in tests/unit/test_qlora.py. Flat 0.5 or 1 byte per
# weight is what "4-bit" and "8-bit" suggest; what a rank holds differs in two ways that matter:
#  - only the decoder's linear layers are quantised. The embedding (on a small model most of the weights: the
#    tiny model's 3135 x 256 table is 40% of them), norms, biases and the LM head stay, and
#    prepare_model_for_kbit_training casts them to fp32 (UNQUANTISED_BYTES), whatever the load dtype;
#  - every quantised tensor carries constants: NF4 one fp32 absmax per block of 64 weights (+0.0625 byte per
#    weight, 12% of the 4-bit payload), or, double-quantised (QLoRA), one 8-bit scale per block plus one fp32
#    absmax per 256 blocks, an fp32 offset and a 256-entry fp32 code table; a 16-entry NF4 code table either way.
#    LLM.int8() keeps one fp32 scale per output row (SCB).
QUANT_DTYPES = {"int8": "int8", "4bit": "nf4", "nf4": "nf4"}  # planning dtype -> the bitsandbytes format planned
QUANT_BLOCK = 64  # weights per 4-bit block (bitsandbytes' blocksize for 4-bit, as transformers loads it)
NESTED_BLOCK = 256  # block scales per second-level block (double quantisation)
NF4_CODE_BYTES = 16 * FP32_BYTES  # the 16 NF4 levels, one table per tensor
NESTED_CODE_BYTES = 256 * FP32_BYTES  # the 8-bit dynamic code of the double-quantised scales, one per tensor
UNQUANTISED_BYTES = FP32_BYTES
QUANTISED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# bitsandbytes' 8-bit AdamW (adamw8bit): "2 bytes per weight" holds for large tensors only. It keeps fp32 moments
# (8 bytes) for tensors under BNB_MIN_8BIT_SIZE elements (LoRA's narrow factors on a small model), one fp32 absmax
# per block of BNB_STATE_BLOCK values of each moment, and two 256-entry code tables that every tensor shares.
BNB_MIN_8BIT_SIZE = 4096
BNB_STATE_BLOCK = 256
BNB_CODE_BYTES = 2 * 256 * FP32_BYTES


def adamw8bit_state_bytes(params: Sequence[ParamSpec]) -> float:
    """Bytes of bitsandbytes' 8-bit AdamW state for these trained tensors (whole, on one rank)."""
    small = sum(p.numel for p in params if p.numel < BNB_MIN_8BIT_SIZE) * MOMENT_BYTES["adamw"]
    large = [p for p in params if p.numel >= BNB_MIN_8BIT_SIZE]
    blocked = sum(2 * (p.numel + _chunk(p.numel, BNB_STATE_BLOCK) * FP32_BYTES) for p in large)
    return small + blocked + (BNB_CODE_BYTES if large else 0)


def is_quantised(p: ParamSpec) -> bool:
    """Whether bitsandbytes stores this frozen tensor quantised: the weight of a decoder projection (nn.Linear);
    not its bias, not the embedding, norms or the LM head (transformers keeps the output layer unquantised)."""
    return p.name.endswith(".weight") and p.name.split(".")[-2] in QUANTISED_PROJECTIONS and not p.trainable


def quantised_tensor_bytes(p: ParamSpec, quantization: str, double_quant: bool = True) -> float:
    """Bytes bitsandbytes holds for one frozen tensor of a `quantization` ("nf4", "int8") base, constants
    included; UNQUANTISED_BYTES per value for the tensors it leaves alone (`is_quantised`)."""
    return sum(quantised_parts(p, quantization, double_quant))


def quantised_parts(p: ParamSpec, quantization: str, double_quant: bool = True) -> tuple[float, float]:
    """(value bytes, constant bytes) of one frozen tensor as bitsandbytes stores it. The values are the
    parameter FSDP shards; the constants (absmax, code tables, int8 row scales) sit beside it, whole."""
    if not is_quantised(p):
        return p.numel * UNQUANTISED_BYTES, 0.0
    if quantization == "int8":
        return p.numel, p.shape[0] * FP32_BYTES  # int8 values + one fp32 scale per output row
    blocks = _chunk(p.numel, QUANT_BLOCK)
    if double_quant:
        scales = blocks + _chunk(blocks, NESTED_BLOCK) * FP32_BYTES + FP32_BYTES + NESTED_CODE_BYTES
    else:
        scales = blocks * FP32_BYTES
    return _chunk(p.numel, 2), scales + NF4_CODE_BYTES


def quantisation_of(dtype: str | None, weight_bytes: float | None) -> str | None:
    """The bitsandbytes format a run's base is planned in ("nf4", "int8"), or None for a float base: a planning
    dtype, or 1 / 0.5 bytes per weight without one (as the recommender asks)."""
    return QUANT_DTYPES.get(dtype) or ({1: "int8", 0.5: "nf4"}.get(weight_bytes) if dtype is None else None)


def moment_bytes(optimizer: str, value_bytes: float = FP32_BYTES) -> float:
    """Optimizer state bytes per trained weight (the one place the planner knows them). torch's AdamW
    keeps its two moments in the dtype of the tensor it updates (`value_bytes`: 4 for fp32 weights or
    DeepSpeed's fp32 master partition, 2 for weights stored in bf16); 8-bit AdamW keeps 2 bytes whatever."""
    if optimizer not in MOMENT_BYTES:
        raise ValueError(f"optimizer {optimizer!r}: one of {', '.join(MOMENT_BYTES)}")
    return MOMENT_BYTES[optimizer] * value_bytes / FP32_BYTES if optimizer == "adamw" else MOMENT_BYTES[optimizer]


@dataclass(frozen=True)
class Precision:
    """Bytes per value of everything a rank stores, for one dtype and strategy."""

    weight_bytes: float  # per stored base weight (the frozen ones with LoRA)
    trainable_bytes: float  # per trained weight (LoRA adapter, or base weight in full fine-tuning) and its .grad
    activation_bytes: float  # per activation value autograd keeps
    moment_bytes: float  # optimizer state per trained weight, for an optimizer updating the trained tensors
    zero_grad_bytes: float  # DeepSpeed's gradient accumulation dtype: its model dtype (bf16 in its bf16 mode)
    deepspeed_bf16: bool  # DeepSpeed's bf16 mode: the whole module cast to bf16, fp32 master copy


def precision(dtype: str, strategy: str = "single", lora: bool = True, optimizer: str = "adamw") -> Precision:
    """What distlab's trainer stores in `dtype` (one of TRAINER_DTYPES) under `strategy`, as
    distlab.device.choose_device, distlab.prepare and the strategies build it:

      fp32, fp16-autocast, bf16-autocast   fp32 weights (autocast computes in 16 bits: activations 2 bytes);
      bf16                                 weights stored in bf16, no autocast.
      LoRA                                 PEFT keeps its adapters in fp32 over a 16-bit base
                                           (autocast_adapter_dtype), so adapters, their gradients and moments
                                           are fp32 in every dtype ...
      zero2/zero3 + bf16-autocast          ... except in DeepSpeed's bf16 mode, which casts the whole module
                                           (adapters too) to bf16, accumulates gradients in bf16 (its
                                           grad_accum_dtype defaults to the model dtype) and keeps an fp32
                                           master copy + fp32 moments of its partition.
      torch AdamW (single, ddp, fsdp, pipelines) keeps its moments in the trained tensor's dtype: 4 bytes
      per weight for a full fine-tuning in bf16, 8 in fp32.
    The other strategies ignore autocast for storage: FSDP2's MixedPrecisionPolicy gathers bf16 copies
    of fp32 shards for compute only (transient), and DDP's gradients follow the weights."""
    if dtype not in TRAINER_DTYPES:
        raise ValueError(f"dtype {dtype!r}: the trainer accepts {', '.join(TRAINER_DTYPES)}")
    deepspeed_bf16 = strategy in ZERO_STRATEGIES and dtype == "bf16-autocast"
    stored = 2 if (dtype == "bf16" or deepspeed_bf16) else 4
    trained = stored if (deepspeed_bf16 or not lora) else FP32_BYTES
    return Precision(weight_bytes=stored, trainable_bytes=trained, activation_bytes=4 if dtype == "fp32" else 2,
                     moment_bytes=moment_bytes(optimizer, trained), zero_grad_bytes=2 if deepspeed_bf16 else FP32_BYTES,
                     deepspeed_bf16=deepspeed_bf16)


def resolve_precision(strategy: str, dtype: str | None, *, lora: bool, optimizer: str = "adamw",
                      weight_bytes: float | None = None, trainable_bytes: float | None = None,
                      activation_bytes: float | None = None) -> Precision:
    """The bytes plan_memory plans with. A trainer dtype (TRAINER_DTYPES) is laid out exactly as the
    trainer does (`precision`). Otherwise (no dtype, or a planning shape: int8, 4bit, nf4, fp16) the base
    weights take `weight_bytes` (or the dtype's), LoRA adapters fp32 (PEFT's), full fine-tuning trains the
    stored weights, and the optimizer state is fp32 (8 bytes for AdamW: the mixed-precision recipe of an
    fp32 optimizer state over 16-bit weights); ZeRO over 16-bit weights is DeepSpeed's bf16 mode (module,
    adapters and gradients in bf16), over fp32 weights DeepSpeed's fp32 mode. Explicit bytes override."""
    if dtype is not None and dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: one of {', '.join(DTYPE_BYTES)}")
    if dtype in TRAINER_DTYPES:
        base = precision(dtype, strategy, lora, optimizer)
        wb = base.weight_bytes if weight_bytes is None else float(weight_bytes)
        tb = base.trainable_bytes if trainable_bytes is None else float(trainable_bytes)
        ab = base.activation_bytes if activation_bytes is None else activation_bytes
        return Precision(wb, tb, ab, moment_bytes(optimizer, tb), base.zero_grad_bytes, base.deepspeed_bf16)
    shape_wb, shape_ab = DTYPE_BYTES[dtype] if dtype else (None, None)
    wb = float(weight_bytes if weight_bytes is not None else shape_wb if shape_wb is not None else FP32_BYTES)
    # 16-bit weights under ZeRO: DeepSpeed's bf16 mode (what distlab runs on a GPU, dtype auto = bf16-autocast)
    deepspeed_bf16 = strategy in ZERO_STRATEGIES and wb == 2
    tb = float(trainable_bytes) if trainable_bytes is not None else (FP32_BYTES if lora and not deepspeed_bf16 else wb)
    ab = activation_bytes if activation_bytes is not None else (shape_ab or (wb if wb >= 2 else 2))
    return Precision(wb, tb, ab, moment_bytes(optimizer), 2 if deepspeed_bf16 else FP32_BYTES, deepspeed_bf16)


def _chunk(n: int, parts: int) -> int:
    return -(-n // parts)


def _fsdp_shard(p: ParamSpec, world: int) -> int:
    """FSDP2 shards every parameter on dim 0 into `world` equal chunks, padding the last."""
    return _chunk(p.shape[0], world) * math.prod(p.shape[1:])


def _zero2_partitions(groups: list[list[ParamSpec]], world: int, rank: int) -> tuple[int, int, int]:
    """(flat elements, partition elements, elements of the parameters touching this rank's partition)
    summed over the optimizer groups, following DeepSpeed ZeRO-1/2: each group is flattened, padded
    to a multiple of 2 x world, and cut into `world` equal partitions. A rank keeps the gradients of
    every parameter that overlaps its partition *whole* (stage_1_and_2.py, grads_in_partition)."""
    flat = part = touching = 0
    align = ZERO_ALIGNMENT * world
    for group in groups:
        n = sum(p.numel for p in group)
        padded = _chunk(n, align) * align
        size = padded // world
        start, end = rank * size, (rank + 1) * size
        offset = 0
        for p in group:
            if start <= offset < end or offset < start < offset + p.numel:
                touching += p.numel
            offset += p.numel
        flat, part = flat + padded, part + size
    return flat, part, touching


@dataclass
class PlanSetup:
    """The inputs every strategy's planner shares, resolved once by plan_memory."""

    config: Any
    layout: list[ParamSpec]
    world_size: int
    weight_bytes: float  # per stored base weight
    trainable_bytes: float  # per trained weight and per gradient
    activation_bytes: float  # per activation value
    moment_bytes: float  # optimizer state per trained weight, updated in place (torch optimizers)
    master_moment_bytes: float  # optimizer state per weight of DeepSpeed's fp32 master partition
    zero_grad_bytes: float  # DeepSpeed's gradient accumulation dtype (bf16 in its bf16 mode, else fp32)
    activations: float  # one micro-batch through the whole model
    activation_args: tuple  # what activation_bytes_estimate took after bytes_per_value (to re-estimate parts)
    deepspeed_bf16: bool  # DeepSpeed's bf16 mode: bf16 model, fp32 master copy
    offload_optimizer: bool
    pipeline_stages: int
    stage_layers: Sequence[int] | None
    grad_accum: int
    zero3_persistence_threshold: int
    tp_size: int = 1  # fsdp_tp: ranks per tensor-parallel group
    vocab_parallel: bool = False  # tp: embedding and LM head cut by vocabulary rows, logits sliced
    quantization: str | None = None  # a bitsandbytes base ("nf4", "int8"): frozen bytes per tensor, not weight_bytes
    double_quant: bool = True
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        self.trained = [p for p in self.layout if p.trainable]
        self.frozen = [p for p in self.layout if not p.trainable]
        self.lora = bool(self.frozen)  # with LoRA the whole base model is frozen

    def frozen_bytes(self, held=lambda p: p.numel) -> float:
        """Bytes of the frozen tensors a rank holds, `held(p)` elements of each (its shard or slice; all of it by
        default): weight_bytes per element, or a quantised base's values in proportion plus each tensor's
        constants whole (`quantised_parts`: bitsandbytes keeps them beside the parameter that is cut)."""
        if not self.quantization:
            return sum(held(p) for p in self.frozen) * self.weight_bytes
        total = 0.0
        for p in self.frozen:
            values, constants = quantised_parts(p, self.quantization, self.double_quant)
            part = held(p)
            total += values * part / p.numel + (constants if part else 0.0)
        return total

    def split(self, frozen_bytes: float, trained_bytes: float) -> tuple[float, float]:
        """(weights, adapter_weights): LoRA adapters are reported apart from the base weights."""
        return (frozen_bytes, trained_bytes) if self.lora else (frozen_bytes + trained_bytes, 0.0)


# ----------------------------------------------------------------------------- one planner per strategy

def plan_single(s: PlanSetup, rank: int) -> MemoryBreakdown:
    """Everything on one device: weights, gradients of the trained ones, their optimizer state."""
    n_trained = sum(p.numel for p in s.trained)
    w, a = s.split(s.frozen_bytes(), n_trained * s.trainable_bytes)
    state = adamw8bit_state_bytes(s.trained) if s.optimizer == "adamw8bit" else n_trained * s.moment_bytes
    return MemoryBreakdown(w, a, n_trained * s.trainable_bytes, state, s.activations)


def plan_ddp(s: PlanSetup, rank: int) -> MemoryBreakdown:
    """A whole replica per rank, plus the gradient buckets DDP all-reduces from."""
    b = plan_single(s, rank)
    if s.world_size > 1:
        b.buffers = sum(p.numel for p in s.trained) * s.trainable_bytes
        b.notes.append("DDP all-reduces gradients from buckets that copy them (gradient_as_bucket_view=False)")
    return b


def plan_fsdp(s: PlanSetup, rank: int) -> MemoryBreakdown:
    """Every tensor cut in `world` dim-0 shards; the root and the layers being gathered as buffers."""
    world = s.world_size
    shard_t = sum(_fsdp_shard(p, world) for p in s.trained)
    w, a = s.split(s.frozen_bytes(lambda p: _fsdp_shard(p, world)), shard_t * s.trainable_bytes)
    b = MemoryBreakdown(w, a, shard_t * s.trainable_bytes, shard_t * s.moment_bytes, s.activations)
    layer = [p for p in s.layout if layer_index(p) == 0]
    root = [p for p in s.layout if layer_index(p) is None]
    compute_b = min(s.weight_bytes, s.activation_bytes) if s.weight_bytes >= 2 else 2
    b.buffers = (sum(p.numel for p in root) + 2 * sum(p.numel for p in layer)) * compute_b + \
        sum(p.numel for p in layer if p.trainable) * FP32_BYTES
    b.notes.append("buffers (estimate): the root's weights (embedding, LM head) stay gathered through the "
                   "step, plus the layer being all-gathered and the next one, prefetched")
    return b


def plan_zero2(s: PlanSetup, rank: int) -> MemoryBreakdown:
    """Weights replicated; the flat trained weights cut into partitions, each rank keeping the fp32
    master copy and moments of its own, and the gradients of the tensors that touch it (whole)."""
    tb, accum = s.trainable_bytes, s.zero_grad_bytes
    flat, part, touching = _zero2_partitions(optimizer_groups(s.layout), s.world_size, rank)
    w, a = s.split(s.frozen_bytes(), flat * tb)
    # DeepSpeed 0.19.8 (stage_1_and_2.py): when the trained weights are in its accumulation dtype it copies
    # each reduced gradient, whole, into `grads_in_partition` (every tensor touching this rank's partition);
    # 16-bit weights with fp32 accumulation use a compact fp32 buffer of the partition alone instead.
    whole = tb == accum
    grads = touching * tb if whole else part * accum
    opt = part * (FP32_BYTES + s.master_moment_bytes)
    b = MemoryBreakdown(w, a, grads, 0.0 if s.offload_optimizer else opt, s.activations)
    b.buffers = zero_bucket_elements(sum(p.numel for p in s.trained)) * accum
    b.notes.append(f"optimizer state = fp32 master copy + moments of a {part:,}-element partition "
                   f"({opt / 2**20:.1f} MiB)" + (" on the CPU (offload)" if s.offload_optimizer else ""))
    if whole:
        b.notes.append(f"gradients: DeepSpeed keeps whole tensors that straddle a partition boundary "
                       f"({touching:,} elements for a {part:,}-element partition)")
    return b


def plan_zero3(s: PlanSetup, rank: int) -> MemoryBreakdown:
    """Every tensor partitioned (weights, fp32 gradients, fp32 master copy, moments); tensors under
    the persistence threshold are also kept whole on every rank."""
    world, threshold = s.world_size, s.zero3_persistence_threshold
    def held(p):
        return _chunk(p.numel, world) + (p.numel if p.numel <= threshold else 0)

    held_t = sum(held(p) for p in s.trained)
    w, a = s.split(s.frozen_bytes(held), held_t * s.trainable_bytes)
    part_t = sum(_chunk(p.numel, world) for p in s.trained)
    # DeepSpeed means to update an fp32 model's partition in place, but 0.19.8 compares a
    # torch.device with a string there (never equal), so it always keeps an fp32 master copy.
    master = part_t * FP32_BYTES
    opt = part_t * s.master_moment_bytes + master
    # gradients: one flat partition buffer in DeepSpeed's accumulation dtype (bf16 in its bf16 mode)
    b = MemoryBreakdown(w, a, part_t * s.zero_grad_bytes, 0.0 if s.offload_optimizer else opt, s.activations)
    largest_layer = sum(p.numel for p in s.layout if layer_index(p) == 0)
    b.buffers = (zero_bucket_elements(sum(p.numel for p in s.trained)) * s.zero_grad_bytes
                 + 2 * largest_layer * s.weight_bytes)
    n_persistent = sum(1 for p in s.layout if p.numel <= threshold)
    b.notes.append(f"{n_persistent} of {len(s.layout)} tensors are at most {threshold:,} elements: "
                   "every rank keeps them whole (stage3_param_persistence_threshold)")
    return b


def plan_pipeline(s: PlanSetup, rank: int) -> MemoryBreakdown:
    """This rank's stage: its layers (first stage: embedding; last: norm, LM head, the loss's logits),
    data-parallel over world / stages replicas, the activations of the micro-batches in flight (1F1B).
    torch.distributed.pipelining and DeepSpeed's PipelineModule (ZeRO stage 0) hold the same."""
    shape = model_shape(s.config)
    stages = s.pipeline_stages
    stage = rank % stages
    layers = split_layers(shape["layers"], stages, s.stage_layers)[stage]
    last = stage == stages - 1

    def in_stage(p: ParamSpec) -> bool:
        if layer_index(p) is not None:
            return layer_index(p) in layers
        if p.name == "model.embed_tokens.weight":
            return stage == 0 or (last and shape["tied"])
        return last  # final norm, untied LM head

    mine = [p for p in s.layout if in_stage(p)]
    names = {p.name for p in mine}
    t = sum(p.numel for p in mine if p.trainable)
    w, a = s.split(s.frozen_bytes(lambda p: p.numel if p.name in names else 0), t * s.trainable_bytes)
    in_flight = min(stages - stage, max(s.grad_accum, 1))
    micro_batch, seq_len, ckpt, lora_r, targets, lora_dropout, _, _ = s.activation_args
    layer_acts = activation_bytes_estimate(s.config, micro_batch, seq_len, s.activation_bytes, ckpt, lora_r, targets,
                                           lora_dropout, 0.0)  # every layer, without the loss's logits
    share = layer_acts * len(layers) / shape["layers"] * in_flight
    if last:
        share += s.activations - layer_acts
    b = MemoryBreakdown(w, a, t * s.trainable_bytes, t * s.moment_bytes, share)
    if s.world_size // stages > 1:
        b.buffers = t * s.trainable_bytes
    span = f"{layers.start}-{layers.stop - 1}" if len(layers) else "none"
    b.notes.append(f"stage {stage} of {stages}: layers {span}, {in_flight} micro-batch(es) in flight (1F1B)")
    return b


TP_SPLIT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # strategies.tp's plan
TP_ROWWISE = ("o_proj", "down_proj")
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")  # cut by vocabulary rows with vocab_parallel


def tp_sliced(name: str) -> bool:
    """Whether strategies.tp's plan cuts this tensor: the projections (weights and biases), and of a LoRA
    adapter the factor on the split side (lora_B of a column-parallel projection, lora_A of a row-parallel one)."""
    for proj in TP_SPLIT:
        if f".{proj}." in f".{name}.":
            if ".lora_A." in name:
                return proj in TP_ROWWISE
            if ".lora_B." in name:
                return proj not in TP_ROWWISE
            return True
    return False


def tp_held(p: ParamSpec, world: int, vocab_parallel: bool = False) -> int:
    """Elements of `p` one tensor-parallel rank holds: a slice of the tensors `tp_sliced` names (and of the
    embedding and LM head when `vocab_parallel` cuts them), the whole of the rest."""
    sliced = tp_sliced(p.name) or (vocab_parallel and p.name in VOCAB_TENSORS)
    return _chunk(p.numel, world) if sliced else p.numel


def fsdp_tp_held(p: ParamSpec, tp: int, dp: int) -> int:
    """Elements of `p` one rank of a (dp, tp) mesh holds: its tp slice (or the whole tensor), cut in dp shards."""
    return _chunk(_chunk(p.numel, tp), dp) if tp_sliced(p.name) else _fsdp_shard(p, dp)


def resolve_tp_size(strategy: str, world_size: int, tp_size: int | None) -> int:
    """Ranks per tensor-parallel group: as given, else 2 for fsdp_tp and every rank for tp."""
    return tp_size or (2 if strategy == "fsdp_tp" else world_size)


def held_elements(layout: Sequence[ParamSpec], strategy: str, world_size: int, tp_size: int | None = None,
                  vocab_parallel: bool = False) -> list[int]:
    """Elements of each tensor of `layout` that a rank of fsdp, tp or fsdp_tp holds (the rank holding the most):
    what a sharded load reads of it. tp keeps the embedding whole unless `vocab_parallel`."""
    tp = resolve_tp_size(strategy, world_size, tp_size)
    held = {"fsdp": lambda p: _fsdp_shard(p, world_size),
            "tp": lambda p: tp_held(p, world_size, vocab_parallel),
            "fsdp_tp": lambda p: fsdp_tp_held(p, tp, world_size // tp)}[strategy]
    return [held(p) for p in layout]


def plan_tp(s: PlanSetup, rank: int) -> MemoryBreakdown:
    """Tensor parallelism: every decoder layer's projections (and the q/k/v biases, and one LoRA factor of each
    adapted projection: `tp_sliced`) cut in `world` slices; the norms whole on every rank, and the embedding and LM
    head too unless `vocab_parallel` cuts them by vocabulary rows.
    Activations: the layer inputs and outputs whole, the per-head and FFN-width ones sliced."""
    def held(p):
        return tp_held(p, s.world_size, s.vocab_parallel)

    held_t = sum(held(p) for p in s.trained)
    w, a = s.split(s.frozen_bytes(held), held_t * s.trainable_bytes)
    b = MemoryBreakdown(w, a, held_t * s.trainable_bytes, held_t * s.moment_bytes, s.activations)
    b.notes.append("each layer's q/k/v/o and gate/up/down sliced over the ranks" +
                   ("; embedding and LM head cut by vocabulary rows" if s.vocab_parallel else "; the rest replicated"))
    return b


def plan_fsdp_tp(s: PlanSetup, rank: int) -> MemoryBreakdown:
    """FSDP x TP on a (world / tp, tp) mesh: each projection cut in tp slices (as plan_tp), then every tensor,
    slice or whole, cut in dp dim-0 shards by FSDP (as plan_fsdp); buffers: the root and a gathered layer
    and its prefetched successor, each only the rank's tp slice of it."""
    tp = s.tp_size
    dp = s.world_size // tp

    def held(p):
        return fsdp_tp_held(p, tp, dp)

    def gathered(p):
        return _chunk(p.numel, tp) if tp_sliced(p.name) else p.numel

    held_t = sum(held(p) for p in s.trained)
    w, a = s.split(s.frozen_bytes(held), held_t * s.trainable_bytes)
    b = MemoryBreakdown(w, a, held_t * s.trainable_bytes, held_t * s.moment_bytes, s.activations)
    layer = [p for p in s.layout if layer_index(p) == 0]
    root = [p for p in s.layout if layer_index(p) is None]
    compute_b = min(s.weight_bytes, s.activation_bytes) if s.weight_bytes >= 2 else 2
    b.buffers = (sum(p.numel for p in root) + 2 * sum(gathered(p) for p in layer)) * compute_b
    b.notes.append(f"projections sliced over tp={tp} ranks, then every tensor sharded over dp={dp} groups")
    return b


PLANNERS = {"single": plan_single, "ddp": plan_ddp, "fsdp": plan_fsdp, "zero2": plan_zero2, "zero3": plan_zero3,
            "pipeline": plan_pipeline, "ds_pipeline": plan_pipeline, "tp": plan_tp, "fsdp_tp": plan_fsdp_tp}
REPLICATED = ("single", "ddp")  # every rank holds the same: plan rank 0 only


def plan_memory(config, *, strategy: str = "single", world_size: int = 1, dtype: str | None = None,
                weight_bytes: float | None = None, trainable_bytes: float | None = None,
                lora_r: int | None = None, lora_targets=None, micro_batch: int = 1, seq_len: int = 1024,
                activation_checkpointing: bool = False, optimizer: str = "adamw",
                activation_bytes: float | None = None, lora_dropout: float = 0.0, loss_token_fraction: float = 1.0,
                pipeline_stages: int | None = None, stage_layers: Sequence[int] | None = None, grad_accum: int = 1,
                offload_optimizer: bool = False, zero3_persistence_threshold: int = ZERO3_PERSISTENCE_THRESHOLD,
                rank: int | None = None, tp_size: int | None = None, double_quant: bool = True,
                vocab_parallel: bool = False, cross_entropy: str = "chunked") -> MemoryBreakdown:
    """Predicted bytes one rank holds while training `config` with `strategy` on `world_size` ranks.

    config: any HF causal-LM config (object or dict) of the Llama/Qwen family. dtype: one the trainer
    accepts (TRAINER_DTYPES: "fp32", "bf16-autocast", "fp16-autocast", "bf16"), planned as the trainer
    lays it out (`precision`: e.g. torch AdamW's moments in bf16 for a full fine-tuning stored in bf16,
    PEFT's fp32 adapters, DeepSpeed's bf16 mode for bf16-autocast under ZeRO), or a planning shape
    "int8", "4bit", "nf4", "fp16" (frozen base weights quantised: LoRA only); or give weight_bytes (and
    activation_bytes) directly (`resolve_precision` says how those are read). lora_r None: full
    fine-tuning. A quantised base ("int8", "4bit"/"nf4", or weight_bytes 1 / 0.5 without a dtype) is planned as
    bitsandbytes stores it (`quantised_tensor_bytes`: projections quantised with their constants, `double_quant`
    as QLoRA's default, every other tensor in fp32). rank None: the rank that needs the most (ranks differ
    slightly where partitions cut tensors unevenly); an int: that rank. pipeline_stages / stage_layers: the
    pipelines' split (distlab.layer_split.split_layers: balanced by default).

    What each strategy holds, per rank, with N parameters, T of them trained:
      single, ddp   everything: weights, T gradients, AdamW's two moments per trained weight.
                    DDP adds its gradient buckets (a copy of the gradients) as buffers.
      zero2         weights replicated; the flat trained weights cut into `world` partitions, each
                    rank keeping the fp32 master copy and moments of its partition, and the
                    gradients of the tensors that touch it (whole tensors, as DeepSpeed does).
      fsdp          every tensor cut in `world` dim-0 shards: weights, gradients and moments / world;
                    buffers for the layer being all-gathered (and the next one, prefetched).
      zero3         every tensor partitioned (weights, gradients, fp32 master copy, moments);
                    tensors under DeepSpeed's persistence threshold (100k elements: LoRA adapters,
                    norms, biases, small projections) are also kept whole on every rank.
      pipeline,     layers divided over `pipeline_stages` stages (first stage: embedding, last: norm
      ds_pipeline   and LM head), DDP across world / stages replicas; activations of the micro-batches
                    in flight (1F1B: stages - stage index).
      tp            each decoder layer's projections cut in `world` slices (strategies.tp's plan; with LoRA,
                    one factor of each adapter too); embedding, norms and LM head whole on every rank, or
                    with `vocab_parallel` the embedding and head (and the logits) cut by vocabulary rows.
      fsdp_tp       the projections cut in `tp_size` slices (default 2), then every tensor sharded by FSDP
                    over the world / tp_size groups.
    """
    if strategy not in PLANNERS:
        raise ValueError(f"unknown strategy {strategy!r}; one of {', '.join(STRATEGY_NAMES)}")
    if strategy == "single":
        world_size = 1
    stages = pipeline_stages or world_size
    tp = resolve_tp_size(strategy, world_size, tp_size)
    if strategy == "fsdp_tp" and world_size % tp:
        raise ValueError(f"world_size {world_size} is not a multiple of tp_size {tp}")
    if vocab_parallel and strategy != "tp":
        raise ValueError(f"vocab_parallel is a setting of strategy tp, not {strategy!r}")
    if strategy in PIPELINE_STRATEGIES and world_size % stages:
        raise ValueError(f"world_size {world_size} is not a multiple of pipeline_stages {stages}")
    if strategy == "zero3":  # the head weight is a ZeRO-3 partition there: the plain cross entropy (distlab.lm_loss)
        cross_entropy = "plain"
    prec = resolve_precision(strategy, dtype, lora=bool(lora_r), optimizer=optimizer, weight_bytes=weight_bytes,
                             trainable_bytes=trainable_bytes, activation_bytes=activation_bytes)
    wb, tb, act_b = prec.weight_bytes, prec.trainable_bytes, prec.activation_bytes
    if wb < 2 and not lora_r:
        raise ValueError("quantised base weights (weight_bytes < 2) can only be trained through LoRA adapters")
    quantization = quantisation_of(dtype, wb)
    targets = list(lora_targets or LORA_TARGETS)
    activation_args = (micro_batch, seq_len, activation_checkpointing, lora_r, targets, lora_dropout,
                       loss_token_fraction, cross_entropy)
    setup = PlanSetup(
        config=config, layout=parameter_layout(config, lora_r, targets), world_size=world_size, weight_bytes=wb,
        trainable_bytes=tb, activation_bytes=act_b, moment_bytes=prec.moment_bytes,
        master_moment_bytes=moment_bytes(optimizer), zero_grad_bytes=prec.zero_grad_bytes,
        activations=activation_bytes_estimate(config, micro_batch, seq_len, act_b, activation_checkpointing,
                                              lora_r, targets, lora_dropout, loss_token_fraction,
                                              tp=tp if strategy in ("tp", "fsdp_tp") else 1,
                                              vocab_tp=tp if vocab_parallel else 1, cross_entropy=cross_entropy),
        activation_args=activation_args, deepspeed_bf16=prec.deepspeed_bf16, offload_optimizer=offload_optimizer,
        pipeline_stages=stages, stage_layers=stage_layers, grad_accum=grad_accum,
        zero3_persistence_threshold=zero3_persistence_threshold, tp_size=tp, quantization=quantization,
        double_quant=double_quant, optimizer=optimizer, vocab_parallel=vocab_parallel)
    planner = PLANNERS[strategy]
    if strategy in REPLICATED:
        return planner(setup, 0)
    if rank is not None:
        return planner(setup, rank)
    return max((planner(setup, r) for r in range(world_size)), key=lambda b: b.total)


def estimate_training_memory(config, *, weight_bytes: float | None = None, lora_r: int | None = 16, lora_targets=None,
                             trainable_bytes: float | None = None, micro_batch: int = 1, seq_len: int = 1024,
                             activation_bytes: float | None = None, activation_checkpointing: bool = False,
                             optimizer: str = "adamw", lora_dropout: float = 0.05,
                             loss_token_fraction: float = 1.0, dtype: str | None = None,
                             cross_entropy: str = "chunked") -> MemoryBreakdown:
    """Bytes held by one rank training on one device: plan_memory's "single" case, with chapter 01's
    defaults (LoRA r=16, fp32 weights and adapters, LoRA dropout on).

    weight_bytes: bytes per frozen/base weight (4 fp32, 2 bf16, 1 int8, 0.5 for 4-bit). dtype: one the
    trainer accepts, laid out as it does (plan.precision), instead of bytes.
    lora_r None: full fine-tuning (base weights are trained: `trainable_bytes` each, default their
    stored bytes, with gradients and AdamW state for all). Without a trainer dtype AdamW keeps two
    moments per trained weight in fp32 (8 bytes)."""
    return plan_memory(config, strategy="single", dtype=dtype, weight_bytes=weight_bytes,
                       trainable_bytes=trainable_bytes, lora_r=lora_r, lora_targets=lora_targets,
                       micro_batch=micro_batch, seq_len=seq_len,
                       activation_bytes=activation_bytes, activation_checkpointing=activation_checkpointing,
                       optimizer=optimizer, lora_dropout=lora_dropout, loss_token_fraction=loss_token_fraction,
                       cross_entropy=cross_entropy)
