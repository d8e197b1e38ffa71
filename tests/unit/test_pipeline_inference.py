"""Pipeline inference (distlab.inference) in one process: stages load only their own weights, one stage's greedy
tokens are `model.generate()`'s with a KV cache, and sampling is seeded. 2 and 3 stages under torchrun, and a
LoRA adapter merged stage by stage: tests/launches/test_pipeline_inference_runs.py."""

from __future__ import annotations

import pytest

from distlab.inference.batches import micro_batches, read_prompts
from distlab.inference.engine import Pipeline, Sampling
from distlab.inference.stage import InferenceStage
from distlab.inference.stage_weights import checkpoint_bytes, random_checkpoint
from distlab.layer_split import split_layers
from distlab.models import load_model, load_tokenizer
from distlab.paths import DEMO_PROMPTS
from helpers import generate_reference

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir():
    return random_checkpoint("test-tiny")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def test_stage_reads_only_its_layers(model_dir):
    config = load_model(model_dir).config
    ranges = split_layers(config.num_hidden_layers, 2)
    total = checkpoint_bytes(model_dir)
    held = []
    for s, r in enumerate(ranges):
        stage = InferenceStage(config, r, first=s == 0, last=s == 1)
        info = stage.load(model_dir)
        assert info["layers"] == list(r)
        assert info["read_bytes"] < 0.75 * total
        held.append(stage.param_bytes())
    assert all(h < 0.75 * total for h in held)


def test_one_stage_in_process_matches_generate(model_dir, tokenizer):
    model = load_model(model_dir).eval()
    want = generate_reference(model, tokenizer, 4, NEW_TOKENS)
    stage = InferenceStage(model.config, range(model.config.num_hidden_layers), True, True)
    stage.load(model_dir)
    pipe = Pipeline(stage, 0, 1, stage.config, tokenizer.eos_token_id, tokenizer.pad_token_id, Sampling(NEW_TOKENS))
    states = pipe.run(micro_batches(tokenizer, read_prompts(DEMO_PROMPTS), 4))
    got = {pid: st.tokens[r] for st in states for r, pid in enumerate(st.mb.ids)}
    assert got == want


def test_sampling_is_seeded(model_dir, tokenizer):
    model = load_model(model_dir)
    stage = InferenceStage(model.config, range(model.config.num_hidden_layers), True, True)
    stage.load(model_dir)
    batches = micro_batches(tokenizer, read_prompts(DEMO_PROMPTS)[:2], 2)
    runs = []
    for seed in (1, 1, 2):
        cfg = Sampling(NEW_TOKENS, greedy=False, temperature=1.0, top_p=0.9, seed=seed)
        pipe = Pipeline(stage, 0, 1, stage.config, tokenizer.eos_token_id, tokenizer.pad_token_id, cfg)
        runs.append([st.tokens for st in pipe.run(batches)])
    assert runs[0] == runs[1] and runs[0] != runs[2]
