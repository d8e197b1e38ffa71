"""What a step costs: FLOPs per token (for MFU) and the JSONL step log every chapter parses."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


def train_flops_per_token(config, n_trainable_linear: int, seq_len: int, full_finetune: bool) -> float:
    """Model FLOPs per trained token (recomputation from activation checkpointing not counted).

    Forward: 2 FLOPs per weight in every matmul (layers + LM head) plus attention scores and
    values, 4 * layers * seq * hidden. Backward: gradients w.r.t. activations cost the forward
    again twice over (2x); gradients w.r.t. weights (another 2 per weight) only for the weights
    being trained. Full fine-tuning gives the familiar 6N + 12 L S d; LoRA gives 4N + 8 L S d plus
    6 per adapter weight."""
    d, layers = config.hidden_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or d // heads
    ffn = config.intermediate_size
    per_layer = d * heads * head_dim * 2 + d * kv * head_dim * 2 + 3 * d * ffn  # q,o + k,v + gate/up/down
    matmul_weights = layers * per_layer + config.vocab_size * d  # + LM head
    attention = 4 * layers * seq_len * heads * head_dim
    forward = 2 * matmul_weights + attention
    if full_finetune:
        return 3 * forward
    return 2 * forward + 6 * n_trainable_linear


class StepLog:
    """Rank 0 writes `train_log.jsonl`; other ranks write `train_log.rank{r}.jsonl` when asked.

    Each line is one JSON object with an "event": start, step, eval or end."""

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
        with open(self.path, "a") as fh:
            fh.write(strict_json(record) + "\n")  # a diverged run's NaN loss is null, not bare NaN


def strict_json(obj: Any, **kwargs: Any) -> str:
    """JSON text that every parser reads. Python's json writes NaN and Infinity bare, which JSON does not
    have (a strict reader, jq, a browser reject the whole file); here they become null, and anything else
    json cannot write becomes its str()."""
    return json.dumps(_finite(obj), allow_nan=False, default=str, **kwargs)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def read_log(path: str | Path, event: str | None = "step") -> list[dict[str, Any]]:
    """Parse a step log; a bad line is an error naming the file and line, never skipped."""
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
            out.append(rec)
    return out
