"""The offline default model, "distlab-tiny", built here once like a real checkpoint (distlab.models loads it).

A byte-level BPE tokenizer with a ChatML chat template trained on the pretraining corpus
(data/pretrain/corpus.jsonl: the same helpdesk topics for another company, Globex, plus general IT text;
never Acme's answers), a Qwen2 config of a few million parameters (TINY_QWEN2), then a few minutes of seeded
full training on that corpus (`pretrain`, the PRETRAIN recipe). The result speaks helpdesk English and knows
Globex's systems and policies, so fine-tuning on Acme's data has something measurable to teach: Acme's facts.
Written with save_pretrained under build/models/ and rebuilt only when the corpus or the recipe changed
(`build_default_model`, `build_tokenizer`); nothing is downloaded.

    python -c 'from distlab.tiny_base import build_default_model; build_default_model()'   (make models)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from distlab.data import IGNORE_INDEX, build_sft_data, load_jsonl
from distlab.jsonio import strict_json
from distlab.lm_loss import CausalLMWithLoss
from distlab.model_build import build_lock, replace_folder
from distlab.paths import DATA_DIR, MODEL_CACHE
from distlab.schedule import warmup_cosine

PRETRAIN_FILE = DATA_DIR / "pretrain" / "corpus.jsonl"
BUILD_RECIPE_VERSION = 4  # bump when the recipe below changes, so cached builds are rebuilt
# The base's pretraining run: full fine-tuning of every weight from a seeded init, on a fixed number of
# threads (float sums depend on how a matmul is split across threads, so the thread count is part of
# the recipe: the same recipe gives bit-identical weights on the same machine type).
PRETRAIN = dict(steps=500, micro_batch_size=4, seq_len=256, lr=3e-3, warmup_steps=30, weight_decay=0.01,
                min_lr_ratio=0.1, threads=1, seed=0)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, as Qwen2 uses: each turn is <|im_start|>role\ncontent<|im_end|>\n. Rendering is
# prefix-consistent, which the label masking in distlab.data relies on.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# initializer_range 0.1 (HF's default is 0.02) for the random preset: LoRA leaves the embeddings and
# the tied LM head frozen at their random init, and with std 0.02 their logits span too small a range
# for the adapters to ever become confident. Measured here: 80 LoRA steps take held-out loss from 9.1
# to 4.4 with 0.1, but only from 7.8 to 6.9 with 0.02. The pretrained base starts from HF's 0.02,
# since every weight trains there.
TINY_QWEN2 = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, rope_theta=10000.0,
                  tie_word_embeddings=True, rms_norm_eps=1e-6, initializer_range=0.1)


def _corpus(corpus_file: Path) -> list[str]:
    return [m["content"] for conv in load_jsonl(corpus_file) for m in conv.messages]


def train_tokenizer(texts: list[str], vocab_size: int = 4096):
    """A byte-level BPE tokenizer (as GPT-2/Qwen use) with ChatML special tokens."""
    # deferred: only a tokenizer build needs it
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast  # deferred: transformers is slow to import

    tok = Tokenizer(models.BPE())
    # Digits one by one, as Qwen2's and Llama 3's tokenizers split them: every number is spelled with
    # the same ten well-trained tokens, so a number the base never saw (Acme's 90 where Globex says 180)
    # is still easy to write. Merged digit runs would leave "300" or "0" tokens that pretraining never met.
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
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


def _recipe_hash(corpus_file: Path, what: str, **extra) -> str:
    h = hashlib.sha256()
    h.update(Path(corpus_file).read_bytes())
    recipe = {"recipe": BUILD_RECIPE_VERSION, "template": CHAT_TEMPLATE, "what": what, **extra}
    h.update(json.dumps(recipe, sort_keys=True).encode())
    return h.hexdigest()[:16]


def _cached(out_dir: Path, digest: str) -> bool:
    stamp = out_dir / "distlab_build.json"
    return stamp.exists() and json.loads(stamp.read_text()).get("hash") == digest and (
        (out_dir / "tokenizer.json").exists())


def build_tokenizer(out_dir: str | Path | None = None, corpus_file: str | Path = PRETRAIN_FILE,
                    force: bool = False) -> Path:
    """Build (once, seconds) and return the folder of the default tokenizer, trained on the pretraining
    corpus. The random presets need only this, never the pretrained weights."""
    out_dir = Path(out_dir or MODEL_CACHE / "distlab-tokenizer")
    digest = _recipe_hash(Path(corpus_file), "tokenizer")
    with build_lock(out_dir.with_name(out_dir.name + ".lock")):
        if not force and _cached(out_dir, digest):
            return out_dir
        tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tokenizer = train_tokenizer(_corpus(Path(corpus_file)))
        tokenizer.save_pretrained(tmp)
        (tmp / "distlab_build.json").write_text(strict_json(
            {"hash": digest, "recipe": BUILD_RECIPE_VERSION, "corpus": str(corpus_file),
             "vocab_size": len(tokenizer)}, indent=2))
        return replace_folder(tmp, out_dir)


def pretrain(model, tokenizer, corpus_file: str | Path = PRETRAIN_FILE, progress: bool = True, **overrides) -> list:
    """Full training of every weight on the corpus (assistant tokens only, packed rows), in place.
    Returns the loss of every step. Seeded and on a fixed thread count: deterministic."""
    from tqdm import tqdm  # deferred: only the builder shows a bar

    recipe = {**PRETRAIN, **overrides}
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe["threads"])
    try:
        data = build_sft_data(corpus_file, tokenizer, recipe["seq_len"], packing=True)
        gen = torch.Generator().manual_seed(recipe["seed"])
        wrapped = CausalLMWithLoss(model).train()
        opt = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], weight_decay=recipe["weight_decay"],
                                betas=(0.9, 0.95))
        order: list[int] = []
        losses = []
        bar = tqdm(range(recipe["steps"]), desc="pretraining the distlab-tiny base", file=sys.stdout,
                   mininterval=5.0, disable=not progress)
        for step in bar:
            while len(order) < recipe["micro_batch_size"]:  # epochs in a seeded order
                order += torch.randperm(len(data), generator=gen).tolist()
            batch = data.batch(order[:recipe["micro_batch_size"]])
            del order[:recipe["micro_batch_size"]]
            for group in opt.param_groups:
                group["lr"] = warmup_cosine(step, recipe["lr"], recipe["warmup_steps"], recipe["steps"],
                                            recipe["min_lr_ratio"])
            n_labels = (batch["labels"][:, 1:] != IGNORE_INDEX).sum().clamp(min=1)
            loss = wrapped(batch["input_ids"], batch["labels"], position_ids=batch.get("position_ids")) / n_labels
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if step % 20 == 0:
                bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        bar.close()
    finally:
        torch.set_num_threads(threads)
    return losses


def build_default_model(out_dir: str | Path | None = None, corpus_file: str | Path = PRETRAIN_FILE,
                        force: bool = False, progress: bool = True, **overrides) -> Path:
    """Build (once, a few minutes on 2 cores) and return the folder of the pretrained default base.

    Rebuilt only when the corpus or the recipe changed. Written to a temporary folder and renamed into
    place, so a crash never leaves a half-written model behind; concurrent callers (torchrun ranks)
    wait on a file lock. `overrides` change the PRETRAIN recipe (tests build a few-step base)."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM  # deferred: transformers is slow to import

    recipe = {**PRETRAIN, **overrides}
    out_dir = Path(out_dir or MODEL_CACHE / "distlab-tiny-base")
    digest = _recipe_hash(Path(corpus_file), "base", shape=TINY_QWEN2, pretrain=recipe)
    with build_lock(out_dir.with_name(out_dir.name + ".lock")):
        if not force and _cached(out_dir, digest):
            return out_dir
        started = time.perf_counter()
        # the shared tokenizer cache holds the default corpus's tokenizer only
        tok_dir = None if Path(corpus_file) == PRETRAIN_FILE else out_dir.with_name(out_dir.name + "-tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(tok_dir, corpus_file=corpus_file))
        tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        torch.manual_seed(recipe["seed"])
        model = Qwen2ForCausalLM(qwen2_config(tokenizer, **{**TINY_QWEN2, "initializer_range": 0.02}))
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        if progress:
            print(f"building the pretrained base once (cached in {out_dir}): {recipe['steps']} steps on "
                  f"{recipe['threads']} threads", flush=True)
        losses = pretrain(model, tokenizer, corpus_file, progress=progress, **overrides)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if not (tmp / "config.json").exists() or not list(tmp.glob("*.safetensors")):
            # seen when a DeepSpeed ZeRO-3 process (HfDeepSpeedConfig alive) built it: weights partitioned
            raise RuntimeError(f"building {out_dir}: save_pretrained wrote no weights; build it in a plain process "
                               "first: python -c 'from distlab.tiny_base import build_default_model as b; b()'")
        (tmp / "distlab_build.json").write_text(strict_json(
            {"hash": digest, "recipe": BUILD_RECIPE_VERSION, "corpus": str(corpus_file), "pretrain": recipe,
             "parameters": sum(p.numel() for p in model.parameters()), "vocab_size": len(tokenizer),
             "final_loss": sum(losses[-20:]) / len(losses[-20:]),
             "build_seconds": round(time.perf_counter() - started, 1)}, indent=2))
        return replace_folder(tmp, out_dir)
