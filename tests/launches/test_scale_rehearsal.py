"""The scale rehearsal (python -m distlab.bench.scale_rehearsal) at a reduced shape: the tiny model's folder
(safetensors, so fsdp and tp read slices), three strategies, LoRA and QLoRA, 2 steps on 2 gloo ranks. The 0.5B run
and its ratios are the benchmark's; here the table must hold a row per rank with both peaks measured and planned, each
strategy's load path, and a run the machine cannot take skipped with its reason, not dropped."""

from __future__ import annotations

import math

import pytest

from distlab.bench import scale_rehearsal
from distlab.cli import UsageError
from distlab.models import resolve_model


def test_the_rehearsal_measures_and_plans_every_rank(monkeypatch):
    table = scale_rehearsal.rehearse(resolve_model(None), ("ddp", "fsdp", "tp"), ("lora",), steps=2, timeout_s=300)
    assert len(table) == 6 and set(table["rank"]) == {0, 1} and not table["skipped"].any()
    assert dict(zip(table.strategy, table.path)) == {"ddp": "whole", "fsdp": "slices", "tp": "slices"}
    # QLoRA where a 4-bit base runs: DDP quantises the whole model on each rank, FSDP one weight at a time
    qlora = scale_rehearsal.rehearse(resolve_model(None), ("ddp", "fsdp", "tp"), ("qlora",), steps=2, timeout_s=300)
    assert len(qlora) == 4 and not qlora["skipped"].any()
    assert dict(zip(qlora.strategy, qlora.path)) == {"ddp": "whole", "fsdp": "slices"}
    assert all(math.isfinite(v) and v > 0 for v in qlora["load_planned_mib"])
    for column in ("load_mib", "load_planned_mib", "step_mib", "step_planned_mib", "load_ratio", "step_ratio"):
        assert all(math.isfinite(v) and v > 0 for v in table[column]), column
    # full fine-tuning that the machine's memory cannot take is a row with its reason, not a launch
    monkeypatch.setattr(scale_rehearsal.psutil, "virtual_memory", lambda: type("M", (), {"available": 2**20})())
    skipped = scale_rehearsal.rehearse(resolve_model(None), ("ddp",), ("full",))
    assert skipped["rank"].isna().all() and skipped["skipped"].str.contains("over half the").all()


def test_unknown_strategies_are_refused_by_name():
    with pytest.raises(UsageError, match="unknown strategy or mode: zero4"):
        scale_rehearsal.main(["--strategies", "fsdp,zero4"])
