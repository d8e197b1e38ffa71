"""Fixed-config generation for before/after comparisons (the enterprise LoRA demo's contract).

Defaults: temperature 0.2, top_p 0.9, seed 42, re-seeded before every prompt so each answer is
reproducible on its own, whatever the order or number of prompts. `greedy=True` for exact
determinism across machines.

`keyfact_accuracy` answers every row of a prompt file that carries `facts` (data/support/eval.jsonl)
greedily, in left-padded batches, and scores the answers with distlab.keyfacts: the measure of whether
fine-tuning taught the company's facts. Decoding never shows a broken character (`decode_text`)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Sequence

import pandas as pd
import torch

from distlab import keyfacts
from distlab.data import Conversation, load_prompts
from distlab.jsonio import strict_json
from distlab.models import load_model, load_tokenizer, quantization_config
from distlab.paths import EVAL_FILE
from distlab.safe_load import refusal

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
            "response": decode_text(tokenizer, new),
            "new_tokens": int(new.numel()),
            "label": label,
            "config": {"max_new_tokens": max_new_tokens, "greedy": greedy, "seed": seed,
                       **({} if greedy else {"temperature": temperature, "top_p": top_p})},
        })
    model.train(was_training)
    if out_path is not None:
        write_jsonl(rows, out_path)
    return rows


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: byte-level BPE writes every byte as one printable char."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def decode_text(tokenizer, ids, skip_special_tokens: bool = True) -> str:
    """Token ids -> text with no broken characters.

    A byte-level BPE token is a run of bytes, and a UTF-8 character can span two tokens: a sequence cut
    by max_new_tokens (or a model that emits a lone continuation byte) decodes to U+FFFD with
    tokenizer.decode. Here the bytes are joined first and incomplete or invalid sequences dropped. A
    tokenizer that is not byte-level (SentencePiece byte fallback...) is decoded normally and any
    replacement character removed."""
    ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
    if skip_special_tokens:
        special = set(tokenizer.all_special_ids)
        ids = [i for i in ids if i not in special]
    table = _byte_decoder()
    tokens = tokenizer.convert_ids_to_tokens(ids)
    if all(t is not None and all(ch in table for ch in t) for t in tokens):
        text = bytes(table[ch] for t in tokens for ch in t).decode("utf-8", errors="ignore")
    else:
        text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens).replace("\ufffd", "")
    return text.strip()


def _first_question(messages: list[dict]) -> list[dict]:
    """The messages up to and including the first user turn: what a multi-turn row's first answer replies to."""
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    return [m for m in messages[:first_user + 1] if m["role"] != "assistant"]


@torch.no_grad()
def answer_batched(model, tokenizer, conversations: Sequence[list[dict]], max_new_tokens: int = 160,
                   batch_size: int = 16) -> list[str]:
    """Greedy answers to many chat prompts, a left-padded batch at a time (a few times faster than one by
    one on a CPU). Each answer is cut at the first end-of-turn token."""
    device = next(model.parameters()).device
    was_training, side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    answers = []
    try:
        for start in range(0, len(conversations), batch_size):
            texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                     for c in conversations[start:start + batch_size]]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            for row in out[:, enc["input_ids"].shape[1]:].tolist():
                if tokenizer.eos_token_id in row:
                    row = row[:row.index(tokenizer.eos_token_id)]
                answers.append(decode_text(tokenizer, row))
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return answers


def read_fact_rows(path: str | Path = EVAL_FILE, limit: int | None = None) -> list[dict]:
    """{id, facts, chat} for the prompts of a prompt file that carry key facts (every row of
    data/support/eval.jsonl), the first `limit` of them; chat is the conversation up to its first question."""
    rows = [{"id": c.id, "facts": c.facts, "chat": _first_question(c.messages)} for c in load_prompts(path) if c.facts]
    return rows[:limit]


def keyfact_accuracy(model, tokenizer, path: str | Path = EVAL_FILE, max_new_tokens: int = 160,
                     batch_size: int = 16, limit: int | None = None) -> dict:
    """Greedy answers to the fact-carrying rows of `path` and their key-fact accuracy.

    Returns distlab.keyfacts.score_rows' dict plus "answers": [{id, prompt, answer, facts, missing}]."""
    rows = read_fact_rows(path, limit)
    texts = answer_batched(model, tokenizer, [r["chat"] for r in rows], max_new_tokens, batch_size)
    answers = {r["id"]: a for r, a in zip(rows, texts)}
    score = keyfacts.score_rows(rows, answers)
    missing = {r["id"]: r["missing"] for r in score["rows"]}
    score["answers"] = [{"id": r["id"], "prompt": r["chat"][-1]["content"], "answer": answers[r["id"]],
                         "facts": r["facts"], "missing": missing[r["id"]]} for r in rows]
    return score


def load_adapted(adapter_dir: str | Path, model: str | Path | None = None, quantization: str = "none",
                 double_quant: bool = True):
    """A saved LoRA adapter (a run's model/ folder) on its base model, ready to generate. On a full-precision
    base the adapter is merged in: the same model, and generation skips the adapter's extra matmuls. On a
    quantised base (`quantization` as the run trained it) it stays apart, as in training: merging it into
    4-bit weights would round the learnt update onto the quantisation grid."""
    base = load_model(model, quantization=quantization_config(quantization, double_quant))
    tuned = attach_adapter(base, adapter_dir)
    return tuned if quantization != "none" else tuned.merge_and_unload()


def attach_adapter(base, adapter_dir: str | Path):
    """PeftModel of `base` with the saved adapter. PEFT reads adapter_model.safetensors, or an adapter_model.bin
    with torch.load(weights_only=True) (peft.utils.save_and_load.torch_load): an adapter holding anything but
    tensors is refused, in one line naming the folder (distlab.safe_load)."""
    import pickle  # deferred: only a refused adapter needs its exception type

    from peft import PeftModel  # deferred: peft is slow to import

    try:
        return PeftModel.from_pretrained(base, str(adapter_dir))
    except pickle.UnpicklingError as e:
        raise refusal(Path(adapter_dir), "adapter folder", e) from None


def adapter_keyfact_accuracy(adapter_dir: str | Path, model: str | Path | None = None, **kwargs) -> dict:
    """keyfact_accuracy of a saved LoRA adapter on its base model (e.g. after a DDP run: the run's model/)."""
    return keyfact_accuracy(load_adapted(adapter_dir, model), load_tokenizer(model), **kwargs)


def write_jsonl(rows: Sequence[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(strict_json(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def side_by_side(before: Sequence[dict], after: Sequence[dict]):
    """A table of prompt | before | after, matched by id (a missing partner is an error)."""

    after_by_id = {r["id"]: r for r in after}
    missing = [r["id"] for r in before if r["id"] not in after_by_id]
    if missing or len(after) != len(before):
        raise ValueError(f"before/after rows do not match: missing ids {missing}")
    return pd.DataFrame([{"id": r["id"], "prompt": r["prompt"], "before": r["response"],
                          "after": after_by_id[r["id"]]["response"]} for r in before])
