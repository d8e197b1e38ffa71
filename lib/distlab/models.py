"""Models: loading the offline default (a tiny Qwen2 pretrained here), the random presets and any HF model id
or folder.

The default model, "distlab-tiny", is built once, like a real checkpoint, by distlab.tiny_base (a tokenizer
and a few minutes of pretraining on another company's helpdesk text, cached under build/models/): a name that
resolves to it builds it when it is missing, so `load_model(None)` always gets it. "distlab-tiny-random" is
the same shape with seeded random weights (throughput runs), and real users pass e.g.
model="Qwen/Qwen2.5-0.5B-Instruct" instead. `balanced_bench_model` builds that shape with a wider FFN
(random weights, once) for the measurements that need pipeline stages of equal work (chapters 04, 05).
The loss module the strategies wrap is distlab.lm_loss's.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import shutil
from pathlib import Path

import torch

from distlab.attention import resolve
from distlab.config import MODEL_PRESETS
from distlab.jsonio import strict_json
from distlab.model_build import build_lock, quiet_hf, replace_folder
from distlab.paths import MODEL_CACHE
from distlab.pretrained import SMOLLM2, build_smollm2
from distlab.safe_load import refusal
from distlab.tiny_base import TINY_QWEN2, build_default_model, build_tokenizer, qwen2_config

DEFAULT_MODEL = "distlab-tiny"  # the pretrained tiny Qwen2 base
# Shape of Qwen2.5-0.5B (from its published config), for random-init throughput runs on GPUs:
# the same compute per token as the real model, no weights needed.
QWEN25_05B_SHAPE = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                        num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
                        tie_word_embeddings=True, rms_norm_eps=1e-6, vocab_size=151936)
# Shape of nanochat's d20 (depth 20: width 20 x 64, 128-wide heads, a 65,536-token vocabulary, untied embedding
# and LM head; 561M parameters), written as a Qwen2 config so that our MFU can be set beside nanochat's. Only the
# FFN differs in kind: nanochat's is two 1280 x 5120 matrices (relu^2), a Qwen2 block's is gated, three 1280 x I.
# Equal weights would be I = 2 x 5120 / 3 = 3413.3; 3456 is the multiple of 128 nearest it (tile-aligned matmuls,
# as nanochat's 5120 is), which gives 564.4M parameters, 0.6% over d20 (q/k/v biases and norms add 0.1M).
# nanochat's blocks differ too where the FLOP count does not look (none is a matmul): no q/k/v biases, a QK norm,
# a logit softcap.
NANOCHAT_D20_SHAPE = dict(hidden_size=1280, intermediate_size=3456, num_hidden_layers=20, num_attention_heads=10,
                          num_key_value_heads=10, head_dim=128, max_position_embeddings=2048, rope_theta=10000.0,
                          tie_word_embeddings=False, rms_norm_eps=1e-6, vocab_size=65536)
RANDOM_PRESETS = {"qwen2.5-0.5b-random": QWEN25_05B_SHAPE, "distlab-tiny-random": TINY_QWEN2,
                  "nanochat-d20-random": NANOCHAT_D20_SHAPE}
# Real pretrained bases that come offline, from a package: name -> builder returning a from_pretrained folder
PRETRAINED_BASES = {SMOLLM2: build_smollm2}
assert (DEFAULT_MODEL, *RANDOM_PRESETS, *PRETRAINED_BASES) == MODEL_PRESETS, \
    "distlab.config.MODEL_PRESETS and the models built here name the same models"


def resolve_model(model: str | Path | None) -> str:
    """Name or folder that from_pretrained understands; the default name builds the pretrained base."""
    if model in (None, "", DEFAULT_MODEL):
        return str(build_default_model())
    if model in PRETRAINED_BASES:
        return str(PRETRAINED_BASES[model]())
    return str(model)


# bitsandbytes (imported by peft and transformers whenever it is installed, quantised or not) warns at import, on
# CPUs with AVX512-BF16, that it cannot fetch an optional 4-bit kernel from the Hugging Face hub: offline by design
# here, and its own fallback kernel runs instead. Silenced before anything imports it, so no chapter prints it.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def load_tokenizer(model: str | Path | None = None):
    from transformers import AutoTokenizer  # deferred: transformers is slow to import

    # random-init presets use the default tokenizer, which builds in seconds without the base's weights
    tok = AutoTokenizer.from_pretrained(build_tokenizer() if model in RANDOM_PRESETS else resolve_model(model))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # many base models ship without a pad token
    return tok


QUANT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def quantization_config(quantization: str, double_quant: bool = True, compute_dtype: torch.dtype = torch.float32):
    """transformers' BitsAndBytesConfig for a quantised base ("nf4", "int8"), as QLoRA users write it;
    None for "none". Only nn.Linear layers are quantised (the decoder projections; the tied LM head is
    the embedding's weight, an untied one transformers leaves unquantised too)."""
    if quantization == "none":
        return None
    from transformers import BitsAndBytesConfig  # deferred: transformers is slow to import

    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    if quantization != "nf4":
        raise ValueError(f"quantization {quantization!r}: one of none, nf4, int8")
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant,
                              bnb_4bit_compute_dtype=compute_dtype)


def import_model_class(model: str | Path | None = None) -> type:
    """The transformers class `load_model` builds `model` with, imported (its module's code runs once per process).
    Reads the folder's config.json, no weights."""
    from transformers import AutoConfig, Qwen2Config  # deferred: transformers is slow to import
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING  # deferred: as above

    config_class = Qwen2Config if model in RANDOM_PRESETS else type(AutoConfig.from_pretrained(resolve_model(model)))
    return MODEL_FOR_CAUSAL_LM_MAPPING[config_class]


def load_model(model: str | Path | None = None, dtype: torch.dtype = torch.float32,
               attn_implementation: str = "sdpa", seed: int = 0, quantization=None):
    """from_pretrained for names and folders; seeded random init for the RANDOM_PRESETS shapes.
    `quantization`: a BitsAndBytesConfig (`quantization_config`). bitsandbytes quantises while
    from_pretrained loads, so a random preset is first written to a folder once (`random_preset_folder`)."""
    from transformers import AutoModelForCausalLM  # deferred: transformers is slow to import

    quiet_hf()
    attn_implementation = resolve(attn_implementation)
    if model in RANDOM_PRESETS and quantization is None:
        config = qwen2_config(load_tokenizer(None), **RANDOM_PRESETS[model])
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).to(dtype)
    folder = random_preset_folder(model, seed) if model in RANDOM_PRESETS else resolve_model(model)
    if quantization is not None:
        # bitsandbytes' int8 matmul logs, on every call, that it casts fp32 inputs to fp16: known, and noise
        logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
    # Loading runs no code from the folder: transformers reads model.safetensors, or a pytorch_model.bin with
    # torch.load(weights_only=True) (modeling_utils.load_state_dict), and with trust_remote_code=False never
    # imports a modeling_*.py the folder carries. A .bin that names anything else is refused here in one line.
    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=False,
            **({"quantization_config": quantization} if quantization else {}))
    except pickle.UnpicklingError as e:
        raise refusal(folder, "model folder", e) from None
    keep_4bit_layout(loaded)
    return loaded


def keep_4bit_layout(model) -> None:
    """Switch off bitsandbytes 0.50's CPU repacking: its inference path (a no-grad forward on an AVX512-BF16 CPU)
    repacks a 4-bit weight in place on first use, and asserts out_features % 32 == 0: the tiny model's 688-wide
    FFN fails it, and an evaluation between training steps would change the layout (and the bytes) the training
    step reads."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def random_preset_folder(name: str, seed: int = 0) -> str:
    """A RANDOM_PRESETS shape with seeded random weights, saved once under build/models (what a quantised
    load reads: bitsandbytes quantises in from_pretrained). Nothing is downloaded."""
    folder = MODEL_CACHE / f"random-{name}-seed{seed}"
    spec = {"preset": RANDOM_PRESETS[name], "seed": seed, "recipe": 1}
    with build_lock(folder.with_name(folder.name + ".lock")):
        stamp = folder / "distlab_build.json"
        if stamp.exists() and json.loads(stamp.read_text()) == spec:
            return str(folder)
        from transformers import AutoModelForCausalLM  # deferred: transformers is slow to import

        tokenizer = load_tokenizer(None)
        torch.manual_seed(seed)
        # stored in bf16 (half the disk of fp32; a 0.5B preset is 1 GB): a quantised load reads it in any dtype
        model = AutoModelForCausalLM.from_config(qwen2_config(tokenizer, **RANDOM_PRESETS[name])).to(torch.bfloat16)
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "distlab_build.json").write_text(strict_json(spec))
        return replace_folder(tmp, folder)


def balanced_bench_model(intermediate_size: int = 4096, layers: int = 4) -> str:
    """A folder with a random-init model of the tiny Qwen2's shape (same tokenizer, vocabulary,
    hidden size), but an FFN `intermediate_size` wide, built once under build/models.

    Why: only the last stage runs the final norm, the LM head and the loss (and it computes the
    input gradient it sends back, which the first stage skips). With the tiny model's FFN (688) that
    is about half a decoder layer, so a [2, 2] split is ~20% unbalanced and the lighter stage idles
    far more than (p-1)/(m+p-1) predicts. With a 4096-wide FFN the last stage is measured ~8% slower
    per micro-batch on a 2-core CPU (two ranks, one thread each); the bubble then mostly measures the
    schedule, and the remaining imbalance shows as the lighter stage idling a few hundredths more."""

    folder = MODEL_CACHE / f"pipeline-bench-ffn{intermediate_size}-l{layers}"
    stamp = folder / "distlab_build.json"
    spec = {"intermediate_size": intermediate_size, "num_hidden_layers": layers, "recipe": 1}
    if stamp.exists() and json.loads(stamp.read_text()) == spec:
        return str(folder)
    from transformers import Qwen2ForCausalLM  # deferred: transformers is slow to import

    tokenizer = load_tokenizer(None)
    shape = {**TINY_QWEN2, "intermediate_size": intermediate_size, "num_hidden_layers": layers}
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen2_config(tokenizer, **shape))
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "distlab_build.json").write_text(strict_json(spec))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return str(folder)


def whole_shape(p: torch.Tensor) -> torch.Size:
    """A weight's own shape. A ZeRO-3 parameter partitioned as it loaded (deepspeed.zero.Init, strategies.zero)
    holds an empty tensor on each rank and keeps its shape in DeepSpeed's `ds_shape`."""
    return getattr(p, "ds_shape", p.shape)


def count_parameters(model) -> tuple[int, int]:
    """(total, trainable) parameter counts; a 4-bit weight counts its weights, not the bytes they are packed in
    (a weightless one, before a sharded load fills it, knows their shape as `quantised_shape`)."""
    total = sum(math.prod(p.quant_state.shape) if getattr(p, "quant_state", None) is not None
                else math.prod(p.quantised_shape) if hasattr(p, "quantised_shape")
                else whole_shape(p).numel() for p in model.parameters())
    trainable = sum(whole_shape(p).numel() for p in model.parameters() if p.requires_grad)
    return total, trainable


def quant_state_parts(state) -> list[torch.Tensor]:
    """The tensors of a bitsandbytes QuantState: a 4-bit weight's per-block absmax and code table; double-quantised,
    also its 8-bit scales' own state (state2: fp32 absmax, offset, code table)."""
    out = []
    while state is not None:
        out += [v for v in vars(state).values() if torch.is_tensor(v)]
        state = getattr(state, "state2", None)
    return out
