"""Chapter 05's plumbing and the balance theory it draws: the ideal step ratio and speedups from the hosts'
speeds, the even-vs-balanced drawing, the balance tables, and the mode line of the localhost fallback."""

from __future__ import annotations

import json

import pytest

from distlab.batching import ideal_speedups, ideal_step_ratio, predicted_step_ratio, rows_per_rank
from distlab.bench import lan_balance
from distlab.chapters import ch05
from distlab.lan import host_runs

STAMP = {"device": "test", "model": "none", "world_size": 3, "commit": "abc1234", "date": "2026-01-01 00:00 UTC"}


@pytest.mark.parametrize("speeds, ratio", [([1, 0.5], 2 / 3), ([1, 0.5, 0.5], 0.75), ([1, 1], 1.0), ([2, 1, 1], 0.75)])
def test_the_ideal_ratio_is_world_times_the_slowest_over_the_sum(speeds, ratio):
    assert ideal_step_ratio(speeds) == pytest.approx(ratio)


def test_the_ideal_ratio_is_what_an_exact_split_gives():
    speeds = [1.0, 0.5, 0.5]  # 60 rows split exactly by speed: 30/15/15, every host busy for 30 units
    exact = rows_per_rank(60, [0.5, 0.25, 0.25], 3, minimum=0)
    assert exact == [30, 15, 15]
    assert predicted_step_ratio(speeds, exact, [20, 20, 20]) == pytest.approx(ideal_step_ratio(speeds))


def test_the_speedups_over_the_fastest_host():
    assert ideal_speedups([1, 0.5, 0.5]) == pytest.approx({"even": 1.5, "balanced": 2.0})
    assert ideal_speedups([1, 1]) == pytest.approx({"even": 2.0, "balanced": 2.0})


def fake_result(quotas, naive_s, balanced_s, tokens=1000.0):
    world = len(quotas)
    return {"quotas": quotas, "rows_per_s": [10 * q for q in quotas], "naive_split": [6] * world,
            "balanced_split": rows_per_rank(6 * world, quotas, world), "global_rows": 6 * world,
            "naive_step_s": naive_s, "balanced_step_s": balanced_s, "ratio": balanced_s / naive_s,
            "naive_step_s_rounds": [naive_s], "balanced_step_s_rounds": [balanced_s],
            "theory_ratio": ideal_step_ratio(quotas), "predicted_ratio": 0.7, "ideal_speedups": ideal_speedups(quotas),
            "naive_tokens_per_s": tokens / naive_s, "balanced_tokens_per_s": tokens / balanced_s,
            "naive_curves": {"loss": [2.0, 1.5], "grad_norm": [0.5, 0.4]},
            "balanced_curves": {"loss": [2.0, 1.5 + 1e-6], "grad_norm": [0.5, 0.4]}}


def test_balance_tables_and_figure(tmp_path):
    three = fake_result([1.0, 0.5, 0.5], 1.0, 0.8)
    alone = {"rows": 18, "step_time_s": 1.5, "tokens_per_s": 1000 / 1.5}
    three["one_host"], three["speedups"] = alone, lan_balance.speedups(three, alone)
    results = {"2 hosts": fake_result([1.0, 0.5], 1.0, 0.7), "3 hosts": three}
    table = ch05.balance_table(results)
    assert list(table.theory) == pytest.approx([0.6667, 0.75])
    assert ch05.curve_difference(three) == pytest.approx(1e-6)
    speed = ch05.speedup_table(three)
    assert speed.speedup["even"] == pytest.approx(1.5) and speed.speedup["balanced"] == pytest.approx(1.875)
    assert list(speed.theory) == [1.5, 2.0]
    out = ch05.balance_figure(results, tmp_path / "balance.png", STAMP)
    assert out.stat().st_size > 0 and json.loads((tmp_path / "balance.png.provenance.json").read_text())
    assert "theory 0.750" in lan_balance.against_theory(three)


def test_the_drawing_of_the_two_splits(tmp_path):
    out = ch05.draw_even_vs_balanced([1.0, 0.5, 0.5], 12, tmp_path / "idea.png", STAMP)
    assert out.stat().st_size > 0


def test_the_fallback_says_why_and_what_it_loses():
    local = host_runs.place(2, force_local=True)
    line = ch05.mode(local)
    assert line.startswith("mode: FALLBACK to localhost, because asked for localhost")
    assert "not shaped" in line and "skipped" in line
    table = ch05.prerequisites()
    assert {"prerequisite", "needed for", "present here"} == set(table.columns) and len(table) == 5
