"""Tensor parallelism across a slow link (chapter 08, section 4), in one process: the bytes each strategy sends per
step (DTensor's count against the planner's LoRA gradients), the runs of the sweep (the same rows per step), the
table's arithmetic, the figure, the loopback table and figure labelled with no rate; chapter 08's meshes drawn and its
2-D run's rows; the devices, dtypes and loss tolerance that the `auto` parameters of chapters 07 and 08 give each
machine (distlab.lessons, below both chapters). The counted step and the localhost fallback under torchrun:
tests/launches/test_tp_links_runs.py."""

from __future__ import annotations

import json
import math
import re

import pandas as pd
import pytest

from distlab import lessons, machine
from distlab.bench.lan_ddp import BASE_CONFIG
from distlab.chapters import ch08
from distlab.lan.hosts import LOOPBACK
from distlab.machine import example_machines

STAMP = {"device": "test", "model": "tiny", "world_size": 2, "commit": "x", "date": "today"}


def test_link_bytes_are_dtensors_count_and_the_planners_lora_gradients():
    config = json.loads(BASE_CONFIG.read_text())  # the tiny model's shape, without loading it
    sent = ch08.link_bytes(config, rows=4, seq_len=64)
    activation = 4 * 64 * config["hidden_size"] * 4  # one b x s x h fp32 tensor
    layers, r = config["num_hidden_layers"], 16
    # 2 forward + 2 backward all-reduces of activations per layer, but the first layer's input gradient (a frozen
    # embedding needs none); the row-parallel lora_A outputs (2 a layer, r values a token); the column-parallel
    # lora_A gradients (5 a layer, r x hidden, once a step); the gradient norm's float64
    lora = 2 * layers * 4 * 64 * r * 4 + 5 * layers * r * config["hidden_size"] * 4
    assert sent["tp"] == (4 * layers - 1) * activation + lora + 8 == 4_390_920
    assert sent["ddp"] == 1_183_744  # 295,936 LoRA parameters x 4 bytes: what DDP's buckets carry per step
    assert ch08.link_prediction(sent, ["1gbit"]).loc["1gbit", "tp"] == pytest.approx(4_390_920 * 8 / 1e9)


def test_every_rate_runs_both_strategies_on_the_same_rows_fastest_first():
    runs = ch08.link_runs(["50mbit", "10gbit"], rows=4, seq_len=64)
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
    table = ch08.link_table(sweep, sent)
    assert table.loc[("50mbit", "tp"), "slow-down (s)"] == pytest.approx(1.2)
    assert table.loc[("50mbit", "tp"), "bytes / rate (s)"] == pytest.approx(1.12)
    # one bucket passes free: 64 KiB at 50 Mbit/s (its 2 ms of line would be less), 2.5 MB (2 ms) at 10 Gbit/s
    assert table.loc[("50mbit", "tp"), "link floor (s)"] == pytest.approx((7e6 - 2**16) * 8 / 50e6, abs=1e-3)
    assert table.loc[("10gbit", "tp"), "link floor (s)"] == pytest.approx((7e6 - 2.5e6) * 8 / 10e9, abs=1e-3)
    assert table.loc[("10gbit", "ddp"), "slow-down (s)"] == 0
    out = ch08.link_figure(sweep, sent, tmp_path / "08_link_rate.png", STAMP)
    assert out.stat().st_size > 10_000


def figure_text(svg) -> str:
    """What a saved figure says: matplotlib's SVG keeps every text it drew as a comment."""
    return " ".join(re.findall(r"<!-- (.*?) -->", svg.read_text()))


def test_on_loopback_the_table_and_figure_carry_no_link_rate(tmp_path):
    sweep = pd.DataFrame([{"rate": LOOPBACK, "Gbit/s": math.nan, "strategy": s, "step s": step,
                           "placement": "localhost"} for s, step in (("tp", 0.4), ("ddp", 0.2))])
    sent = {"tp": 7e6, "ddp": 1e6}
    assert ch08.why_unshaped(sweep) == "the links are loopback, not shaped (localhost fallback)"
    table = ch08.link_table(sweep, sent)
    assert list(table.columns) == ["step s", "MB per step"] and list(table.index) == [(LOOPBACK, "tp"),
                                                                                       (LOOPBACK, "ddp")]
    text = figure_text(ch08.link_figure(sweep, sent, tmp_path / "08_link_rate.svg", STAMP))
    assert "loopback, not shaped" in text and "7.0 MB per step" in text
    assert not re.search(r"\d+ ?[mgk]bit|Gbit/s|link rate,", text, re.I), text


def test_the_meshes_are_drawn_and_the_2d_run_splits_the_rows_over_its_groups(tmp_path):
    assert ch08.draw_mesh_2d(tmp_path / "08_mesh_2d.png", STAMP).stat().st_size > 10_000
    assert ch08.draw_hsdp_and_3d(tmp_path / "08_hsdp_3d.png", STAMP).stat().st_size > 10_000
    with pytest.raises(ValueError, match="does not split over 2 data-parallel groups"):
        ch08.train_one_and_2d({"micro_batch_size": 3})  # refused before anything is launched


def test_auto_devices_and_the_loss_tolerance_follow_the_machine():
    examples = example_machines()
    laptop = machine.auto_parameters(examples["Linux laptop, 8 cores, normal user"])
    one, ranks = lessons.run_devices("auto", "auto", laptop)
    assert one == ranks == {"device": "cpu", "dtype": "fp32"} and lessons.loss_tolerance("fp32", "fp32") == 1e-5
    one_gpu = machine.auto_parameters(examples["one GPU (24 GiB), 16 cores"])
    one, ranks = lessons.run_devices("auto", "auto", one_gpu)  # ranks cannot share the one GPU: CPU, fp32
    assert one == {"device": "cuda", "dtype": "bf16-autocast"} and ranks == {"device": "cpu", "dtype": "fp32"}
    assert lessons.loss_tolerance(one["dtype"], ranks["dtype"]) == 0.05  # bf16's rounding sets the tolerance
    node = machine.auto_parameters(examples["GPU node, 8 x 80 GiB, 64 cores"])
    assert lessons.run_devices("cpu", "fp32", node) == ({"device": "cpu", "dtype": "fp32"},) * 2  # explicit wins
    assert lessons.rank_needs("cuda", 4) == ("gpus:4",) and lessons.rank_needs("cpu", 4) == ()
