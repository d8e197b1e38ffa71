"""Tensor parallelism across a slow link (chapter 07, section 10): the bytes each strategy sends per step
against the formula and the planner, the runs of the sweep (the same rows per step), the table's
arithmetic, the figure, and the localhost fallback, which runs, says so and shapes nothing."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from distlab.bench.lan_ddp import BASE_CONFIG
from distlab.chapters import ch07

STAMP = {"device": "test", "model": "tiny", "world_size": 2, "commit": "x", "date": "today"}


def test_link_bytes_are_dtensors_count_and_the_planners_lora_gradients():
    config = json.loads(BASE_CONFIG.read_text())  # the tiny model's shape, without loading it
    sent = ch07.link_bytes(config, rows=4, seq_len=64)
    activation = 4 * 64 * config["hidden_size"] * 4  # one b x s x h fp32 tensor
    # 2 forward + 5 backward all-reduces per layer: what a CollectiveCounter counts in a full fine-tuning step
    assert sent["tp"] == config["num_hidden_layers"] * 7 * activation == 7_340_032
    assert sent["ddp"] == 1_183_744  # 295,936 LoRA parameters x 4 bytes: what DDP's buckets carry per step
    assert ch07.link_prediction(sent, ["1gbit"]).loc["1gbit", "tp"] == pytest.approx(7_340_032 * 8 / 1e9)


def test_every_rate_runs_both_strategies_on_the_same_rows_fastest_first():
    runs = ch07.link_runs(["50mbit", "10gbit"], rows=4, seq_len=64)
    assert [(r.rate, r.overrides["strategy"]) for r in runs] == [
        ("10gbit", "tp"), ("10gbit", "ddp"), ("50mbit", "tp"), ("50mbit", "ddp")]
    rows = {r.overrides["strategy"]: r.overrides["micro_batch_size"] * (1 if r.overrides["strategy"] == "tp" else 2)
            for r in runs}
    assert rows == {"tp": 4, "ddp": 4}  # tp's ranks both see the 4 rows; ddp's take 2 each
    assert all(not r.overrides["measure_comm"] and r.overrides["device"] == "cpu" for r in runs)  # timing runs


def test_the_table_sets_the_slow_down_beside_bytes_over_rate_and_the_figure_is_saved(tmp_path):
    sweep = pd.DataFrame([{"rate": rate, "Gbit/s": gbit, "strategy": s, "step s": step, "placement": "namespaces"}
                          for rate, gbit, s, step in [("10gbit", 10, "tp", 0.3), ("10gbit", 10, "ddp", 0.2),
                                                      ("50mbit", 0.05, "tp", 1.5), ("50mbit", 0.05, "ddp", 0.25)]])
    sent = {"tp": 7e6, "ddp": 1e6}
    table = ch07.link_table(sweep, sent)
    assert table.loc[("50mbit", "tp"), "slow-down (s)"] == pytest.approx(1.2)
    assert table.loc[("50mbit", "tp"), "bytes / rate (s)"] == pytest.approx(1.12)
    assert table.loc[("50mbit", "tp"), "link floor (s)"] == pytest.approx((7e6 - 2**20) * 8 / 50e6, abs=1e-3)
    assert table.loc[("10gbit", "tp"), "link floor (s)"] == 0  # 7 MB fit in one 10 MiB bucket
    assert table.loc[("10gbit", "ddp"), "slow-down (s)"] == 0
    out = ch07.link_figure(sweep, sent, tmp_path / "07_link_rate.png", STAMP)
    assert out.stat().st_size > 10_000


@pytest.mark.slow
def test_the_localhost_fallback_runs_both_strategies_and_says_so(capsys):
    sweep, mode = ch07.link_sweep(["1gbit"], steps=3, force_local=True, timeout_s=240)
    assert mode.startswith("mode: FALLBACK to localhost") and "not shaped" in mode
    assert "falling back to localhost agents" in capsys.readouterr().out
    assert set(sweep.strategy) == {"tp", "ddp"} and (sweep.placement == "localhost").all()
    assert (sweep["step s"] > 0).all()
