"""The offline default model: built once, deterministic, reloadable like any HF checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from distlab import models


def test_default_build_is_deterministic_and_reloads(tmp_path):
    a = models.build_default_model(tmp_path / "a")
    b = models.build_default_model(tmp_path / "b")
    meta = json.loads((a / "distlab_build.json").read_text())
    assert 1e6 < meta["parameters"] < 2e7, "a few million parameters"
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    ma = models.load_model(a)
    mb = models.load_model(b)
    for (name, pa), (_, pb) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert torch.equal(pa, pb), name
    assert ma.config.model_type == "qwen2"


def test_build_is_cached_until_the_data_changes(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"question {i} about vpn", "response": f"answer {i}"}) + "\n"
                             for i in range(50)))
    out = models.build_default_model(tmp_path / "m", train_file=train)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert models.build_default_model(tmp_path / "m", train_file=train) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    with open(train, "a") as fh:
        fh.write(json.dumps({"prompt": "one more", "response": "row"}) + "\n")
    models.build_default_model(tmp_path / "m", train_file=train)
    assert json.loads((out / "distlab_build.json").read_text())["hash"] != ""
    assert (out / "model.safetensors").stat().st_mtime_ns != stamp


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
