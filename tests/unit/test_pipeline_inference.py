"""Pipeline inference (distlab.inference) in one process: stages load only their own weights, one stage's greedy
tokens are `model.generate()`'s with a KV cache, and sampling is seeded. 2 and 3 stages under torchrun, and a
LoRA adapter merged stage by stage: tests/launches/test_pipeline_inference_runs.py."""

from __future__ import annotations

from distlab.inference.batches import micro_batches, read_prompts
from distlab.inference.engine import Pipeline, Sampling
from distlab.inference.stage import InferenceStage
from distlab.inference.stage_weights import checkpoint_bytes
from distlab.layer_split import split_layers
from distlab.models import load_model
from distlab.paths import DEMO_PROMPTS
from helpers import generate_reference

NEW_TOKENS = 6




def test_stage_reads_only_its_layers(random_tiny_dir):
    config = load_model(random_tiny_dir).config
    ranges = split_layers(config.num_hidden_layers, 2)
    total = checkpoint_bytes(random_tiny_dir)
    held = []
    for s, r in enumerate(ranges):
        stage = InferenceStage(config, r, first=s == 0, last=s == 1)
        info = stage.load(random_tiny_dir)
        assert info["layers"] == list(r)
        assert info["read_bytes"] < 0.75 * total
        held.append(stage.param_bytes())
    assert all(h < 0.75 * total for h in held)


def test_one_stage_in_process_matches_generate(random_tiny_dir, random_tiny_tokenizer):
    model = load_model(random_tiny_dir).eval()
    want = generate_reference(model, random_tiny_tokenizer, 4, NEW_TOKENS)
    stage = InferenceStage(model.config, range(model.config.num_hidden_layers), True, True)
    stage.load(random_tiny_dir)
    pipe = Pipeline(stage, 0, 1, stage.config, random_tiny_tokenizer.eos_token_id, random_tiny_tokenizer.pad_token_id,
                    Sampling(NEW_TOKENS))
    states = pipe.run(micro_batches(random_tiny_tokenizer, read_prompts(DEMO_PROMPTS), 4))
    got = {pid: st.tokens[r] for st in states for r, pid in enumerate(st.mb.ids)}
    assert got == want


def test_sampling_is_seeded(random_tiny_dir, random_tiny_tokenizer):
    model = load_model(random_tiny_dir)
    stage = InferenceStage(model.config, range(model.config.num_hidden_layers), True, True)
    stage.load(random_tiny_dir)
    batches = micro_batches(random_tiny_tokenizer, read_prompts(DEMO_PROMPTS)[:2], 2)
    runs = []
    for seed in (1, 1, 2):
        cfg = Sampling(NEW_TOKENS, greedy=False, temperature=1.0, top_p=0.9, seed=seed)
        tok = random_tiny_tokenizer
        pipe = Pipeline(stage, 0, 1, stage.config, tok.eos_token_id, tok.pad_token_id, cfg)
        runs.append([st.tokens for st in pipe.run(batches)])
    assert runs[0] == runs[1] and runs[0] != runs[2]
