"""What a step costs: FLOPs per token (for MFU and HFU) and the JSONL step log every chapter parses."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from distlab.jsonio import non_finite_fields, strict_json


def train_flops_per_token(config, n_trainable_linear: int, seq_len: float, full_finetune: bool,
                          label_fraction: float = 1.0, recompute: bool = False) -> float:
    """Training FLOPs per real token, PaLM's way (Chowdhery et al. 2022, appendix B), counting
    matmuls only (norms, softmax and the optimizer are left out).

    Which positions count: the decoder layers run at every real token; the LM head at the
    `label_fraction` of tokens that carry a label (in pretraining every token does, which gives
    PaLM's 6N); attention scores and values cost 4 * layers * seq_len * heads * head_dim per token
    in the forward, a full seq_len x seq_len square (causal masking not halved, as PaLM counts).

    Forward: 2 FLOPs per weight and token. Backward: gradients w.r.t. activations cost the forward
    again (2 per weight), and gradients w.r.t. weights 2 more per weight, but only for the weights
    being trained. Attention's two matmuls multiply activations by activations, so their backward
    needs both operands' gradients (dQ and dK, dP and dV: twice the forward) whether or not any weight
    trains. Full fine-tuning: 6N + 12 L S d. LoRA: 4N for the frozen weights (forward and backward
    through them) + 12 L S d + 6 per adapter weight (forward, activation and weight gradients).
    `recompute` adds the forward of the layers again (activation checkpointing)."""
    d, layers = config.hidden_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or d // heads
    ffn = config.intermediate_size
    per_layer = d * heads * head_dim * 2 + d * kv * head_dim * 2 + 3 * d * ffn  # q,o + k,v + gate/up/down
    weights_forward = 2 * layers * per_layer + 2 * config.vocab_size * d * label_fraction  # layers + LM head
    attention_forward = 4 * layers * seq_len * heads * head_dim
    passes = 3 if full_finetune else 2  # forward + activation gradients (+ weight gradients)
    adapter = 0 if full_finetune else 6 * n_trainable_linear
    recomputed = 2 * layers * per_layer + attention_forward if recompute else 0
    return passes * weights_forward + 3 * attention_forward + adapter + recomputed


def mean_attention_span(document_lengths) -> float:
    """Keys per query, averaged over tokens, when every document attends only to itself (the
    full square per document): sum(l^2) / sum(l). Put in train_flops_per_token's seq_len, it
    counts the attention a per-document kernel executes instead of the whole packed row's."""
    lengths = list(document_lengths)
    return sum(n * n for n in lengths) / sum(lengths)


def utilisation(tokens_per_s: float, flops_per_token: float, peak_flops: float, world_size: int = 1) -> float:
    """FLOP/s achieved over the peak of all devices: MFU with model FLOPs, HFU with executed ones."""
    return tokens_per_s * flops_per_token / (peak_flops * world_size)


class StepLog:
    """Rank 0 writes `train_log.jsonl`; other ranks write `train_log.rank{r}.jsonl` when asked.

    Each line is one JSON object with an "event": start, step, eval or end. A non-finite number (a
    diverged loss, an infinite gradient norm) is written as null, and the record's "non_finite" lists
    those fields: null alone means "not measured" (comm_time_s without measure_comm), not "diverged"."""

    def __init__(self, output_dir: str | Path, rank: int = 0, all_ranks: bool = False):
        self.rank = rank
        self.path = None
        if rank == 0 or all_ranks:
            out = Path(output_dir)
            out.mkdir(parents=True, exist_ok=True)
            self.path = out / ("train_log.jsonl" if rank == 0 else f"train_log.rank{rank}.jsonl")
            self.path.write_text("")

    def restore(self, saved: Path) -> None:
        """Continue from a checkpoint's copy of the rank-0 log (other ranks start a new segment)."""
        if self.path is not None and self.rank == 0 and saved.exists():
            self.path.write_text(saved.read_text())

    def write(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        record = {"event": event, "time": round(time.time(), 3), "rank": self.rank, **fields}
        non_finite = non_finite_fields(fields)
        if non_finite:
            record["non_finite"] = non_finite
        with open(self.path, "a") as fh:
            fh.write(strict_json(record) + "\n")  # a diverged run's NaN loss is null, not bare NaN


def read_log(path: str | Path, event: str | None = "step") -> list[dict[str, Any]]:
    """Parse a step log; a bad line is an error naming the file and line, never skipped.

    A field the record lists in "non_finite" reads back as NaN (NaN or an infinity when written: either
    way the step diverged), so that sums, means and plots carry it on as NaN instead of failing on None."""
    path = Path(path)
    out = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON in step log: {e.msg}") from e
        if event is None or rec.get("event") == event:
            out.append(_restore_non_finite(rec, f"{path}:{lineno}"))
    return out


def _restore_non_finite(rec: dict[str, Any], where: str) -> dict[str, Any]:
    marked = rec.get("non_finite", [])
    if not (isinstance(marked, list) and all(isinstance(name, str) for name in marked)):
        raise ValueError(f"{where}: non_finite is {marked!r}, not a list of field names")
    for name in marked:
        if name not in rec:  # StepLog marks only fields it wrote, as null: anything else is a damaged line
            raise ValueError(f"{where}: non_finite names {name!r}, which the record does not have")
        if rec[name] is not None:
            raise ValueError(f"{where}: field {name!r} is marked non_finite but holds {rec[name]!r}")
        rec[name] = math.nan
    return rec
