"""The GPU knobs (fused AdamW, per-block compile) and the MFU ladder's rungs, checked on the CPU where they run too.
The ladder's real training runs: tests/launches/test_mfu_ladder_runs.py."""

from __future__ import annotations

import torch

from distlab.bench import mfu_ladder
from distlab.models import load_model
from distlab.strategies.base import Strategy, compile_layers


def test_fused_optimizer_is_one_fused_adamw_and_the_default_is_not():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    assert Strategy().make_optimizer(model, 1e-3, 0.01, fused=True).defaults["fused"] is True
    assert not Strategy().make_optimizer(model, 1e-3, 0.01).defaults["fused"]


def test_compile_layers_compiles_every_decoder_block_and_nothing_else():
    model = load_model(None)
    blocks = model.config.num_hidden_layers
    assert compile_layers(model) == blocks
    compiled = [m for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    assert len(compiled) == blocks and all(type(m).__name__.endswith("DecoderLayer") for m in compiled)


def test_each_rung_keeps_the_changes_above_it():
    last = mfu_ladder.rung_settings(None, "cpu", "fp32", 64, 3, len(mfu_ladder.RUNGS) - 1)
    assert last["fused_optimizer"] and last["compile"] and last["packing"]
    assert last["activation_checkpointing"] is False and last["attn_implementation"] == "varlen"
    assert last["dtype"] == "bf16" and mfu_ladder.rung_settings(None, "cpu", "fp32", 64, 3, 0)["dtype"] == "fp32"
    assert mfu_ladder.rung_settings(None, "cpu", "fp32", 64, 3, 0)["attn_implementation"] == "eager"
