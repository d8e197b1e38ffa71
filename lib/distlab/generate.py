"""Fixed-config generation for before/after comparisons (the enterprise-assistant seed's contract).

Defaults: temperature 0.2, top_p 0.9, seed 42, re-seeded before every prompt so each answer is
reproducible on its own, whatever the order or number of prompts. `greedy=True` for exact
determinism across machines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import pandas as pd
import torch

from distlab.data import Conversation, load_prompts

GENERATION_DEFAULTS = {"max_new_tokens": 96, "temperature": 0.2, "top_p": 0.9, "seed": 42}


@torch.no_grad()
def generate(model, tokenizer, prompts: Sequence[Conversation] | Sequence[str] | str | Path,
             max_new_tokens: int = GENERATION_DEFAULTS["max_new_tokens"],
             temperature: float = GENERATION_DEFAULTS["temperature"], top_p: float = GENERATION_DEFAULTS["top_p"],
             seed: int = GENERATION_DEFAULTS["seed"], greedy: bool = False,
             out_path: str | Path | None = None, label: str = "") -> list[dict]:
    """Answer each prompt; returns rows {id, prompt, response, ...} and writes them as JSONL."""
    if isinstance(prompts, (str, Path)):
        prompts = load_prompts(prompts)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    rows = []
    for i, p in enumerate(prompts):
        messages = [{"role": "user", "content": p}] if isinstance(p, str) else \
            [m for m in p.messages if m["role"] != "assistant"]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        enc = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(device)
        torch.manual_seed(seed)
        sampling = {} if greedy else {"temperature": temperature, "top_p": top_p}
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=not greedy,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **sampling)
        new = out[0, enc["input_ids"].shape[1]:]
        rows.append({
            "id": (p.id if isinstance(p, Conversation) else None) or f"prompt-{i}",
            "prompt": messages[-1]["content"],
            "response": tokenizer.decode(new, skip_special_tokens=True).strip(),
            "new_tokens": int(new.numel()),
            "label": label,
            "config": {"max_new_tokens": max_new_tokens, "greedy": greedy, "seed": seed,
                       **({} if greedy else {"temperature": temperature, "top_p": top_p})},
        })
    model.train(was_training)
    if out_path is not None:
        write_jsonl(rows, out_path)
    return rows


def write_jsonl(rows: Sequence[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def side_by_side(before: Sequence[dict], after: Sequence[dict]):
    """A table of prompt | before | after, matched by id (a missing partner is an error)."""

    after_by_id = {r["id"]: r for r in after}
    missing = [r["id"] for r in before if r["id"] not in after_by_id]
    if missing or len(after) != len(before):
        raise ValueError(f"before/after rows do not match: missing ids {missing}")
    return pd.DataFrame([{"id": r["id"], "prompt": r["prompt"], "before": r["response"],
                          "after": after_by_id[r["id"]]["response"]} for r in before])
