"""The wire-bytes model: what each rank sends per optimizer step, from a model config alone (torch-free).

`communication_bytes` is the planner's estimate for every strategy (ring collectives: (k-1)/k of the buffer per
pass), which the decision tree in distlab.planning.advice weighs against the link; `step_bytes_sent` the same
for one step of distlab's ddp, fsdp and tp (with and without sequence parallelism, the vocabulary split, LoRA)
as they really run, part by part, which chapter 07 sets against the collectives it counts
(distlab.measure.collectives).
"""

from __future__ import annotations

import math

from distlab.config import PIPELINE_STRATEGIES
from distlab.planning.plan import TP_ROWWISE, TP_SPLIT, tp_sliced
from distlab.planning.shapes import config_value, parameter_layout


def communication_bytes(config, strategy: str, world_size: int, *, lora_r: int | None = None, lora_targets=None,
                        weight_bytes: float = 2, grad_bytes: float = 4, tokens: int = 2048,
                        activation_bytes: float = 2, tp_size: int = 2) -> float:
    """Bytes each rank sends per optimizer step (ring collectives: (k-1)/k of the buffer per pass).

    ddp (and the pipelines' data-parallel replicas): one all-reduce of the trained gradients (2
    passes). zero2: a reduce-scatter of the gradients and an all-gather of the updated trained
    weights: the same volume. fsdp / zero3: every weight is all-gathered twice (forward and backward,
    in the compute dtype), plus a reduce-scatter of the gradients; with LoRA that still means
    all-gathering the frozen base model at every step. fsdp_tp: FSDP's volume over the world / tp_size
    groups for each rank's 1/tp_size of the projections, plus tensor parallelism's 4 all-reduces of
    activations per decoder layer (2 forward, 2 backward) of `tokens` x hidden values each."""
    k = world_size
    if k <= 1:
        return 0.0
    layout = parameter_layout(config, lora_r, lora_targets)
    trained = sum(p.numel for p in layout if p.trainable)
    every = sum(p.numel for p in layout)
    ring = (k - 1) / k
    if strategy == "ddp" or strategy in PIPELINE_STRATEGIES:
        return 2 * ring * trained * grad_bytes
    if strategy == "zero2":
        return ring * trained * grad_bytes + ring * trained * weight_bytes
    if strategy in ("fsdp", "zero3"):
        return 2 * ring * every * weight_bytes + ring * trained * grad_bytes
    if strategy == "fsdp_tp":
        dp, tp = k // tp_size, tp_size
        held = [p.numel / tp if tp_sliced(p.name) else p.numel for p in layout]
        held_trained = sum(h for h, p in zip(held, layout) if p.trainable)
        dp_ring = (dp - 1) / dp
        fsdp = 2 * dp_ring * sum(held) * weight_bytes + dp_ring * held_trained * grad_bytes
        layers, hidden = config_value(config, "num_hidden_layers"), config_value(config, "hidden_size")
        activations = 4 * layers * tokens * hidden * activation_bytes
        return fsdp + 2 * (tp - 1) / tp * activations
    return 0.0


SCALAR_BYTES = 8  # tp's gradient norm: one float64 all-reduced per step (strategies.tp.global_grad_norm)
LOSS_STATISTIC_BYTES = 4  # vocab_parallel's per-token loss statistics: fp32 (the loss casts its logits to fp32)


def step_bytes_sent(config, strategy: str, world_size: int, *, rows: int, seq_len: int, value_bytes: float = 4,
                    sequence_parallel: bool = False, vocab_parallel: bool = False,
                    label_tokens: int | None = None, lora_r: int | None = None) -> dict[str, float]:
    """Bytes one rank sends in one optimizer step of full fine-tuning, as distlab's strategies run it, by
    part: `rows` x `seq_len` tokens per step in all (ddp and fsdp give each rank rows / world of them, tp
    gives every rank all of them), one micro-batch, weights, gradients and activations of `value_bytes`
    each (fp32 on CPU). On a ring a rank sends (k-1)/k of a buffer per pass: an all-gather or a
    reduce-scatter is one pass, an all-reduce two (a reduce-scatter then an all-gather). tp with
    `vocab_parallel` adds the vocabulary split's all-reduces, which depend on the step's `label_tokens`.
    tp with `lora_r` (plain tp only): LoRA of rank r on all seven projections instead of full fine-tuning."""
    k = world_size
    ring = (k - 1) / k
    layout = parameter_layout(config)
    layers, hidden = config_value(config, "num_hidden_layers"), config_value(config, "hidden_size")
    if strategy == "ddp":
        # every gradient all-reduced once, in buckets; the activations never leave a rank
        return {"gradients (all-reduce)": 2 * ring * sum(p.numel for p in layout) * value_bytes}
    if strategy == "fsdp":
        # FSDP2 pads each tensor's first dimension to a multiple of k before cutting it into k shards
        padded = {p.name: math.ceil(p.shape[0] / k) * k * math.prod(p.shape[1:]) for p in layout}
        in_layers = sum(n for name, n in padded.items() if name.startswith("model.layers."))
        # a layer's weights are gathered for its forward and again for its backward; the root (embedding, final
        # norm, untied head) once: FSDP2 keeps the root gathered from forward to backward
        return {"weights (all-gather)": ring * (2 * in_layers + sum(padded.values()) - in_layers) * value_bytes,
                "gradients (reduce-scatter)": ring * sum(padded.values()) * value_bytes}
    if strategy != "tp":
        raise ValueError(f"step_bytes_sent knows ddp, fsdp and tp, not {strategy!r}")
    activation = rows * seq_len * hidden * value_bytes  # one b x s x h tensor: every rank holds every row
    norm_grad = {"gradient norm (all-reduce)": 2 * ring * SCALAR_BYTES}
    vocab = {}
    if vocab_parallel:
        if label_tokens is None:
            raise ValueError("step_bytes_sent: vocab_parallel needs the step's label_tokens")
        # the embedding's partial lookups summed (forward); the loss's 3 fp32 values per label token (largest
        # logit, sum of exponentials, target logit); the head's input gradient at the label tokens (backward)
        vocab = {"embedding output (all-reduce)": 2 * ring * activation,
                 "loss statistics (all-reduce)": 2 * ring * 3 * label_tokens * LOSS_STATISTIC_BYTES,
                 "LM head input gradient (all-reduce)": 2 * ring * label_tokens * hidden * value_bytes}
    if lora_r is not None and (sequence_parallel or vocab_parallel):
        raise ValueError("step_bytes_sent counts LoRA for plain tp only")
    if not sequence_parallel:
        # forward: each row-parallel projection's partial sums; backward: each block's input gradient, the
        # column-parallel projections' partial sums added first (strategies.tp.block_input_plan): Megatron's 2
        blocks = len(TP_ROWWISE)
        if lora_r is None:
            return {"activations (all-reduce)": 2 * ring * 2 * blocks * layers * activation, **vocab, **norm_grad}
        # LoRA: the embedding is frozen, so nothing needs the first attention block's input gradient (one sum
        # fewer). A row-parallel projection's lora_A sums its r outputs a token (forward); a column-parallel
        # one's lora_A, whole, reads the block input DTensor, so its r x hidden gradient is a partial sum,
        # all-reduced once a step (strategies.tp.sum_partial_gradients)
        columns = len(TP_SPLIT) - blocks
        return {"activations (all-reduce)": 2 * ring * (2 * blocks * layers - 1) * activation,
                "LoRA factor outputs (all-reduce)": 2 * ring * blocks * layers * rows * seq_len * lora_r * value_bytes,
                "LoRA factor gradients (all-reduce)": 2 * ring * columns * layers * lora_r * hidden * value_bytes,
                **norm_grad}
    # per block: all-gather in, reduce-scatter out, and their mirrors in backward (the block's inputs summed once):
    # 8 single passes per layer, the bytes of 4 all-reduces. Once per step: the final norm's output gathered for
    # the head, and the first layer's input gradient gathered for the embedding. The norms' weights see only
    # this rank's tokens, so their gradients (2 per layer and the final norm, `hidden` values) are all-reduced.
    return {"activations (all-gather, reduce-scatter)": ring * (8 * layers + 2) * activation, **vocab,
            "norm weight gradients (all-reduce)": 2 * ring * (2 * layers + 1) * hidden * value_bytes, **norm_grad}
