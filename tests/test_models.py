"""The offline default model: built once, deterministic, reloadable like any HF checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distlab import models

FEW_STEPS = dict(steps=3, micro_batch_size=2, seq_len=128, progress=False)  # the real recipe, shortened


def small_corpus(path, n=60):
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"question {i} about the vpn"},
        {"role": "assistant", "content": f"Answer {i}: open Cisco AnyConnect and connect."}]}) + "\n"
        for i in range(n)))
    return path


def test_pretrained_base_build_is_deterministic_and_reloads(tmp_path):
    corpus = small_corpus(tmp_path / "corpus.jsonl")
    a = models.build_default_model(tmp_path / "a", corpus_file=corpus, **FEW_STEPS)
    b = models.build_default_model(tmp_path / "b", corpus_file=corpus, **FEW_STEPS)
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
    out = models.build_default_model(tmp_path / "m", corpus_file=corpus, **FEW_STEPS)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert models.build_default_model(tmp_path / "m", corpus_file=corpus, **FEW_STEPS) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    with open(corpus, "a") as fh:
        fh.write(json.dumps({"prompt": "one more", "response": "row"}) + "\n")
    models.build_default_model(tmp_path / "m", corpus_file=corpus, **FEW_STEPS)
    assert (out / "model.safetensors").stat().st_mtime_ns != stamp


def test_the_cached_default_base_was_pretrained_on_the_other_company():
    """The real default (built once per machine, a few minutes): its loss fell, and it did not see Acme."""
    meta = json.loads((Path(models.build_default_model()) / "distlab_build.json").read_text())
    assert meta["pretrain"] == models.PRETRAIN
    assert meta["final_loss"] < 1.5, meta["final_loss"]
    corpus = models.PRETRAIN_FILE.read_text()
    assert "Acme" not in corpus and "Globex" in corpus


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
    config = models.qwen2_config(models.load_tokenizer(None), **models.QWEN25_05B_SHAPE)
    with torch.device("meta"):
        from transformers import Qwen2ForCausalLM

        model = Qwen2ForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    assert 480e6 < total < 500e6  # Qwen2.5-0.5B has 494M parameters


def test_unknown_model_name_fails_clearly(tmp_path):
    with pytest.raises(OSError):
        models.load_model(str(tmp_path / "does-not-exist"))
