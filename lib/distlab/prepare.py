"""Everything a run needs before a strategy touches it: device, tokenizer, data and the model that
computes its own loss (with LoRA adapters when the config asks for them).

Kept out of train.py so that measurement code (distlab.measure.state) can build exactly the
model a training run builds without importing the loop.
"""

from __future__ import annotations

import contextlib
import importlib
import random

import torch

from distlab import sharded_load
from distlab.config import TrainConfig
from distlab.data import build_sft_data
from distlab.device import choose_device
from distlab.dropout import replace_lora_dropout
from distlab.lm_loss import CausalLMWithLoss
from distlab.models import QUANT_DTYPES, import_model_class, load_model, load_tokenizer, quantization_config


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def apply_lora(model, cfg: TrainConfig):
    from peft import LoraConfig, get_peft_model  # deferred: peft imports half of transformers

    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=list(cfg.lora_targets), bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    if cfg.fast_dropout:
        replace_lora_dropout(model)
    return model


def prepare_run(cfg: TrainConfig, strategy):
    """(device choice, tokenizer, train data, eval data, loss-computing model) for a run: identical on
    every rank and world size. The strategy only says which local device this rank uses, and how it loads.
    `prepare_inputs` then `build_model`: distlab.train calls the two apart, to measure the load alone."""
    choice, tokenizer, train_data, eval_data = prepare_inputs(cfg, strategy)
    return choice, tokenizer, train_data, eval_data, build_model(cfg, strategy, choice)


def prepare_inputs(cfg: TrainConfig, strategy):
    """(device choice, tokenizer, train data, eval data): everything a run needs but its model."""
    choice = choose_device(cfg.device, cfg.dtype, strategy.local_rank)
    tokenizer = load_tokenizer(cfg.model)
    train_data = build_sft_data(cfg.train_file, tokenizer, cfg.seq_len, cfg.packing, cfg.overlong, cfg.labels)
    eval_data = (build_sft_data(cfg.eval_file, tokenizer, cfg.seq_len, cfg.packing, cfg.overlong, cfg.labels)
                 if cfg.eval_file else None)
    return choice, tokenizer, train_data, eval_data


def import_model_code(cfg: TrainConfig) -> None:
    """Import the code that `build_model` will run: the model's transformers class, bitsandbytes for a quantised
    base, PEFT for LoRA or a quantised base. Each is imported once per process, whatever the model's size: called
    first, a measurement of the load (distlab.train's host memory at load) counts the weights, not the libraries."""
    import_model_class(cfg.model)
    modules = []
    if cfg.quantization != "none":
        modules += ["bitsandbytes", "transformers.integrations.bitsandbytes"]
    if cfg.lora or cfg.quantization != "none":
        modules += ["peft.tuners.lora"]
    for module in modules:
        importlib.import_module(module)


def build_model(cfg: TrainConfig, strategy, choice):
    """The loss-computing model (with LoRA adapters when the config asks for them), on `choice`'s device; for a
    strategy that loads shards, weightless until its `prepare` fills each rank's part.

    The model's build is the first part of the one order of its transformations, written out with the reason
    for each step in distlab.strategies.base.parallelize (the strategy's `prepare` applies the rest): load,
    quantise, checkpoint, LoRA, loss module."""
    seed_everything(cfg.seed)  # the same initial LoRA weights on every rank and every world size
    compute = choice.dtype if cfg.quant_compute_dtype == "auto" else QUANT_DTYPES[cfg.quant_compute_dtype]
    quantization = quantization_config(cfg.quantization, cfg.double_quant, compute)
    # fsdp, tp and fsdp_tp build the model without weights, shard it, then read only each rank's part
    # (distlab.sharded_load; a 4-bit base quantised weight by weight, each rank keeping its part); random presets
    # and int8 bases load whole on every rank, as on every other strategy (so a preset starts from the same seeded
    # weights everywhere)
    whole_because = sharded_load.whole_model_reason(cfg) if strategy.loads_shards else None
    shards = strategy.loads_shards and whole_because is None
    if whole_because and strategy.is_main:
        print(f"[distlab] {strategy.name}: every rank loads the whole model, then shards it: {whole_because}",
              flush=True)
    if shards:
        folder = sharded_load.weights_folder(cfg)
        model = sharded_load.empty_model(folder, choice.dtype, cfg.attn_implementation, quantization)
    else:
        # bitsandbytes packs a whole quantised load weight by weight, allocating and freeing blocks of MBs between
        # the small ones kept: each given back at once (sharded_load.large_blocks_returned), else they stay resident
        returned = sharded_load.large_blocks_returned() if quantization is not None else contextlib.nullcontext()
        with strategy.load_context(cfg, choice), returned:  # ZeRO-3: partitioned as it loads
            model = load_model(cfg.model, dtype=choice.dtype, attn_implementation=cfg.attn_implementation,
                               quantization=quantization)
    if quantization is not None:
        # quantise (before LoRA, as it freezes every parameter there is): what QLoRA users run: freeze the base,
        # cast its unquantised layers (embeddings, norms, biases) to fp32, and switch on activation checkpointing
        # the way k-bit layers need it
        from peft import prepare_model_for_kbit_training  # deferred: peft imports half of transformers

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.activation_checkpointing,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    elif cfg.activation_checkpointing:  # checkpoint: a flag on each decoder layer, before LoRA, which adapts to it
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if cfg.lora:  # LoRA: drawn here, from the seeded generator, before the weights go to meta and before any cut
        model = apply_lora(model, cfg)
    model = CausalLMWithLoss(model, cfg.cross_entropy)
    # weightless: the strategy's `prepare` (parallelize) cuts it, then fills each rank's part (sharded_load.fill)
    return sharded_load.defer_weights(model, folder, choice.dtype) if shards else model
