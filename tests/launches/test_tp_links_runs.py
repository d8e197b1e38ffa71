"""Tensor parallelism across a slow link (chapter 08, section 4), under torchrun: the bytes a LoRA step of tp and of
ddp sends, counted, against the formula and the planner, and the localhost fallback, which runs both strategies once
on loopback and says so. The sweep's rows, the table's arithmetic, the figures and the `auto` parameters:
tests/unit/test_tp_links.py."""

from __future__ import annotations

import json

from distlab.bench.lan_ddp import BASE_CONFIG
from distlab.chapters import ch08
from distlab.lan.hosts import LOOPBACK
from distlab.launch import scripts


def test_link_bytes_are_what_a_lora_step_sends(tmp_path):
    """The counting worker of chapter 07, section 6, with LoRA: one step of tp and of ddp on the sweep's 4 rows of
    64 tokens, counted (tp: DTensor's collectives, forward, backward and the partial LoRA gradients summed)."""
    out = tmp_path / "bytes.json"
    scripts.torchrun_module_or_script("distlab.workers.step_bytes", 2,
                                      ["--out", str(out), "--rows", "4", "--set", "seq_len=64", "--set", "lora=true"],
                                      timeout_s=300, module=True)
    runs = json.loads(out.read_text())["runs"]
    sent = ch08.link_bytes(json.loads(BASE_CONFIG.read_text()), rows=4, seq_len=64)
    assert runs["tp"]["sent_bytes"] == sent["tp"] and runs["ddp"]["sent_bytes"] == sent["ddp"]


def test_the_localhost_fallback_runs_both_strategies_once_on_loopback_and_says_so(capsys):
    sweep, mode = ch08.link_sweep(["1gbit", "50mbit"], steps=3, force_local=True, timeout_s=240)
    assert mode.startswith("mode: FALLBACK to localhost") and "not shaped" in mode
    assert "falling back to localhost agents" in capsys.readouterr().out
    assert list(sweep.strategy) == ["tp", "ddp"] and (sweep.placement == "localhost").all()
    assert (sweep.rate == LOOPBACK).all() and (sweep["step s"] > 0).all()  # once each: no rate was applied
