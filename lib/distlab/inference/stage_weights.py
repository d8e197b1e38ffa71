"""Reading a stage's share of a checkpoint: only the tensors of its layers (and embeddings / norm / head
where it holds them) are read from the safetensors files, never the whole model.

A PEFT LoRA adapter (a folder with adapter_config.json + adapter_model.safetensors) is merged the way
`merge_and_unload` does, W + scale * B @ A, for the stage's layers only, so the stage serves the
fine-tuned model without ever holding the base model whole.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Callable

import torch

from distlab import sharded_load
from distlab.model_build import build_lock
from distlab.paths import MODEL_CACHE

LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class CheckpointError(ValueError):
    pass


def weight_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (single-file or sharded checkpoints), as the sharded
    training load reads them (distlab.sharded_load); a folder without them is a CheckpointError."""
    try:
        return sharded_load.weight_files(Path(model_dir))
    except FileNotFoundError as e:
        raise CheckpointError(str(e)) from None


def checkpoint_bytes(model_dir: str | Path) -> int:
    """Bytes of every tensor in the checkpoint: what a load-all stage would hold."""
    return sum(p.stat().st_size for p in set(weight_files(model_dir).values()))


def read_tensors(model_dir: str | Path, wanted: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The tensors whose names `wanted` accepts, each file opened once, nothing else read."""
    # deferred: safetensors is only needed when a stage loads weights
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for name, path in weight_files(model_dir).items():
        if wanted(name):
            by_file.setdefault(path, []).append(name)
    out = {}
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                out[name] = f.get_tensor(name)
    return out


def layer_of(name: str) -> int | None:
    m = LAYER_KEY.search(name)
    return int(m.group(1)) if m else None


def lora_deltas(adapter_dir: str | Path, layer_ids) -> dict[str, torch.Tensor]:
    """Base-model weight name -> the LoRA delta (scale * B @ A) for the given layers only."""
    # deferred: safetensors is only needed when a stage loads weights
    from safetensors import safe_open

    adapter_dir = Path(adapter_dir)
    cfg_path = adapter_dir / "adapter_config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{adapter_dir}: no adapter_config.json (not a PEFT adapter folder)")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type") != "LORA" or cfg.get("use_dora") or cfg.get("modules_to_save"):
        raise CheckpointError(f"{cfg_path}: only plain LoRA adapters merge stage by stage "
                              f"(peft_type={cfg.get('peft_type')}, use_dora={cfg.get('use_dora')}, "
                              f"modules_to_save={cfg.get('modules_to_save')})")
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    keep = set(layer_ids)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(adapter_dir / "adapter_model.safetensors"), framework="pt") as f:
        for key in f.keys():
            m = re.match(r"base_model\.model\.(.+)\.lora_([AB])(?:\.default)?\.weight$", key)
            if not m:
                raise CheckpointError(f"{adapter_dir}: adapter tensor {key} is not a LoRA A/B matrix")
            layer = layer_of(m.group(1))
            if layer is None:
                raise CheckpointError(f"{adapter_dir}: adapter tensor {key} is outside the decoder layers")
            if layer in keep:
                pairs.setdefault(m.group(1) + ".weight", {})[m.group(2)] = f.get_tensor(key)
    return {name: scale * (ab["B"].float() @ ab["A"].float()) for name, ab in pairs.items()}


def random_checkpoint(name: str, seed: int = 0, **shape) -> Path:
    """A seeded random-init Qwen2 of the given shape (TINY_QWEN2's defaults otherwise) with the default
    tokenizer, saved once under build/models/pipeline-<name>: a checkpoint the stages can read part of,
    for tests and throughput runs that need no trained weights."""
    # deferred: the model builder pulls in transformers, which is slow to import
    from distlab.models import load_tokenizer
    from distlab.tiny_base import TINY_QWEN2, qwen2_config  # deferred: as above

    shape = {**TINY_QWEN2, **shape}
    out = MODEL_CACHE / f"pipeline-{name}"
    stamp = out / "distlab_random.json"
    recipe = json.dumps({"shape": shape, "seed": seed}, sort_keys=True)
    with build_lock(out.with_name(out.name + ".lock")):
        if stamp.is_file() and stamp.read_text() == recipe and (out / "model.safetensors").is_file():
            return out
        from transformers import Qwen2ForCausalLM  # deferred: transformers is slow to import

        tokenizer = load_tokenizer("distlab-tiny-random")
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(qwen2_config(tokenizer, **shape))
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        stamp.write_text(recipe)
    return out
