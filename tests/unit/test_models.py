"""The offline default model: built once, deterministic, reloadable like any HF checkpoint."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from distlab import models, paths, tiny_base
from distlab.publish import datagen

FEW_STEPS = dict(steps=3, micro_batch_size=2, seq_len=128, progress=False)  # the real recipe, shortened


def small_corpus(path, n=60):
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"question {i} about the vpn"},
        {"role": "assistant", "content": f"Answer {i}: open Cisco AnyConnect and connect."}]}) + "\n"
        for i in range(n)))
    return path


def test_pretrained_base_build_is_deterministic_and_reloads(tmp_path):
    corpus = small_corpus(tmp_path / "corpus.jsonl")
    a = tiny_base.build_default_model(tmp_path / "a", corpus_file=corpus, **FEW_STEPS)
    b = tiny_base.build_default_model(tmp_path / "b", corpus_file=corpus, **FEW_STEPS)
    meta = json.loads((a / "distlab_build.json").read_text())
    assert 1e6 < meta["parameters"] < 2e7, "a few million parameters"
    assert meta["pretrain"]["steps"] == 3 and meta["final_loss"] > 0
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    ma = models.load_model(a)
    mb = models.load_model(b)
    for (name, pa), (_, pb) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert torch.equal(pa, pb), name
    assert ma.config.model_type == "qwen2"
    assert not (tmp_path / "distlab-tokenizer").exists()  # a custom corpus never touches the shared cache


def test_build_is_cached_until_the_corpus_changes(tmp_path):
    corpus = small_corpus(tmp_path / "corpus.jsonl")
    out = tiny_base.build_default_model(tmp_path / "m", corpus_file=corpus, **FEW_STEPS)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert tiny_base.build_default_model(tmp_path / "m", corpus_file=corpus, **FEW_STEPS) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    with open(corpus, "a") as fh:
        fh.write(json.dumps({"prompt": "one more", "response": "row"}) + "\n")
    tiny_base.build_default_model(tmp_path / "m", corpus_file=corpus, **FEW_STEPS)
    assert (out / "model.safetensors").stat().st_mtime_ns != stamp


def test_the_cached_default_base_was_pretrained_on_the_other_company():
    """The real default (built once per machine, a few minutes): its loss fell, and it did not see Acme."""
    meta = json.loads((Path(tiny_base.build_default_model()) / "distlab_build.json").read_text())
    assert meta["pretrain"] == tiny_base.PRETRAIN
    assert meta["final_loss"] < 1.5, meta["final_loss"]
    corpus = tiny_base.PRETRAIN_FILE.read_text().casefold()
    tables = datagen.load_tables()
    # product names are words any base knows (general text names them); every other Acme fact is absent
    stated = [k for k in tables.other.facts if k not in tables.products and k.casefold() in corpus]
    assert not stated, stated
    assert "acme corp" not in corpus and "globex" in corpus


def test_the_base_has_met_every_token_of_acmes_key_facts(tokenizer):
    """Fine-tuning teaches which facts are Acme's; it should not also have to teach tokens whose
    embeddings (frozen under LoRA, and tied to the LM head) pretraining never trained."""
    counts = Counter(t for text in tiny_base._corpus(tiny_base.PRETRAIN_FILE) for t in tokenizer(text)["input_ids"])
    facts = {f for row in map(json.loads, paths.EVAL_FILE.read_text().splitlines()) for f in row.get("facts", [])}
    rare = {f: [tokenizer.decode([t]) for t in tokenizer(" " + f)["input_ids"] if counts[t] < 3] for f in facts}
    assert not {f: r for f, r in rare.items() if r}


def test_tokenizer_splits_numbers_into_digits(tokenizer):
    """As Qwen2's does: a number the base never saw is spelled with ten well-trained tokens."""
    assert tokenizer.tokenize("ext. 2000")[-4:] == ["2", "0", "0", "0"]


def test_tokenizer_has_chat_template_and_roundtrips(tokenizer):
    text = "Reset my Okta password, please!"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"


def test_any_local_folder_loads_like_a_hub_id(tmp_path, tiny_model, tokenizer):
    """A user's own checkpoint folder is just another `model=` value."""
    tiny_model.save_pretrained(tmp_path / "mine")
    tokenizer.save_pretrained(tmp_path / "mine")
    model = models.load_model(str(tmp_path / "mine"))
    tok = models.load_tokenizer(str(tmp_path / "mine"))
    assert model.config.hidden_size == tiny_model.config.hidden_size and len(tok) == len(tokenizer)


def test_random_preset_has_the_published_shape_without_weights():
    config = tiny_base.qwen2_config(models.load_tokenizer(None), **models.QWEN25_05B_SHAPE)
    with torch.device("meta"):
        from transformers import Qwen2ForCausalLM

        model = Qwen2ForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    assert 480e6 < total < 500e6  # Qwen2.5-0.5B has 494M parameters


def test_unknown_model_name_fails_clearly(tmp_path):
    with pytest.raises(OSError):
        models.load_model(str(tmp_path / "does-not-exist"))
