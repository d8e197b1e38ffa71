"""Pipeline inference (distlab.inference) under torchrun: greedy tokens are identical to single-process
`model.generate()` with a KV cache on every demo prompt, for 2 and 3 stages, batch sizes 1/2/4 with left padding
(one torchrun launch per stage count sweeps the batch sizes); a LoRA adapter merged stage by stage answers like
PEFT's merged model. Stages loading only their own weights, in one process: tests/unit/test_pipeline_inference.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import pytest
import torch

from distlab.inference.batches import read_prompts
from distlab.launch import process
from distlab.models import load_model
from distlab.paths import DEMO_PROMPTS
from helpers import generate_reference

NEW_TOKENS = 6
SIZES = (1, 2, 4)




def launch(nproc: int, out_dir: Path, *args: str):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "distlab.inference", "--out-dir", str(out_dir), "--max-new-tokens", str(NEW_TOKENS), *args]
    return process.run(cmd, timeout_s=240, log_path=out_dir / "launch.log", echo=False)


def completions(path: Path) -> dict[str, list[int]]:
    return {r["id"]: r["tokens"] for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.parametrize("stages", [2, 3])
def test_pipelined_greedy_is_token_identical(random_tiny_dir, random_tiny_tokenizer, tmp_path, stages):
    model = load_model(random_tiny_dir).eval()
    launch(stages, tmp_path, "--model", str(random_tiny_dir), "--batch-size", ",".join(map(str, SIZES)))
    prompts = read_prompts(DEMO_PROMPTS)
    for size in SIZES:
        got = completions(tmp_path / f"b{size}" / "completions.jsonl")
        want = generate_reference(model, random_tiny_tokenizer, size, NEW_TOKENS)
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


def test_lora_adapter_merged_per_stage(random_tiny_dir, random_tiny_tokenizer, tmp_path):
    from peft import LoraConfig, get_peft_model  # deferred: only this test needs peft

    torch.manual_seed(0)
    adapter = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    peft_model = get_peft_model(load_model(random_tiny_dir), adapter)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.2)  # a fresh adapter is a no-op: make it change the answers
    peft_model.save_pretrained(tmp_path / "adapter")
    merged = peft_model.merge_and_unload().eval()
    launch(2, tmp_path / "run", "--model", str(random_tiny_dir), "--adapter", str(tmp_path / "adapter"),
           "--batch-size", "4")
    got = completions(tmp_path / "run" / "completions.jsonl")
    assert got == generate_reference(merged, random_tiny_tokenizer, 4, NEW_TOKENS)
    assert got != generate_reference(load_model(random_tiny_dir).eval(), random_tiny_tokenizer, 4, NEW_TOKENS)
