"""Models: the offline default (a tiny Qwen2 built from our own data) and any HF model id or folder.

The default model is built once, like a real checkpoint: a byte-level BPE tokenizer trained on the
training split, a ChatML chat template, a Qwen2 config of a few million parameters, seeded random
weights, all written with save_pretrained and read back with from_pretrained. Nothing is
downloaded. Real users pass e.g. model="Qwen/Qwen2.5-0.5B-Instruct" instead.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from distlab.attention import resolve
from distlab.data import IGNORE_INDEX, load_jsonl
from distlab.paths import MODEL_CACHE, TRAIN_FILE

DEFAULT_MODEL = "distlab-tiny"
BUILD_RECIPE_VERSION = 2  # bump when the recipe below changes, so cached builds are rebuilt

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, as Qwen2 uses: each turn is <|im_start|>role\ncontent<|im_end|>\n. Rendering is
# prefix-consistent, which the label masking in distlab.data relies on.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# initializer_range 0.1 (HF's default is 0.02): LoRA leaves the embeddings and the tied LM head
# frozen at their random init, and with std 0.02 their logits span too small a range for the
# adapters to ever become confident. Measured here: 80 LoRA steps take held-out loss from 9.1 to
# 4.4 with 0.1, but only from 7.8 to 6.9 with 0.02.
TINY_QWEN2 = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, rope_theta=10000.0,
                  tie_word_embeddings=True, rms_norm_eps=1e-6, initializer_range=0.1)
# Shape of Qwen2.5-0.5B (from its published config), for random-init throughput runs on GPUs:
# the same compute per token as the real model, no weights needed.
QWEN25_05B_SHAPE = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                        num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
                        tie_word_embeddings=True, rms_norm_eps=1e-6, vocab_size=151936)
RANDOM_PRESETS = {"qwen2.5-0.5b-random": QWEN25_05B_SHAPE, "distlab-tiny-random": TINY_QWEN2}


@contextmanager
def _file_lock(path: Path):
    """Serialise concurrent builds (every torchrun rank may ask for the model at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _corpus(train_file: Path) -> list[str]:
    return [m["content"] for conv in load_jsonl(train_file) for m in conv.messages]


def train_tokenizer(texts: list[str], vocab_size: int = 4096):
    """A byte-level BPE tokenizer (as GPT-2/Qwen use) with ChatML special tokens."""
    # deferred: only the model builder needs it
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast  # deferred: transformers is slow to import

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def qwen2_config(tokenizer, **shape):
    from transformers import Qwen2Config  # deferred: transformers is slow to import

    shape = dict(shape)
    shape.setdefault("vocab_size", len(tokenizer))
    return Qwen2Config(bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       use_sliding_window=False, **shape)


def _recipe_hash(train_file: Path) -> str:
    h = hashlib.sha256()
    h.update(Path(train_file).read_bytes())
    h.update(json.dumps({"recipe": BUILD_RECIPE_VERSION, "shape": TINY_QWEN2, "template": CHAT_TEMPLATE},
                        sort_keys=True).encode())
    return h.hexdigest()[:16]


def build_default_model(out_dir: str | Path | None = None, train_file: str | Path = TRAIN_FILE,
                        seed: int = 0, force: bool = False) -> Path:
    """Build (once) and return the folder of the default tiny Qwen2 model.

    Rebuilt only when the training data or the recipe changed. Written to a temporary folder
    and renamed into place, so a crash never leaves a half-written model behind."""
    from transformers import Qwen2ForCausalLM  # deferred: transformers is slow to import

    out_dir = Path(out_dir or MODEL_CACHE / "distlab-tiny-qwen2")
    digest = _recipe_hash(Path(train_file))
    stamp = out_dir / "distlab_build.json"
    with _file_lock(out_dir.with_name(out_dir.name + ".lock")):
        if not force and stamp.exists() and json.loads(stamp.read_text()).get("hash") == digest:
            return out_dir
        tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tokenizer = train_tokenizer(_corpus(Path(train_file)))
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(qwen2_config(tokenizer, **TINY_QWEN2))
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        n_params = sum(p.numel() for p in model.parameters())
        (tmp / "distlab_build.json").write_text(json.dumps(
            {"hash": digest, "recipe": BUILD_RECIPE_VERSION, "train_file": str(train_file), "seed": seed,
             "parameters": n_params, "vocab_size": len(tokenizer)}, indent=2))
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp.rename(out_dir)
    return out_dir


def resolve_model(model: str | Path | None) -> str:
    """Name or folder that from_pretrained understands; the default name builds the tiny model."""
    if model in (None, "", DEFAULT_MODEL):
        return str(build_default_model())
    return str(model)


def _quiet_hf() -> None:
    """Per-load progress bars from transformers add nothing but noise to notebook outputs, and
    peft calls a transformers method that transformers 5 deprecates (not ours to fix)."""

    from transformers.utils import logging as hf_logging  # deferred: transformers is slow to import

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable.*", category=FutureWarning)


def load_tokenizer(model: str | Path | None = None):
    from transformers import AutoTokenizer  # deferred: transformers is slow to import

    if model in RANDOM_PRESETS:
        model = None  # random-init presets reuse the default tokenizer
    tok = AutoTokenizer.from_pretrained(resolve_model(model))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # many base models ship without a pad token
    return tok


def load_model(model: str | Path | None = None, dtype: torch.dtype = torch.float32,
               attn_implementation: str = "sdpa", seed: int = 0):
    """from_pretrained for names and folders; seeded random init for the RANDOM_PRESETS shapes."""
    from transformers import AutoModelForCausalLM  # deferred: transformers is slow to import

    _quiet_hf()
    attn_implementation = resolve(attn_implementation)
    if model in RANDOM_PRESETS:
        config = qwen2_config(load_tokenizer(None), **RANDOM_PRESETS[model])
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).to(dtype)
    return AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=dtype,
                                                attn_implementation=attn_implementation)


def count_parameters(model) -> tuple[int, int]:
    """(total, trainable) parameter counts."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable


class CausalLMWithLoss(torch.nn.Module):
    """A causal LM whose forward returns the summed next-token loss over label tokens only.

    The LM head runs only on positions whose next token is a label: prompt tokens (a third of our
    data, often more) never pay for the vocabulary projection, and the full (tokens x vocab)
    logits are never materialised, which matters for 150k-token vocabularies on GPUs. Strategies
    wrap this module, so DDP/FSDP see one forward that does everything the step needs.

    Works for models whose head is a plain linear layer on the decoder output (Llama, Qwen2,
    Mistral...). Models that post-process logits (e.g. Gemma's soft-capping) need the full
    forward instead."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    @property
    def causal_lm(self):
        """The transformers model inside (under a PEFT wrapper, with its adapters injected)."""
        return self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm

    def forward(self, input_ids, labels, position_ids=None, attention_mask=None):
        causal = self.causal_lm
        # use_cache=False: with a cache object present, transformers does not derive the
        # block-diagonal mask from restarting position ids, and packed rows would leak.
        hidden = causal.get_decoder()(input_ids=input_ids, position_ids=position_ids,
                                      attention_mask=attention_mask, use_cache=False).last_hidden_state
        return label_loss_sum(hidden, labels, causal.get_output_embeddings())


def label_loss_sum(hidden: torch.Tensor, labels: torch.Tensor, head) -> torch.Tensor:
    """Summed next-token cross entropy over label positions only, the head applied to those alone.

    `head` maps hidden states to logits (the LM head module, or any callable such as a tied
    embedding's `F.linear`). Every forward that ends in a loss uses this one function: the
    unsplit model here and the last stage of both pipelines."""
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX
    logits = head(hidden[:, :-1][keep])
    return torch.nn.functional.cross_entropy(logits.float(), targets[keep], reduction="sum")
