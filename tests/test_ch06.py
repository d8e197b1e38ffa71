"""Chapter 06's plumbing: the KV-cache bytes (the formula against a real transformers cache, stage by stage),
the per-stage table, the planned jobs, the drawn pipeline and the width-ratio table."""

from __future__ import annotations

import json

import pandas as pd
import torch

from distlab import provenance
from distlab.chapters import ch06
from distlab.layer_split import split_layers


def tiny_qwen2(kv_heads: int = 1):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=kv_heads, vocab_size=50)
    torch.manual_seed(0)
    return config, AutoModelForCausalLM.from_config(config).eval()


def test_cache_bytes_equal_the_formula_layer_by_layer():
    from transformers import DynamicCache

    for kv_heads in (1, 2, 4):
        config, model = tiny_qwen2(kv_heads)
        cache = DynamicCache(config=config)
        with torch.no_grad():
            model(torch.arange(7).unsqueeze(0), past_key_values=cache, use_cache=True)
        counted = ch06.cache_layer_bytes(cache, config.num_hidden_layers)
        assert counted == [ch06.kv_formula_bytes(config, 1, 7)] * 3
        assert ch06.kv_formula_bytes(config, 3, 7) == 2 * 3 * kv_heads * 8 * 7 * 4


def test_an_untouched_cache_layer_counts_zero():
    from transformers import DynamicCache

    config, _ = tiny_qwen2()
    assert ch06.cache_layer_bytes(DynamicCache(config=config), 3) == [0, 0, 0]


def test_kv_table_splits_the_counted_bytes_by_stage():
    config, _ = tiny_qwen2()
    per_layer = [ch06.kv_formula_bytes(config, 1, 10)] * 3
    table = ch06.kv_table(config, split_layers(3, 2), per_layer, 10)
    assert list(table["layers"]) == [2, 1]
    assert (table["formula (KiB)"] == table["measured (KiB)"]).all()
    assert table["measured (KiB)"].sum() * 1024 == sum(per_layer)


def test_plan_has_strong_weak_sweep_one_at_a_time_and_wide_jobs(tmp_path):
    plan = ch06.plan_jobs(["--max-new-tokens", "4"], tmp_path, "00:01:00", [1, 2, 3], 8, 4, 2, [1, 2], 2,
                          {512: tmp_path / "wide"}, ["--max-new-tokens", "2"])
    assert list(plan) == ["strong-s1", "strong-s2", "strong-s3", "weak-s1", "weak-s3", "sweep", "one-at-a-time",
                          "w512-s1", "w512-s2", "w512-s2-one"]
    assert plan["strong-s3"].ntasks == 3 and plan["strong-s3"].nodes == 2
    assert "--in-flight" in plan["one-at-a-time"].args and plan["sweep"].args[-1] == "1,2"
    assert plan["w512-s2"].model_dir == str(tmp_path / "wide") and plan["w512-s2"].args[:2] == ["--max-new-tokens", "2"]


def test_width_ratios_are_relative_to_one_stage():
    def run(tps):
        return {"summary": {"tokens_per_s": tps}}

    runs = {"strong-s1": run(100), "strong-s2": run(80), "one-at-a-time": run(50),
            "w512-s1": run(10), "w512-s2": run(18), "w512-s2-one": run(11)}
    table = ch06.width_ratios(runs, 256, [512])
    assert table.loc["256 (tiny base)", "2 stages, in flight"] == 0.8
    assert table.loc["512", "2 stages, in flight"] == 1.8
    assert isinstance(table, pd.DataFrame) and table.index.name == "width"


def test_the_drawn_pipeline_is_saved_with_provenance(tmp_path):
    config, _ = tiny_qwen2()
    stamp = provenance.stamp(model="tiny", world_size=2)
    out = ch06.draw_pipeline_kv(tmp_path / "kv.png", stamp, config)
    assert out.is_file() and out.stat().st_size > 10_000
    assert json.loads((tmp_path / "kv.png.provenance.json").read_text())["model"] == "tiny"
