"""Models: the offline default (a tiny Qwen2 pretrained here) and any HF model id or folder.

The default model, "distlab-tiny", is built once, like a real checkpoint: a byte-level BPE tokenizer
with a ChatML chat template trained on the pretraining corpus (data/pretrain/corpus.jsonl: the same
helpdesk topics for another company, Globex, plus general IT text; never Acme's answers), a Qwen2
config of a few million parameters, then a few minutes of seeded full training on that corpus. The
result speaks helpdesk English and knows Globex's systems and policies, so fine-tuning on Acme's data
has something measurable to teach: Acme's facts. Written with save_pretrained, read back with
from_pretrained, cached under build/models/; nothing is downloaded. "distlab-tiny-random" is the same
shape with seeded random weights (throughput runs), and real users pass e.g.
model="Qwen/Qwen2.5-0.5B-Instruct" instead. `balanced_bench_model` builds that shape with a wider FFN
(random weights, once) for the measurements that need pipeline stages of equal work (chapters 04, 05).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import pickle
import shutil
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from distlab.attention import resolve
from distlab.data import IGNORE_INDEX, build_sft_data, load_jsonl
from distlab.jsonio import strict_json
from distlab.paths import DATA_DIR, MODEL_CACHE
from distlab.pretrained import SMOLLM2, build_smollm2
from distlab.safe_load import refusal

DEFAULT_MODEL = "distlab-tiny"  # the pretrained tiny Qwen2 base
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
# Shape of Qwen2.5-0.5B (from its published config), for random-init throughput runs on GPUs:
# the same compute per token as the real model, no weights needed.
QWEN25_05B_SHAPE = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                        num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
                        tie_word_embeddings=True, rms_norm_eps=1e-6, vocab_size=151936)
RANDOM_PRESETS = {"qwen2.5-0.5b-random": QWEN25_05B_SHAPE, "distlab-tiny-random": TINY_QWEN2}
# Real pretrained bases that come offline, from a package: name -> builder returning a from_pretrained folder
PRETRAINED_BASES = {SMOLLM2: build_smollm2}


@contextmanager
def build_lock(path: Path):
    """Serialise concurrent builds (every torchrun rank may ask for the model at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _corpus(corpus_file: Path) -> list[str]:
    return [m["content"] for conv in load_jsonl(corpus_file) for m in conv.messages]


def train_tokenizer(texts: list[str], vocab_size: int = 4096):
    """A byte-level BPE tokenizer (as GPT-2/Qwen use) with ChatML special tokens."""
    # deferred: only the model builder needs it
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


def replace_folder(tmp: Path, out_dir: Path) -> Path:
    """Put a finished build (tmp) where the old one was: a reader never finds a half-written folder."""
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


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


def _lr_at(step: int, recipe: dict) -> float:
    """Linear warm-up, then cosine down to min_lr_ratio of the peak."""
    if step < recipe["warmup_steps"]:
        return recipe["lr"] * (step + 1) / recipe["warmup_steps"]
    progress = (step - recipe["warmup_steps"]) / max(1, recipe["steps"] - recipe["warmup_steps"])
    floor = recipe["min_lr_ratio"]
    return recipe["lr"] * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


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
                group["lr"] = _lr_at(step, recipe)
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
                               "first: python -c 'from distlab.models import build_default_model as b; b()'")
        (tmp / "distlab_build.json").write_text(strict_json(
            {"hash": digest, "recipe": BUILD_RECIPE_VERSION, "corpus": str(corpus_file), "pretrain": recipe,
             "parameters": sum(p.numel() for p in model.parameters()), "vocab_size": len(tokenizer),
             "final_loss": sum(losses[-20:]) / len(losses[-20:]),
             "build_seconds": round(time.perf_counter() - started, 1)}, indent=2))
        return replace_folder(tmp, out_dir)


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


def quiet_hf() -> None:
    """Per-load progress bars from transformers add nothing but noise to notebook outputs, and
    peft calls a transformers method that transformers 5 deprecates (not ours to fix)."""

    from transformers.utils import logging as hf_logging  # deferred: transformers is slow to import

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable.*", category=FutureWarning)


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
    for module in loaded.modules():
        # bitsandbytes 0.50's CPU inference path (a no-grad forward on an AVX512-BF16 CPU) repacks a 4-bit weight
        # in place on first use, and asserts out_features % 32 == 0: the tiny model's 688-wide FFN fails it, and
        # an evaluation between training steps would change the layout (and the bytes) the training step reads.
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return loaded


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
    """(total, trainable) parameter counts; a 4-bit weight counts its weights, not the bytes they are packed in."""
    total = sum(math.prod(p.quant_state.shape) if getattr(p, "quant_state", None) is not None
                else whole_shape(p).numel() for p in model.parameters())
    trainable = sum(whole_shape(p).numel() for p in model.parameters() if p.requires_grad)
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
    loss = torch.nn.functional.cross_entropy(logits.float(), targets[keep], reduction="sum")
    # a head split by vocabulary (strategies.tp, vocab_parallel) gives a replicated DTensor: the loop reads a tensor
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss
