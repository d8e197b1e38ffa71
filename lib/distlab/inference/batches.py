"""Prompts as micro-batches: chat-templated like distlab.generate, left-padded (every row's last prompt
token sits in the last column, so the next token is read from one position for all rows), with the
position ids `model.generate()` derives from the padding mask. Every rank builds the same batches from
the same file, so only hidden states and sampled tokens need to cross stage boundaries."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from distlab.data import Conversation, load_prompts


@dataclass
class MicroBatch:
    index: int
    ids: list[str]            # prompt ids, one per row
    prompts: list[str]        # the user's text, one per row
    input_ids: torch.Tensor   # (rows, width), left-padded
    attention_mask: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    def position_ids(self) -> torch.Tensor:
        """As transformers' generate computes them: cumulative count of real tokens, pads at 0."""
        pos = self.attention_mask.long().cumsum(-1) - 1
        return pos.masked_fill(self.attention_mask == 0, 0)


def read_prompts(source: str | Path | Sequence) -> list[tuple[str, str]]:
    """(id, last user turn) pairs, the shape micro_batches takes, from a prompt file (read by
    distlab.data.load_prompts, the one reader: its ids, its checks) or a list of strings / Conversations."""
    items = load_prompts(source) if isinstance(source, (str, Path)) else list(source)
    out = []
    for i, p in enumerate(items):
        if isinstance(p, Conversation):
            users = [m["content"] for m in p.messages if m["role"] == "user"]
            out.append((p.id or f"prompt-{i}", users[-1]))
        else:
            out.append((f"prompt-{i}", str(p)))
    return out


def encode(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids, mask


def micro_batches(tokenizer, prompts: list[tuple[str, str]], batch_size: int) -> list[MicroBatch]:
    """Consecutive prompts, `batch_size` rows per micro-batch (the last may be smaller)."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: need at least 1 row per micro-batch")
    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        ids, mask = left_pad([encode(tokenizer, text) for _, text in chunk], tokenizer.pad_token_id)
        out.append(MicroBatch(len(out), [i for i, _ in chunk], [t for _, t in chunk], ids, mask))
    return out
