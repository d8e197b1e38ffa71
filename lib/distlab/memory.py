"""Where training memory goes: weights, adapter weights, gradients, optimizer state, activations.

`estimate_training_memory` predicts bytes per rank from a model config alone (any HF causal-LM
config: a 7B model needs no weights to be planned for). `measure_state_memory` sums the tensors a
live model and optimizer actually hold, and `measure_activation_memory` counts what autograd
saves for the backward pass during one real forward, so estimates can be checked against runs
on any device, CPU included.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

GIB = 1024**3

# Llama-2-7B's published shape, used to replay the LAN-cluster seed's "7B on a 12 GB GPU" table.
LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False)


@dataclass
class MemoryBreakdown:
    weights: float = 0.0  # frozen or trained base weights
    adapter_weights: float = 0.0  # LoRA A/B (0 for full fine-tuning)
    gradients: float = 0.0
    optimizer_state: float = 0.0
    activations: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.adapter_weights + self.gradients + self.optimizer_state + self.activations

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


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
    s = _shape(config)
    per_layer = sum(i * o for i, o in linear_shapes(config).values()) + 2 * s["h"]  # + two RMSNorm weights
    embeddings = s["vocab"] * s["h"] * (1 if s["tied"] else 2)
    # Qwen2 has q/k/v biases; they are tiny, counted when the config says attention_bias or is qwen2.
    return s["layers"] * per_layer + embeddings + s["h"]


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

    return pd.DataFrame({name: {k: v / unit for k, v in b.as_dict().items()} for name, b in rows.items()}).rename_axis(
        f"component ({unit_name})")


def measure_training_memory(cfg) -> tuple[MemoryBreakdown, MemoryBreakdown]:
    """(measured, estimated) for one optimizer step of `cfg` on one device.

    Builds the run's model exactly as distlab.train does, takes one real step on a first
    micro-batch, then sums weights, gradients and optimizer state and the activations autograd
    saved. The estimate comes from the config alone, for comparison."""
    from .data import model_inputs
    from .strategies import make_strategy
    from .device import autocast
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
