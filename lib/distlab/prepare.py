"""Everything a run needs before a strategy touches it: device, tokenizer, data and the model that
computes its own loss (with LoRA adapters when the config asks for them).

Kept out of train.py so that measurement code (distlab.measure.state) can build exactly the
model a training run builds without importing the loop.
"""

from __future__ import annotations

import random

import torch

from distlab import sharded_load
from distlab.config import TrainConfig
from distlab.data import build_sft_data
from distlab.device import choose_device
from distlab.dropout import replace_lora_dropout
from distlab.lm_loss import CausalLMWithLoss
from distlab.models import QUANT_DTYPES, load_model, load_tokenizer, quantization_config


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

    The model's build is the first part of the one order of its transformations, written out with the reason
    for each step in distlab.strategies.base.parallelize (the strategy's `prepare` applies the rest): load,
    quantise, checkpoint, LoRA, loss module."""
    choice = choose_device(cfg.device, cfg.dtype, strategy.local_rank)
    tokenizer = load_tokenizer(cfg.model)
    train_data = build_sft_data(cfg.train_file, tokenizer, cfg.seq_len, cfg.packing, cfg.overlong, cfg.labels)
    eval_data = (build_sft_data(cfg.eval_file, tokenizer, cfg.seq_len, cfg.packing, cfg.overlong, cfg.labels)
                 if cfg.eval_file else None)
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
        with strategy.load_context(cfg, choice):  # ZeRO-3: partitioned as it loads
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
    return choice, tokenizer, train_data, eval_data, (sharded_load.defer_weights(model, folder, choice.dtype) if shards
                                                          else model)
