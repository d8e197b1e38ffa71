"""Helpers that tests of more than one tier use (tests/unit, tests/launches, ...). Importable as `helpers` from any
of them: pytest puts this folder, the root conftest.py's, on sys.path, and a tier's own folder only while that tier
is collected, so a helper shared across tiers lives here, not in a test module."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path


def alias_bomb(levels: int = 9) -> str:
    """The billion laughs: 9 levels of 9 aliases each, 9**9 strings once expanded, 600 bytes of YAML."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- Kubernetes: a stand-in kubectl

FAKE_KUBECTL = """#!/usr/bin/env bash
set -euo pipefail
printf '%s\\n' "$*" >> "$FAKE_KUBECTL_DIR/calls"
case "$1" in
  get) cat "$FAKE_KUBECTL_DIR/pods.json" ;;
  logs) pod="${!#}"; cat "$FAKE_KUBECTL_DIR/logs/${pod#pod/}.log" ;;
  *) echo "fake kubectl: unexpected $*" >&2; exit 1 ;;
esac
"""


def fake_kubectl(tmp_path: Path, monkeypatch, logs: dict[str, str], pods: list[tuple[str, int, str, str]]) -> Path:
    """A stand-in kubectl on PATH that answers `get pods` with `pods` (name, index, created, phase) and
    `logs pod/NAME` with logs[NAME]."""
    from distlab.launch.kubernetes import collect  # deferred: only the collector's tests need it

    folder = tmp_path / "kubectl"
    (folder / "logs").mkdir(parents=True)
    (folder / "kubectl").write_text(FAKE_KUBECTL)
    (folder / "kubectl").chmod(0o755)
    items = [{"metadata": {"name": n, "creationTimestamp": t, "labels": {"distlab.io/run": "ddp-2gpu"},
                           "annotations": {collect.INDEX_KEY: str(i)}}, "status": {"phase": p}}
             for n, i, t, p in pods]
    (folder / "pods.json").write_text(json.dumps({"items": items}))
    for name, text in logs.items():
        (folder / "logs" / f"{name}.log").write_text(text)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_KUBECTL_DIR", str(folder))
    return folder


# ---------------------------------------------------------------------- pipeline inference: the reference

def generate_reference(model, tokenizer, batch_size: int, new_tokens: int) -> dict[str, list[int]]:
    """model.generate() with its KV cache on the demo prompts' left-padded micro-batches; tokens up to EOS, by id."""
    import torch  # deferred: as the imports below, for the inference tests only

    from distlab.inference.batches import micro_batches, read_prompts
    from distlab.paths import DEMO_PROMPTS

    out = {}
    for mb in micro_batches(tokenizer, read_prompts(DEMO_PROMPTS), batch_size):
        with torch.no_grad():
            gen = model.generate(input_ids=mb.input_ids, attention_mask=mb.attention_mask, do_sample=False,
                                 max_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id, use_cache=True)
        for r, pid in enumerate(mb.ids):
            toks = gen[r, mb.input_ids.shape[1]:].tolist()
            if tokenizer.eos_token_id in toks:
                toks = toks[:toks.index(tokenizer.eos_token_id) + 1]
            out[pid] = toks
    return out


# ---------------------------------------------------------------------- safe loading: checkpoints that run code

class RunsCommand:
    """What a crafted checkpoint holds: unpickling it runs `touch <marker>`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def craft(path: Path, marker: Path) -> None:
    import torch  # deferred: the safe-loading tests only

    torch.save({"step": 2, "payload": RunsCommand(marker)}, path)


# 3 steps, one checkpoint kept, written after step 2 (none at the last step): a resume trains step 3 again
CHECKPOINTED_RUN = {"max_steps": 3, "checkpoint_steps": 1, "keep_checkpoints": 1, "seq_len": 128,
                    "micro_batch_size": 2, "warmup_steps": 1, "logging_steps": 1, "eval_file": "null",
                    "save_model": "false", "progress": "false"}


def checkpointed_run_argv(output_dir: Path, **extra) -> list[str]:
    """`python -m distlab.train`'s arguments for CHECKPOINTED_RUN of tiny_lora.yaml into output_dir."""
    from distlab.paths import REPO_ROOT  # deferred: helpers imports no distlab module up front

    out = ["--config", str(REPO_ROOT / "lib" / "distlab" / "configs" / "tiny_lora.yaml")]
    for key, value in {**CHECKPOINTED_RUN, "output_dir": output_dir, **extra}.items():
        out += ["--set", f"{key}={value}"]
    return out


# ---------------------------------------------------------------------- sharded loading

def file_tensor_bytes() -> dict[str, int]:
    """Bytes of every tensor in the default model's safetensors files, by name."""
    from safetensors import safe_open  # deferred: as the imports below, for the sharded-load tests only

    from distlab import sharded_load
    from distlab.models import resolve_model

    folder = Path(resolve_model(None))
    sizes = {}
    for name, path in sharded_load.weight_files(folder).items():
        with safe_open(str(path), framework="pt") as f:
            t = f.get_slice(name)
            n = 1
            for s in t.get_shape():
                n *= s
            sizes[name] = n * {"F32": 4, "BF16": 2, "F16": 2}[t.get_dtype()]
    return sizes


# ---------------------------------------------------------------------- notebooks: the scripts a chapter writes

def notebook_scripts(notebook: Path, folder: Path) -> dict[str, str]:
    """The notebook's `%%writefile {work}/NAME` cells, written to `folder`: {name: path}."""
    written = {}
    for cell in json.loads(notebook.read_text())["cells"]:
        src = "".join(cell["source"])
        m = re.match(r"%%writefile \{work\}/(\S+)\n", src)
        if cell["cell_type"] == "code" and m:
            (folder / m.group(1)).write_text(src[m.end():])
            written[m.group(1)] = str(folder / m.group(1))
    return written


# ---------------------------------------------------------------------- exported models

def exported_model(folder: Path, lora: bool):
    """A run's `model/` export loaded as a user would (PEFT over the default base, or from_pretrained), wrapped
    in the loss the trainer computes, in eval mode."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from distlab.lm_loss import CausalLMWithLoss
    from distlab.models import load_model

    model = PeftModel.from_pretrained(load_model(None), folder) if lora else \
        AutoModelForCausalLM.from_pretrained(folder)
    return CausalLMWithLoss(model).eval()


def held_out_loss(model, data, data_parallel_size: int = 1, batch_size: int = 8) -> float:
    """The token-weighted mean loss over `data`, batched exactly as Strategy.evaluate batches it on each of
    `data_parallel_size` ranks (rank r takes rows r, r + size, ...), so it equals a run's logged eval loss to
    rounding when `model` is that run's model. Why compare that, not weights: where a gradient is near zero,
    AdamW's step is lr * g / (|g| + eps), so a rounding-level difference in g (two strategies add in different
    orders) moves a few elements by up to a whole step either way; the exported model is checked against its
    own run exactly, and against another strategy's by loss."""
    import torch

    from distlab.data import model_inputs

    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for rank in range(data_parallel_size):
            rows = list(range(rank, len(data), data_parallel_size))
            for i in range(0, len(rows), batch_size):
                chunk = data.batch(rows[i:i + batch_size])
                loss_sum += float(model(**model_inputs(chunk, torch.device("cpu"))))
                tokens += chunk["n_label_tokens"]
    return loss_sum / tokens
