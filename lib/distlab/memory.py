"""Where training memory goes: weights, adapter weights, gradients, optimizer state, activations.

`estimate_training_memory` predicts bytes per rank from a model config alone (any HF causal-LM
config: a 7B model needs no weights to be planned for). `measure_state_memory` sums the tensors a
live model and optimizer actually hold, and `measure_activation_memory` counts what autograd
saves for the backward pass during one real forward, so estimates can be checked against runs
on any device, CPU included.

Chapter 03 adds the planner: `plan_memory` predicts the bytes *each rank* holds under a
parallelism strategy (single, ddp, fsdp, zero2, zero3, pipeline), laid out the way the installed
FSDP2 and DeepSpeed actually lay them out (per-parameter dim-0 shards; flat, padded partitions with
fp32 master copies), `measure_owned_state` sums the tensors a rank really owns (local shards,
DeepSpeed partitions), and `recommend` walks the LAN-cluster guide's decision tree with the
planner's numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch

GIB = 1024**3

# Published shapes (the models' config.json), so 7B-class models can be planned without weights.
# Llama-2-7B replays the LAN-cluster seed's "7B on a 12 GB GPU" table.
LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False, model_type="llama")
# The enterprise and benchmark seeds' models (Qwen2 has q/k/v biases; Qwen3 has q/k RMSNorms instead).
QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, model_type="qwen2")
QWEN25_3B = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, model_type="qwen2")
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                 model_type="qwen3")
SEED_MODELS = {"Llama-2-7B": LLAMA2_7B, "Qwen2.5-7B-Instruct": QWEN25_7B, "Qwen2.5-3B-Instruct": QWEN25_3B,
               "Qwen3-0.6B": QWEN3_06B}
# The LAN-cluster seed's three GPUs (memory in GiB, as GPU makers count it).
LAN_CLUSTER = [{"name": "RTX 5070 Ti", "memory_gb": 12}, {"name": "RTX 4070", "memory_gb": 8},
               {"name": "RTX 3070 Ti", "memory_gb": 8}]

_COMPONENTS = ("weights", "adapter_weights", "gradients", "optimizer_state", "activations", "buffers")


@dataclass
class MemoryBreakdown:
    weights: float = 0.0  # frozen or trained base weights
    adapter_weights: float = 0.0  # LoRA A/B (0 for full fine-tuning)
    gradients: float = 0.0
    optimizer_state: float = 0.0  # AdamW moments, plus DeepSpeed's fp32 master copy of trained weights
    activations: float = 0.0
    buffers: float = 0.0  # communication buffers: DDP buckets, FSDP all-gathers, DeepSpeed reduce buckets
    notes: list[str] = field(default_factory=list, repr=False, compare=False)

    @property
    def state(self) -> float:
        """Weights, adapters, gradients and optimizer state: what sharding divides."""
        return self.weights + self.adapter_weights + self.gradients + self.optimizer_state

    @property
    def total(self) -> float:
        return self.state + self.activations + self.buffers

    def as_dict(self) -> dict[str, float]:
        out = {k: getattr(self, k) for k in _COMPONENTS}
        if not self.buffers:  # the single-device tables of chapters 01/02 have no buffers row
            del out["buffers"]
        return {**out, "total": self.total}


def _shape(config) -> dict[str, int]:
    get = (lambda k, d=None: config.get(k, d)) if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    h, heads = get("hidden_size"), get("num_attention_heads")
    head_dim = get("head_dim") or h // heads
    return dict(h=h, ffn=get("intermediate_size"), layers=get("num_hidden_layers"), heads=heads,
                kv=(get("num_key_value_heads") or heads), head_dim=head_dim, vocab=get("vocab_size"),
                tied=bool(get("tie_word_embeddings", False)))


def linear_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection in one Llama/Qwen2 decoder layer."""
    s = _shape(config)
    q, kv = s["heads"] * s["head_dim"], s["kv"] * s["head_dim"]
    return {"q_proj": (s["h"], q), "k_proj": (s["h"], kv), "v_proj": (s["h"], kv), "o_proj": (q, s["h"]),
            "gate_proj": (s["h"], s["ffn"]), "up_proj": (s["h"], s["ffn"]), "down_proj": (s["ffn"], s["h"])}


def parameter_count(config) -> int:
    """Every weight of the model (a tied LM head counted once), from the config alone."""
    return sum(p.numel for p in parameter_layout(config))


def lora_parameter_count(config, r: int, targets) -> int:
    shapes = linear_shapes(config)
    return _shape(config)["layers"] * sum(r * (shapes[t][0] + shapes[t][1]) for t in targets if t in shapes)


def activation_bytes_estimate(config, micro_batch: int, seq_len: int, bytes_per_value: float,
                              activation_checkpointing: bool = False, lora_r: int | None = None,
                              lora_targets=(), lora_dropout: float = 0.0, loss_token_fraction: float = 1.0) -> float:
    """What autograd keeps per micro-batch, from first principles for a SwiGLU decoder layer.

    Per token and layer: the two norm inputs and outputs (4h), q/k/v after RoPE and the attention
    output (2 q-width + 2 kv-width), and the MLP's gate, up, SiLU and product (4 ffn). Attention
    uses a fused kernel (sdpa), so no seq x seq score matrix is kept. LoRA adds, per adapted
    projection, its dropped-out input and the dropout mask (1 byte) when dropout > 0, and the
    r-wide output of A. Plus the fp32 log-softmax of the logits, only at the positions the loss is
    taken on (distlab.models.CausalLMWithLoss). With activation checkpointing only each layer's
    input (h) is kept, plus one layer's worth during its recomputation."""
    s = _shape(config)
    tokens = micro_batch * seq_len
    q_width, kv_width = s["heads"] * s["head_dim"], s["kv"] * s["head_dim"]
    per_token = (4 * s["h"] + 2 * q_width + 2 * kv_width + 4 * s["ffn"]) * bytes_per_value
    if not lora_r:  # trained norm weights need their normalised inputs for the weight gradient
        per_token += 2 * s["h"] * bytes_per_value
    if lora_r:
        shapes = linear_shapes(config)
        for t in lora_targets:
            if t in shapes:
                per_token += lora_r * bytes_per_value + (shapes[t][0] * (bytes_per_value + 1) if lora_dropout > 0 else 0)
    per_layer = tokens * per_token
    logits = tokens * loss_token_fraction * s["vocab"] * 4
    if activation_checkpointing:
        return s["layers"] * tokens * s["h"] * bytes_per_value + per_layer + logits
    return s["layers"] * per_layer + logits


def estimate_training_memory(config, *, weight_bytes: float = 4, lora_r: int | None = 16, lora_targets=None,
                             trainable_bytes: float = 4, micro_batch: int = 1, seq_len: int = 1024,
                             activation_bytes: float | None = None, activation_checkpointing: bool = False,
                             optimizer: str = "adamw", lora_dropout: float = 0.05,
                             loss_token_fraction: float = 1.0) -> MemoryBreakdown:
    """Bytes held by one rank training on one device (sharding strategies divide parts of this).

    weight_bytes: bytes per frozen/base weight (4 fp32, 2 bf16, 1 int8, 0.5 for 4-bit).
    lora_r None: full fine-tuning (base weights are trained: gradients and AdamW state for all).
    AdamW keeps two moments per trained weight in fp32 (8 bytes)."""
    from .config import LORA_TARGETS

    n = parameter_count(config)
    moments = {"adamw": 8, "sgd": 0, "adamw8bit": 2}[optimizer]
    targets = lora_targets or LORA_TARGETS
    trained = n if lora_r is None else lora_parameter_count(config, lora_r, targets)
    adapter = 0.0 if lora_r is None else trained * trainable_bytes
    weights = n * weight_bytes
    # Activations live in the compute dtype: the weights' when they are 16/32-bit, bf16 when the
    # weights are quantised (they are dequantised to bf16 for the matmuls).
    act_bytes = activation_bytes if activation_bytes is not None else (weight_bytes if weight_bytes >= 2 else 2)
    return MemoryBreakdown(
        weights=weights, adapter_weights=adapter, gradients=trained * trainable_bytes,
        optimizer_state=trained * moments,
        activations=activation_bytes_estimate(config, micro_batch, seq_len, act_bytes, activation_checkpointing,
                                              lora_r, targets, lora_dropout, loss_token_fraction))


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def measure_state_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> MemoryBreakdown:
    """Bytes of the tensors this process holds: trainable vs frozen weights, .grad, optimizer state."""
    params = list(model.parameters())
    frozen = [p for p in params if not p.requires_grad]
    trained = [p for p in params if p.requires_grad]
    state = []
    if optimizer is not None:
        for s in optimizer.state.values():
            state += [v for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    full_ft = not frozen
    return MemoryBreakdown(
        weights=_bytes(params if full_ft else frozen),
        adapter_weights=0 if full_ft else _bytes(trained),
        gradients=_bytes(p.grad for p in trained), optimizer_state=_bytes(state))


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
    total = _bytes(saved)
    saved.clear()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return total


def breakdown_table(rows: dict[str, MemoryBreakdown], unit: float = 2**20, unit_name: str = "MiB"):
    import pandas as pd

    df = pd.DataFrame({name: {k: v / unit for k, v in b.as_dict().items()} for name, b in rows.items()}).fillna(0.0)
    order = [k for k in (*_COMPONENTS, "total") if k in df.index]
    return df.loc[order].rename_axis(f"component ({unit_name})")


def measure_training_memory(cfg) -> tuple[MemoryBreakdown, MemoryBreakdown]:
    """(measured, estimated) for one optimizer step of `cfg` on one device.

    Builds the run's model exactly as distlab.train does, takes one real step on a first
    micro-batch, then sums weights, gradients and optimizer state and the activations autograd
    saved. The estimate comes from the config alone, for comparison."""
    from .data import model_inputs
    from .device import autocast
    from .strategies import make_strategy
    from .train import _prepare

    strategy = make_strategy("single")
    choice, _, train_data, _, model = _prepare(cfg.replace(eval_file=None), strategy)
    model, optimizer, _ = strategy.prepare(model, choice, cfg)
    model.train()
    first = train_data.batch(list(range(cfg.micro_batch_size)))
    batch = model_inputs(first, choice.device)

    def loss_fn(m):
        with autocast(choice):
            return m(**batch)

    activations = measure_activation_memory(model, loss_fn)
    loss_fn(model).backward()
    optimizer.step()  # creates AdamW's moments
    measured = measure_state_memory(model, optimizer)
    measured.activations = activations
    base = model.causal_lm
    weight_bytes = torch.finfo(choice.dtype).bits / 8
    estimated = estimate_training_memory(
        base.config, weight_bytes=weight_bytes, lora_r=cfg.lora_r if cfg.lora else None,
        lora_targets=cfg.lora_targets, trainable_bytes=weight_bytes, micro_batch=cfg.micro_batch_size,
        seq_len=cfg.seq_len, activation_bytes=2 if choice.autocast_dtype is not None else weight_bytes,
        activation_checkpointing=cfg.activation_checkpointing, lora_dropout=cfg.lora_dropout,
        loss_token_fraction=first["n_label_tokens"] / first["input_ids"].numel())
    return measured, estimated


# ----------------------------------------------------------------------------- parameter layout

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor of the model, as the planner sees it."""

    name: str
    shape: tuple[int, ...]
    trainable: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _get(config, key: str, default=None):
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def _qkv_bias(config) -> bool:
    """Qwen2 has q/k/v biases (its config has no attention_bias flag); Llama and Qwen3 say so if they do."""
    bias = _get(config, "attention_bias")
    return _get(config, "model_type") == "qwen2" if bias is None else bool(bias)


def parameter_layout(config, lora_r: int | None = None, lora_targets=None) -> list[ParamSpec]:
    """Every parameter of a Llama/Qwen2/Qwen3-style causal LM, in the order `model.parameters()` yields
    them (a tied LM head appears once, as the embedding), marked trainable or frozen: everything is
    trained without `lora_r`; with it only the LoRA A/B matrices that PEFT inserts into the target
    projections. The order matters to DeepSpeed ZeRO-1/2, which cuts one flat buffer of the trained
    weights into equal partitions regardless of where one tensor ends and the next begins."""
    from .config import LORA_TARGETS

    s = _shape(config)
    shapes = linear_shapes(config)
    full = not lora_r
    targets = set(lora_targets or LORA_TARGETS) if lora_r else set()
    bias, qk_norm = _qkv_bias(config), _get(config, "model_type") == "qwen3"
    out = [ParamSpec("model.embed_tokens.weight", (s["vocab"], s["h"]), full)]
    for i in range(s["layers"]):
        for proj in ATTENTION_PROJECTIONS + MLP_PROJECTIONS:
            name = f"model.layers.{i}.{'self_attn' if proj in ATTENTION_PROJECTIONS else 'mlp'}.{proj}"
            fan_in, fan_out = shapes[proj]
            out.append(ParamSpec(f"{name}.weight", (fan_out, fan_in), full))
            if bias and proj in ("q_proj", "k_proj", "v_proj"):
                out.append(ParamSpec(f"{name}.bias", (fan_out,), full))
            if proj in targets:
                out.append(ParamSpec(f"{name}.lora_A.weight", (lora_r, fan_in), True))
                out.append(ParamSpec(f"{name}.lora_B.weight", (fan_out, lora_r), True))
            if qk_norm and proj == "o_proj":
                out += [ParamSpec(f"model.layers.{i}.self_attn.{n}.weight", (s["head_dim"],), full)
                        for n in ("q_norm", "k_norm")]
        out += [ParamSpec(f"model.layers.{i}.{n}.weight", (s["h"],), full)
                for n in ("input_layernorm", "post_attention_layernorm")]
    out.append(ParamSpec("model.norm.weight", (s["h"],), full))
    if not s["tied"]:
        out.append(ParamSpec("lm_head.weight", (s["vocab"], s["h"]), full))
    return out


def optimizer_groups(layout: Sequence[ParamSpec]) -> list[list[ParamSpec]]:
    """The trained parameters grouped as Strategy.make_optimizer groups them: matrices (weight
    decay) first, then vectors (no decay), each in model order; empty groups dropped."""
    trained = [p for p in layout if p.trainable]
    groups = [[p for p in trained if len(p.shape) >= 2], [p for p in trained if len(p.shape) < 2]]
    return [g for g in groups if g]


# ----------------------------------------------------------------------------- the planner

STRATEGY_NAMES = ("single", "ddp", "fsdp", "zero2", "zero3", "pipeline")
ZERO_ALIGNMENT = 2  # ZeRO-1/2 pad each flat group to a multiple of 2 x world (DeepSpeed's nccl_start_alignment_factor)
ZERO3_PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's stage3_param_persistence_threshold default (elements)
MOMENT_BYTES = {"adamw": 8, "sgd": 0, "adamw8bit": 2}  # optimizer state per trained weight


def zero_bucket_elements(n_trained: int) -> int:
    """Elements per DeepSpeed reduce/all-gather bucket in distlab's config: DeepSpeed's default 5e8,
    or the trained weight count when that is smaller (a bucket never holds more than that, and
    DeepSpeed allocates 5e8 elements, 2 GB in fp32, even for a tiny model). Even, as it requires."""
    n = int(min(5e8, max(int(n_trained), 2)))
    return n + n % 2


# dtype -> (bytes per stored weight, bytes per activation value). "bf16-autocast" keeps fp32 weights
# and computes in bf16 (torch autocast); DeepSpeed's bf16 mode instead stores the model in bf16 and
# keeps an fp32 master copy of the trained weights in its optimizer.
DTYPE_BYTES = {"fp32": (4, 4), "bf16-autocast": (4, 2), "fp16-autocast": (4, 2), "bf16": (2, 2), "fp16": (2, 2),
               "int8": (1, 2), "4bit": (0.5, 2), "nf4": (0.5, 2)}


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


def _layer_split(layers: int, stages: int) -> list[int]:
    base, extra = divmod(layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def plan_memory(config, *, strategy: str = "single", world_size: int = 1, dtype: str | None = None,
                weight_bytes: float | None = None, trainable_bytes: float | None = None,
                lora_r: int | None = None, lora_targets=None, micro_batch: int = 1, seq_len: int = 1024,
                activation_checkpointing: bool = False, optimizer: str = "adamw",
                activation_bytes: float | None = None, lora_dropout: float = 0.0, loss_token_fraction: float = 1.0,
                pipeline_stages: int | None = None, grad_accum: int = 1, offload_optimizer: bool = False,
                zero3_persistence_threshold: int = ZERO3_PERSISTENCE_THRESHOLD,
                rank: int | None = None) -> MemoryBreakdown:
    """Predicted bytes one rank holds while training `config` with `strategy` on `world_size` ranks.

    config: any HF causal-LM config (object or dict) of the Llama/Qwen family. dtype: "fp32",
    "bf16-autocast" (fp32 weights, bf16 compute), "bf16", "int8", "4bit" (frozen base weights
    quantised: LoRA only); or give weight_bytes (and activation_bytes) directly. lora_r None: full
    fine-tuning. rank None: the rank that needs the most (ranks differ slightly where partitions cut
    tensors unevenly); an int: that rank.

    What each strategy holds, per rank, with N parameters, T of them trained:
      single, ddp   everything: weights, T gradients, AdamW's two fp32 moments per trained weight.
                    DDP adds its gradient buckets (a copy of the gradients) as buffers.
      zero2         weights replicated; the flat trained weights cut into `world` partitions, each
                    rank keeping the fp32 master copy and moments of its partition, and the
                    gradients of the tensors that touch it (whole tensors, as DeepSpeed does).
      fsdp          every tensor cut in `world` dim-0 shards: weights, gradients and moments / world;
                    buffers for the layer being all-gathered (and the next one, prefetched).
      zero3         every tensor partitioned (weights, fp32 gradients, fp32 master copy, moments);
                    tensors under DeepSpeed's persistence threshold (100k elements: LoRA adapters,
                    norms, biases, small projections) are also kept whole on every rank.
      pipeline      layers divided over `pipeline_stages` stages (first stage: embedding, last: norm
                    and LM head), DDP across world / stages replicas; activations of the micro-batches
                    in flight (1F1B: stages - stage index).
    """
    from .config import LORA_TARGETS

    if strategy not in STRATEGY_NAMES:
        raise ValueError(f"unknown strategy {strategy!r}; one of {', '.join(STRATEGY_NAMES)}")
    if strategy in ("single",) and world_size != 1:
        world_size = 1
    if strategy == "pipeline":
        stages = pipeline_stages or world_size
        if world_size % stages:
            raise ValueError(f"world_size {world_size} is not a multiple of pipeline_stages {stages}")
    if dtype is not None:
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {dtype!r}: one of {', '.join(DTYPE_BYTES)}")
        wb, ab = DTYPE_BYTES[dtype]
        weight_bytes = weight_bytes if weight_bytes is not None else wb
        activation_bytes = activation_bytes if activation_bytes is not None else ab
    wb = 4.0 if weight_bytes is None else float(weight_bytes)
    if wb < 2 and not lora_r:
        raise ValueError("quantised base weights (weight_bytes < 2) can only be trained through LoRA adapters")
    # DeepSpeed's bf16 mode stores the model in bf16 (torch autocast keeps fp32 weights instead).
    deepspeed_bf16 = strategy in ("zero2", "zero3") and dtype in ("bf16-autocast", "bf16")
    if deepspeed_bf16:
        wb = 2.0
    tb = float(trainable_bytes) if trainable_bytes is not None else (wb if (not lora_r or wb >= 2) else 4.0)
    act_b = activation_bytes if activation_bytes is not None else (wb if wb >= 2 else 2)
    moments = MOMENT_BYTES[optimizer]
    targets = list(lora_targets or LORA_TARGETS)
    layout = parameter_layout(config, lora_r, targets)
    trained = [p for p in layout if p.trainable]
    frozen = [p for p in layout if not p.trainable]
    n_trained = sum(p.numel for p in trained)
    lora = bool(lora_r)
    acts = activation_bytes_estimate(config, micro_batch, seq_len, act_b, activation_checkpointing,
                                     lora_r, targets, lora_dropout, loss_token_fraction)

    def split(frozen_b: float, trained_b: float) -> tuple[float, float]:
        """(weights, adapter_weights): LoRA adapters are reported apart from the base weights."""
        return (frozen_b, trained_b) if lora else (frozen_b + trained_b, 0.0)

    def one_rank(r: int) -> MemoryBreakdown:
        notes: list[str] = []
        world = world_size
        if strategy in ("single", "ddp"):
            w, a = split(sum(p.numel for p in frozen) * wb, n_trained * tb)
            b = MemoryBreakdown(w, a, n_trained * tb, n_trained * moments, acts)
            if strategy == "ddp" and world > 1:
                b.buffers = n_trained * tb
                notes.append("DDP all-reduces gradients from buckets that copy them (gradient_as_bucket_view=False)")
        elif strategy == "fsdp":
            w, a = split(sum(_fsdp_shard(p, world) for p in frozen) * wb,
                         sum(_fsdp_shard(p, world) for p in trained) * tb)
            shard_t = sum(_fsdp_shard(p, world) for p in trained)
            b = MemoryBreakdown(w, a, shard_t * tb, shard_t * moments, acts)
            layer = [p for p in layout if p.name.startswith("model.layers.0.")]
            root = [p for p in layout if not p.name.startswith("model.layers.")]
            compute_b = min(wb, act_b) if wb >= 2 else 2
            b.buffers = (sum(p.numel for p in root) + 2 * sum(p.numel for p in layer)) * compute_b + \
                sum(p.numel for p in layer if p.trainable) * 4
            notes.append("buffers (estimate): the root's weights (embedding, LM head) stay gathered through the "
                         "step, plus the layer being all-gathered and the next one, prefetched")
        elif strategy == "zero2":
            groups = optimizer_groups(layout)
            flat, part, touching = _zero2_partitions(groups, world, r)
            w, a = split(sum(p.numel for p in frozen) * wb, flat * tb)
            grads = touching * tb if (tb == 4 and not deepspeed_bf16) else part * 4
            opt = part * (4 + moments)
            b = MemoryBreakdown(w, a, grads, 0.0 if offload_optimizer else opt, acts)
            b.buffers = zero_bucket_elements(n_trained) * tb
            notes.append(f"optimizer state = fp32 master copy + moments of a {part:,}-element partition "
                         f"({part * (4 + moments) / 2**20:.1f} MiB)" + (" on the CPU (offload)" if offload_optimizer else ""))
            if grads == touching * tb:
                notes.append("gradients: DeepSpeed keeps whole tensors that straddle a partition boundary")
        elif strategy == "zero3":
            persist = lambda p: p.numel <= zero3_persistence_threshold
            part = lambda p: _chunk(p.numel, world)
            fb = sum(part(p) + (p.numel if persist(p) else 0) for p in frozen) * wb
            tbytes = sum(part(p) + (p.numel if persist(p) else 0) for p in trained) * tb
            w, a = split(fb, tbytes)
            part_t = sum(part(p) for p in trained)
            # DeepSpeed means to update an fp32 model's partition in place, but 0.19.8 compares a
            # torch.device with a string there (never equal), so it always keeps an fp32 master copy.
            master = part_t * 4
            b = MemoryBreakdown(w, a, part_t * 4, 0.0 if offload_optimizer else part_t * moments + master, acts)
            largest_layer = sum(p.numel for p in layout if p.name.startswith("model.layers.0."))
            b.buffers = zero_bucket_elements(n_trained) * 4 + 2 * largest_layer * wb
            n_persist = sum(1 for p in layout if persist(p))
            notes.append(f"{n_persist} of {len(layout)} tensors are at most {zero3_persistence_threshold:,} elements: "
                         "every rank keeps them whole (stage3_param_persistence_threshold)")
        else:  # pipeline
            stages = pipeline_stages or world
            stage = r % stages
            dp = world // stages
            split_layers = _layer_split(_shape(config)["layers"], stages)
            first = sum(split_layers[:stage])
            mine = set(range(first, first + split_layers[stage]))

            def in_stage(p: ParamSpec) -> bool:
                if p.name.startswith("model.layers."):
                    return int(p.name.split(".")[2]) in mine
                if p.name == "model.embed_tokens.weight":
                    return stage == 0 or (stage == stages - 1 and _shape(config)["tied"])
                return stage == stages - 1  # final norm, untied LM head

            ps = [p for p in layout if in_stage(p)]
            t = sum(p.numel for p in ps if p.trainable)
            w, a = split(sum(p.numel for p in ps if not p.trainable) * wb, t * tb)
            in_flight = min(stages - stage, max(grad_accum, 1))
            layer_acts = activation_bytes_estimate(config, micro_batch, seq_len, act_b, activation_checkpointing,
                                                   lora_r, targets, lora_dropout, 0.0)
            share = layer_acts * len(mine) / _shape(config)["layers"] * in_flight
            if stage == stages - 1:
                share += acts - layer_acts
            b = MemoryBreakdown(w, a, t * tb, t * moments, share)
            if dp > 1:
                b.buffers = t * tb
            notes.append(f"stage {stage} of {stages}: layers {min(mine) if mine else '-'}-{max(mine) if mine else '-'}, "
                         f"{in_flight} micro-batch(es) in flight (1F1B)")
        b.notes = notes
        return b

    if strategy in ("single", "ddp"):
        return one_rank(0)
    if rank is not None:
        return one_rank(rank)
    return max((one_rank(r) for r in range(world_size)), key=lambda b: b.total)


def plan_table(config, strategies: Iterable[str] = ("single", "ddp", "zero2", "fsdp", "zero3"), *,
               world_size: int = 2, unit: float = 2**20, unit_name: str = "MiB", **kwargs):
    """One column per strategy, one row per component, in `unit` per rank."""
    rows = {s: plan_memory(config, strategy=s, world_size=1 if s == "single" else world_size, **kwargs)
            for s in strategies}
    return breakdown_table(rows, unit=unit, unit_name=unit_name)


# ----------------------------------------------------------------------------- what a rank owns


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
    """The tensors of a torch optimizer's state (moments), leaving out 0-d step counters."""
    out = []
    for state in getattr(optimizer, "state", {}).values():
        out += [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
    return out


def measure_owned_state(model: torch.nn.Module, optimizer=None) -> MemoryBreakdown:
    """Bytes of weights, adapters, gradients and optimizer state this process owns, for torch-native
    strategies (single, DDP, FSDP2: a DTensor counts its local shard). DeepSpeed keeps its own
    buffers: distlab.strategies.zero measures those. Each storage is counted once, in the first
    category that holds it (weights, adapters, gradients, optimizer state)."""
    params = list(dict.fromkeys(model.parameters()))
    frozen = [p for p in params if not p.requires_grad]
    trained = [p for p in params if p.requires_grad]
    seen: set = set()
    lora = bool(frozen)
    return MemoryBreakdown(
        weights=owned_bytes(frozen if lora else params, seen),
        adapter_weights=owned_bytes(trained, seen) if lora else 0,
        gradients=owned_bytes((p.grad for p in trained), seen),
        optimizer_state=owned_bytes(optimizer_state_tensors(optimizer) if optimizer is not None else [], seen))


# ----------------------------------------------------------------------------- the recommender

def communication_bytes(config, strategy: str, world_size: int, *, lora_r: int | None = None, lora_targets=None,
                        weight_bytes: float = 2, grad_bytes: float = 4) -> float:
    """Bytes each rank sends per optimizer step (ring collectives: (k-1)/k of the buffer per pass).

    ddp: one all-reduce of the trained gradients (2 passes). zero2: a reduce-scatter of the gradients
    and an all-gather of the updated trained weights: the same volume. fsdp / zero3: every weight is
    all-gathered twice (forward and backward, in the compute dtype), plus a reduce-scatter of the
    gradients; with LoRA that still means all-gathering the frozen base model at every step."""
    k = world_size
    if k <= 1:
        return 0.0
    layout = parameter_layout(config, lora_r, lora_targets)
    trained = sum(p.numel for p in layout if p.trainable)
    every = sum(p.numel for p in layout)
    ring = (k - 1) / k
    if strategy in ("ddp", "pipeline"):
        return 2 * ring * trained * grad_bytes
    if strategy == "zero2":
        return ring * trained * grad_bytes + ring * trained * weight_bytes
    if strategy in ("fsdp", "zero3"):
        return 2 * ring * every * weight_bytes + ring * trained * grad_bytes
    return 0.0


@dataclass
class Recommendation:
    strategy: str  # ddp | zero2 | fsdp | zero3 | none
    weight_bytes: float  # of the base weights in the recommended setup (0.5: 4-bit)
    offload_optimizer: bool
    plan: MemoryBreakdown | None  # per rank, for the recommended setup
    per_device: Any  # DataFrame: device, capacity, usable, predicted, headroom, fits
    candidates: Any  # DataFrame: every setup considered, per-rank GiB, fits, communication per step
    reasoning: list[str]

    def __str__(self) -> str:
        head = f"recommended: {self.label}"
        return "\n".join([head, *[f"  {line}" for line in self.reasoning]])

    @property
    def label(self) -> str:
        if self.strategy == "none":
            return "nothing fits"
        bits = {4: "fp32", 2: "bf16", 1: "8-bit", 0.5: "4-bit"}.get(self.weight_bytes, f"{self.weight_bytes} B")
        return f"{self.strategy} with {bits} weights" + (" + optimizer offload" if self.offload_optimizer else "")


def recommend(model_config, devices: Sequence[Mapping[str, Any]], *, lora_r: int | None = 16, lora_targets=None,
              weight_bytes: float = 2, seq_len: int = 2048, micro_batch: int = 1, activation_checkpointing: bool = True,
              optimizer: str = "adamw", reserve_gb: float = 1.5, link_gbit: float | None = 1.0,
              max_comm_s: float = 10.0, model_name: str = "the model") -> Recommendation:
    """Which strategy fits `model_config` on these GPUs, with the reasoning: the LAN-cluster guide's
    decision tree, driven by the planner's numbers.

    devices: [{"name": "RTX 5070 Ti", "memory_gb": 12}, ...] (GiB, as GPU makers count). Each GPU
    keeps `reserve_gb` for the CUDA context, kernels' workspaces and fragmentation. Activations are
    planned in bf16 (GPU autocast). The tree:
      1. one replica fits every GPU                -> DDP (lock-step: the smallest/slowest GPU bounds it)
      2. else, only gradients + optimizer too big  -> ZeRO-2 (weights replicated, the rest sharded)
      3. else, total VRAM holds it, sharded evenly -> FSDP / ZeRO-3 (each GPU holds 1/n of everything)
         ... unless every step would all-gather the weights over a slow link (`link_gbit`) for longer
         than `max_comm_s` while quantised weights fit one GPU: then quantise and use DDP
      4. else quantise the base weights (8-bit, 4-bit: LoRA only), then offload the optimizer to the CPU.
    """
    import pandas as pd

    if not devices:
        raise ValueError("no devices")
    n = len(devices)
    names = [str(d.get("name", f"gpu{i}")) for i, d in enumerate(devices)]
    capacity = [float(d["memory_gb"]) for d in devices]
    usable = [max(c - reserve_gb, 0.0) for c in capacity]
    smallest = min(usable)
    gib = lambda b: b / GIB
    lora = bool(lora_r)
    targets = list(lora_targets) if lora_targets else None
    bits = lambda wb: {4: "fp32", 2: "bf16", 1: "8-bit", 0.5: "4-bit"}.get(wb, f"{wb}-byte")

    def plan(strategy: str, world: int, wb: float, offload: bool = False) -> MemoryBreakdown:
        return plan_memory(model_config, strategy=strategy, world_size=world, weight_bytes=wb, lora_r=lora_r,
                           lora_targets=targets, micro_batch=micro_batch, seq_len=seq_len,
                           activation_checkpointing=activation_checkpointing, activation_bytes=2,
                           optimizer=optimizer, offload_optimizer=offload)

    def comm_s(strategy: str, wb: float) -> float:
        nbytes = communication_bytes(model_config, strategy, n, lora_r=lora_r, lora_targets=targets,
                                     weight_bytes=max(wb, 2), grad_bytes=4)
        return nbytes / (link_gbit * 1e9 / 8) if link_gbit else float("nan")

    rows, reasoning = [], []

    def consider(strategy: str, wb: float, offload: bool = False) -> MemoryBreakdown:
        b = plan(strategy, n, wb, offload)
        rows.append({"setup": f"{strategy}, {bits(wb)} weights" + (", optimizer offload" if offload else ""),
                     "per-rank GiB": round(gib(b.total), 2), "weights GiB": round(gib(b.weights + b.adapter_weights), 2),
                     "activations GiB": round(gib(b.activations), 2), "fits every GPU": gib(b.total) <= smallest,
                     "comm GB/step": round(communication_bytes(model_config, strategy, n, lora_r=lora_r,
                                                               lora_targets=targets, weight_bytes=max(wb, 2)) / 1e9, 3),
                     f"comm s/step @ {link_gbit} Gbit/s": round(comm_s(strategy, wb), 2)})
        return b

    def result(strategy: str, wb: float, b: MemoryBreakdown | None, offload: bool = False) -> Recommendation:
        per = pd.DataFrame({"device": names, "capacity GiB": capacity, "usable GiB": usable,
                            "predicted GiB": [round(gib(b.total), 2) if b else float("nan")] * n})
        per["headroom GiB"] = (per["usable GiB"] - per["predicted GiB"]).round(2)
        per["fits"] = per["headroom GiB"] >= 0
        return Recommendation(strategy, wb, offload, b, per, pd.DataFrame(rows), reasoning)

    what = f"{model_name} ({parameter_count(model_config) / 1e9:.2f}B parameters, " + \
        (f"LoRA r={lora_r}" if lora else "full fine-tuning") + f", micro-batch {micro_batch} x {seq_len} tokens" + \
        (", activation checkpointing" if activation_checkpointing else "") + ")"
    reasoning.append(f"Model: {what}. Usable memory per GPU (capacity - {reserve_gb} GiB reserve): " +
                     ", ".join(f"{nm} {u:.1f} GiB" for nm, u in zip(names, usable)) + ".")

    # 1. does one replica fit a single GPU?
    single = consider("ddp", weight_bytes)
    fits = [gib(single.total) <= u for u in usable]
    reasoning.append(f"1. Does the model fit one GPU? A full replica in {bits(weight_bytes)} needs "
                     f"{gib(single.total):.2f} GiB (weights {gib(single.weights + single.adapter_weights):.2f}, "
                     f"gradients + optimizer {gib(single.gradients + single.optimizer_state):.2f}, activations "
                     f"{gib(single.activations):.2f}, buffers {gib(single.buffers):.2f}).")
    if all(fits):
        reasoning.append(f"   YES on every GPU (smallest usable {smallest:.1f} GiB) -> DDP on all {n} GPUs: each holds a "
                         f"replica and all-reduces {communication_bytes(model_config, 'ddp', n, lora_r=lora_r, lora_targets=targets) / 1e6:.0f} MB "
                         f"of gradients per step ({comm_s('ddp', weight_bytes):.2f} s at {link_gbit} Gbit/s).")
        if len(set(capacity)) > 1:
            reasoning.append(f"   The GPUs differ ({' / '.join(f'{c:g} GB' for c in capacity)}): DDP runs in lock-step, so "
                             "the slowest GPU sets the pace and the smallest one the micro-batch (every rank runs the "
                             "same); expect less than a linear speed-up.")
        return result("ddp", weight_bytes, single)
    if any(fits):
        reasoning.append("   Only on " + ", ".join(nm for nm, f in zip(names, fits) if f) + ": DDP needs it on every GPU.")
    else:
        reasoning.append("   NO: not even on the largest GPU.")

    # 2./3. shard: ZeRO-2 (gradients + optimizer), then FSDP / ZeRO-3 (everything)
    total_usable = sum(usable)
    state = single.weights + single.adapter_weights + single.gradients + single.optimizer_state
    reasoning.append(f"2. Is total VRAM enough? {total_usable:.1f} GiB usable over {n} GPUs vs {gib(state):.2f} GiB of "
                     "weights, gradients and optimizer state to divide (plus activations on every GPU).")
    zero2 = consider("zero2", weight_bytes)
    if gib(zero2.total) <= smallest:
        reasoning.append(f"   ZeRO-2 (weights replicated, gradients + optimizer sharded) needs {gib(zero2.total):.2f} GiB "
                         f"per GPU <= {smallest:.1f} -> ZeRO-2, with DDP's communication volume.")
        return result("zero2", weight_bytes, zero2)
    # FSDP2 and ZeRO-3 shard the same state; they differ in what stays gathered (FSDP2's root keeps the
    # embedding and LM head from forward to backward, ZeRO-3 keeps tensors under 100k elements whole).
    fsdp_plan, zero3_plan = consider("fsdp", weight_bytes), consider("zero3", weight_bytes)
    sharded_name, sharded = ("fsdp", fsdp_plan) if fsdp_plan.total <= zero3_plan.total else ("zero3", zero3_plan)
    quant = None
    if lora and weight_bytes > 0.5:
        for wb in (1, 0.5):
            if wb < weight_bytes:
                q = consider("ddp", wb)
                if gib(q.total) <= smallest:
                    quant = (wb, q)
                    break
    if gib(sharded.total) <= smallest:
        reasoning.append(f"   YES: FSDP / ZeRO-3 give each GPU 1/{n} of everything: FSDP {gib(fsdp_plan.total):.2f} GiB, "
                         f"ZeRO-3 {gib(zero3_plan.total):.2f} GiB per GPU (incl. gather buffers) <= {smallest:.1f} GiB "
                         "on the smallest.")
        slow = comm_s("fsdp", weight_bytes)
        if link_gbit and slow > max_comm_s and quant is not None:
            wb, q = quant
            reasoning.append(f"3. But sharding all-gathers the weights twice per step: "
                             f"{communication_bytes(model_config, 'fsdp', n, lora_r=lora_r, lora_targets=targets, weight_bytes=weight_bytes) / 1e9:.1f} GB, "
                             f"{slow:.0f} s per step at {link_gbit} Gbit/s (limit {max_comm_s:g} s). With {bits(wb)} base "
                             f"weights a replica needs {gib(q.total):.2f} GiB and fits every GPU: quantise and use DDP, "
                             f"which only all-reduces the adapters' gradients ({comm_s('ddp', wb):.2f} s per step).")
            return result("ddp", wb, q)
        reasoning.append(f"3. Communication: {slow:.1f} s per step at {link_gbit} Gbit/s for the all-gathers -> "
                         f"{'FSDP' if sharded_name == 'fsdp' else 'DeepSpeed ZeRO-3'}, the smaller of the two here.")
        return result(sharded_name, weight_bytes, sharded)
    reasoning.append(f"   NO: even sharded evenly, each GPU would need {gib(sharded.total):.2f} GiB "
                     f"({'FSDP' if sharded_name == 'fsdp' else 'ZeRO-3'}) > {smallest:.1f} GiB.")

    # 4. quantise, then offload
    if quant is not None:
        wb, q = quant
        reasoning.append(f"4. Quantise more aggressively: with {bits(wb)} base weights (LoRA on top) a replica needs "
                         f"{gib(q.total):.2f} GiB -> DDP with {bits(wb)} weights.")
        return result("ddp", wb, q)
    off = consider("zero3", weight_bytes, offload=True)
    if gib(off.total) <= smallest:
        reasoning.append(f"4. Offload the optimizer state to CPU memory (ZeRO-3 + offload_optimizer): "
                         f"{gib(off.total):.2f} GiB per GPU; each step then waits for the CPU update.")
        return result("zero3", weight_bytes, off, offload=True)
    reasoning.append("4. Nothing fits: use LoRA with quantised weights, shorter sequences, activation checkpointing, "
                     "more GPUs or a smaller model.")
    return result("none", weight_bytes, None)


def plot_breakdowns(rows: Mapping[str, MemoryBreakdown], capacities: Mapping[str, float] | None = None,
                    title: str = "", unit: float = GIB, unit_name: str = "GiB", ax=None):
    """Stacked horizontal bars, one per breakdown (e.g. per strategy), with dashed lines at GPU
    capacities (name -> GiB). Returns the figure."""
    import matplotlib.pyplot as plt

    table = breakdown_table(dict(rows), unit=unit, unit_name=unit_name).T.drop(columns="total")
    if ax is None:
        fig, ax = plt.subplots(figsize=(7.5, 0.5 + 0.45 * len(table)))
    else:
        fig = ax.figure
    table.plot.barh(stacked=True, ax=ax, width=0.7)
    ax.invert_yaxis()
    for name, gb in (capacities or {}).items():
        ax.axvline(gb * GIB / unit, color="k", ls="--", lw=1)
        ax.text(gb * GIB / unit, 1.01, f"{name} ({gb:g} GB)", transform=ax.get_xaxis_transform(), fontsize=7,
                ha="center", va="bottom")
    ax.set_xlabel(f"{unit_name} per rank (planned)")
    ax.set_title(title, fontsize=9, pad=14 if capacities else 6)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig
