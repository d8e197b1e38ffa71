"""What a model is made of, from its config alone: every parameter tensor in the order the model
yields it, LoRA's adapters, and the activations autograd keeps per micro-batch (chapters 01, 03).

Works for any Llama/Qwen2/Qwen3-style HF causal-LM config, as an object or a dict, so 7B-class
models are planned without their weights. The case studies' models' published shapes are here too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from distlab.config import LORA_TARGETS

# Published shapes (the models' config.json), so 7B-class models can be planned without weights.
# Llama-2-7B replays the LAN-cluster guide's "7B on a 12 GB GPU" table.
LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False, model_type="llama")
# Llama-2-13B: the LAN-cluster guide's Scenario 3 (FSDP across its three cards with an 8/4-bit base).
LLAMA2_13B = dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                  num_key_value_heads=40, vocab_size=32000, tie_word_embeddings=False, model_type="llama")
# The enterprise demo's and benchmark's models (Qwen2 has q/k/v biases; Qwen3 has q/k RMSNorms instead).
QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, model_type="qwen2")
QWEN25_3B = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, model_type="qwen2")
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                 model_type="qwen3")
CASE_STUDY_MODELS = {"Llama-2-7B": LLAMA2_7B, "Qwen2.5-7B-Instruct": QWEN25_7B, "Qwen2.5-3B-Instruct": QWEN25_3B,
               "Qwen3-0.6B": QWEN3_06B}
# Their hub ids, so a config naming one is planned offline (distlab.commands.plan).
CASE_STUDY_MODEL_IDS = {"meta-llama/Llama-2-7b-hf": LLAMA2_7B, "meta-llama/Llama-2-13b-hf": LLAMA2_13B,
                  "Qwen/Qwen2.5-7B-Instruct": QWEN25_7B,
                  "Qwen/Qwen2.5-3B-Instruct": QWEN25_3B, "Qwen/Qwen3-0.6B": QWEN3_06B}

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def config_value(config, key: str, default=None):
    """One field of an HF config object or of a config dict."""
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def model_shape(config) -> dict[str, int]:
    """The sizes the planner needs: hidden (h), MLP width (ffn), layers, attention and KV heads,
    head_dim, vocab, and whether the LM head is tied to the embedding."""
    h, heads = config_value(config, "hidden_size"), config_value(config, "num_attention_heads")
    head_dim = config_value(config, "head_dim") or h // heads
    return dict(h=h, ffn=config_value(config, "intermediate_size"), layers=config_value(config, "num_hidden_layers"),
                heads=heads, kv=(config_value(config, "num_key_value_heads") or heads), head_dim=head_dim,
                vocab=config_value(config, "vocab_size"), tied=bool(config_value(config, "tie_word_embeddings", False)))


def linear_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection in one Llama/Qwen2 decoder layer."""
    s = model_shape(config)
    q, kv = s["heads"] * s["head_dim"], s["kv"] * s["head_dim"]
    return {"q_proj": (s["h"], q), "k_proj": (s["h"], kv), "v_proj": (s["h"], kv), "o_proj": (q, s["h"]),
            "gate_proj": (s["h"], s["ffn"]), "up_proj": (s["h"], s["ffn"]), "down_proj": (s["ffn"], s["h"])}


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor of the model, as the planner sees it."""

    name: str
    shape: tuple[int, ...]
    trainable: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _qkv_bias(config) -> bool:
    """Qwen2 has q/k/v biases (its config has no attention_bias flag); Llama and Qwen3 say so if they do."""
    bias = config_value(config, "attention_bias")
    return config_value(config, "model_type") == "qwen2" if bias is None else bool(bias)


def parameter_layout(config, lora_r: int | None = None, lora_targets=None) -> list[ParamSpec]:
    """Every parameter of a Llama/Qwen2/Qwen3-style causal LM, in the order `model.parameters()` yields
    them (a tied LM head appears once, as the embedding), marked trainable or frozen: everything is
    trained without `lora_r`; with it only the LoRA A/B matrices that PEFT inserts into the target
    projections. The order matters to DeepSpeed ZeRO-1/2, which cuts one flat buffer of the trained
    weights into equal partitions regardless of where one tensor ends and the next begins."""
    s = model_shape(config)
    shapes = linear_shapes(config)
    full = not lora_r
    targets = set(lora_targets or LORA_TARGETS) if lora_r else set()
    bias, qk_norm = _qkv_bias(config), config_value(config, "model_type") == "qwen3"
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


def layer_index(p: ParamSpec) -> int | None:
    """The decoder layer a parameter belongs to; None for the embedding, final norm and LM head."""
    return int(p.name.split(".")[2]) if p.name.startswith("model.layers.") else None


def parameter_count(config) -> int:
    """Every weight of the model (a tied LM head counted once), from the config alone."""
    return sum(p.numel for p in parameter_layout(config))


def lora_parameter_count(config, r: int, targets) -> int:
    shapes = linear_shapes(config)
    return model_shape(config)["layers"] * sum(r * (shapes[t][0] + shapes[t][1]) for t in targets if t in shapes)


def optimizer_groups(layout: Sequence[ParamSpec]) -> list[list[ParamSpec]]:
    """The trained parameters grouped as Strategy.make_optimizer groups them: matrices (weight
    decay) first, then vectors (no decay), each in model order; empty groups dropped."""
    trained = [p for p in layout if p.trainable]
    groups = [[p for p in trained if len(p.shape) >= 2], [p for p in trained if len(p.shape) < 2]]
    return [g for g in groups if g]


def activation_bytes_estimate(config, micro_batch: int, seq_len: int, bytes_per_value: float,
                              activation_checkpointing: bool = False, lora_r: int | None = None,
                              lora_targets=(), lora_dropout: float = 0.0, loss_token_fraction: float = 1.0,
                              tp: int = 1, vocab_tp: int = 1, cross_entropy: str = "chunked") -> float:
    """What autograd keeps per micro-batch, from first principles for a SwiGLU decoder layer.

    Per token and layer: the two norm inputs and outputs (4h), q/k/v after RoPE and the attention
    output (2 q-width + 2 kv-width), and the MLP's gate, up, SiLU and product (4 ffn). Attention
    uses a fused kernel (sdpa), so no seq x seq score matrix is kept. LoRA adds, per adapted
    projection, its dropped-out input and the dropout mask (1 byte) when dropout > 0, and the
    r-wide output of A. Plus what the loss keeps for its backward, only at the positions it is taken on
    (distlab.lm_loss): with `cross_entropy="plain"` the fp32 log-softmax of the logits; chunked (the default;
    the plain one where the vocabulary is split, `vocab_tp` > 1) the gradient of the head's input rows, and
    under full fine-tuning the head weight's fp32 gradient, both taken in the forward. With activation
    checkpointing only each layer's input (h) is kept, plus one layer's worth during its recomputation.
    `tp`: tensor parallelism's degree; the per-head and FFN-width values are each rank's slice, the
    hidden-width ones stay whole. `vocab_tp`: the ranks the vocabulary is split over (tp's vocab_parallel):
    each keeps its slice of the logits."""
    s = model_shape(config)
    tokens = micro_batch * seq_len
    q_width, kv_width = s["heads"] * s["head_dim"], s["kv"] * s["head_dim"]
    per_token = (4 * s["h"] + (2 * q_width + 2 * kv_width + 4 * s["ffn"]) / tp) * bytes_per_value
    if not lora_r:  # trained norm weights need their normalised inputs for the weight gradient
        per_token += 2 * s["h"] * bytes_per_value
    if lora_r:
        shapes = linear_shapes(config)
        for t in lora_targets:
            if t in shapes:
                dropped = shapes[t][0] * (bytes_per_value + 1) if lora_dropout > 0 else 0  # input + mask
                per_token += lora_r * bytes_per_value + dropped
    per_layer = tokens * per_token
    if cross_entropy == "plain" or vocab_tp > 1:
        logits = tokens * loss_token_fraction * math.ceil(s["vocab"] / vocab_tp) * 4
    else:
        logits = tokens * loss_token_fraction * s["h"] * bytes_per_value + (0 if lora_r else s["vocab"] * s["h"] * 4)
    if activation_checkpointing:
        return s["layers"] * tokens * s["h"] * bytes_per_value + per_layer + logits
    return s["layers"] * per_layer + logits
