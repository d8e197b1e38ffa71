"""Pipeline inference (distlab.inference): stages load only their own weights, and greedy tokens are
identical to single-process `model.generate()` with a KV cache on every demo prompt, for 2 and 3 stages,
batch sizes 1/2/4 with left padding (one torchrun launch per stage count sweeps the batch sizes); a LoRA
adapter merged stage by stage answers like PEFT's merged model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import pytest
import torch

from distlab.inference.batches import micro_batches, read_prompts
from distlab.inference.engine import Pipeline, Sampling
from distlab.inference.stage import InferenceStage
from distlab.inference.stage_weights import checkpoint_bytes, random_checkpoint
from distlab.launch import process
from distlab.layer_split import split_layers
from distlab.models import load_model, load_tokenizer
from distlab.paths import DEMO_PROMPTS

NEW_TOKENS = 6
SIZES = (1, 2, 4)


@pytest.fixture(scope="module")
def model_dir():
    return random_checkpoint("test-tiny")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def reference(model, tokenizer, batch_size: int) -> dict[str, list[int]]:
    """model.generate() with its KV cache on the same left-padded micro-batches; tokens up to EOS."""
    out = {}
    for mb in micro_batches(tokenizer, read_prompts(DEMO_PROMPTS), batch_size):
        with torch.no_grad():
            gen = model.generate(input_ids=mb.input_ids, attention_mask=mb.attention_mask, do_sample=False,
                                 max_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id, use_cache=True)
        for r, pid in enumerate(mb.ids):
            toks = gen[r, mb.input_ids.shape[1]:].tolist()
            if tokenizer.eos_token_id in toks:
                toks = toks[:toks.index(tokenizer.eos_token_id) + 1]
            out[pid] = toks
    return out


def launch(nproc: int, out_dir: Path, *args: str):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "distlab.inference", "--out-dir", str(out_dir), "--max-new-tokens", str(NEW_TOKENS), *args]
    return process.run(cmd, timeout_s=240, log_path=out_dir / "launch.log", echo=False)


def completions(path: Path) -> dict[str, list[int]]:
    return {r["id"]: r["tokens"] for r in map(json.loads, path.read_text().splitlines())}


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
    want = reference(model, tokenizer, 4)
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


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3])
def test_pipelined_greedy_is_token_identical(model_dir, tokenizer, tmp_path, stages):
    model = load_model(model_dir).eval()
    launch(stages, tmp_path, "--model", str(model_dir), "--batch-size", ",".join(map(str, SIZES)))
    prompts = read_prompts(DEMO_PROMPTS)
    for size in SIZES:
        got, want = completions(tmp_path / f"b{size}" / "completions.jsonl"), reference(model, tokenizer, size)
        assert set(got) == {pid for pid, _ in prompts}
        mismatched = [pid for pid in want if got[pid] != want[pid]]
        assert not mismatched, f"{stages} stages, batch {size}: tokens differ on {mismatched}"
        summary = json.loads((tmp_path / f"b{size}" / "summary.json").read_text())
        assert summary["stages"] == stages and summary["new_tokens"] == sum(map(len, want.values()))
        for rank in range(stages):
            stage = json.loads((tmp_path / f"b{size}" / f"stage{rank}.json").read_text())
            assert stage["memory"]["stage_param_bytes"] < 0.8 * stage["memory"]["checkpoint_bytes"]
            assert stage["events"], f"rank {rank} recorded no timeline"
    assert (tmp_path / "rank0.log").read_text().count("generating") == len(SIZES)
    assert not [p for p in psutil.Process().children(recursive=True) if p.is_running()]


@pytest.mark.slow
def test_lora_adapter_merged_per_stage(model_dir, tokenizer, tmp_path):
    from peft import LoraConfig, get_peft_model  # deferred: only this test needs peft

    torch.manual_seed(0)
    peft_model = get_peft_model(load_model(model_dir), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                                  "down_proj"]))
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.2)  # a fresh adapter is a no-op: make it change the answers
    peft_model.save_pretrained(tmp_path / "adapter")
    merged = peft_model.merge_and_unload().eval()
    launch(2, tmp_path / "run", "--model", str(model_dir), "--adapter", str(tmp_path / "adapter"), "--batch-size", "4")
    got = completions(tmp_path / "run" / "completions.jsonl")
    assert got == reference(merged, tokenizer, 4)
    assert got != reference(load_model(model_dir).eval(), tokenizer, 4)
