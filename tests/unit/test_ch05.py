"""Chapter 05's plumbing and the balance theory it draws: the ideal step ratio and speedups from the hosts'
speeds, the even-vs-balanced drawing, the balance tables, the mode line of the localhost fallback and what it
measures (loopback once, never labelled with a rate), which timing claims a machine can check and with what
margin, and the failure demos that need the namespace cluster."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pandas as pd
import pytest

from distlab.batching import (
    ideal_speedups,
    ideal_step_ratio,
    predicted_step_ratio,
    rows_per_rank,
    step_ratio_with_fixed,
)
from distlab.bench import lan_balance, lan_ddp
from distlab.chapters import ch05
from distlab.lan import host_runs, hosts
from distlab.machine import Sections, example_machines

EXAMPLES = example_machines()

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


def test_the_fixed_part_of_a_step_is_what_the_naive_step_holds_beyond_its_compute():
    # speeds 10 and 5 rows/s: naive 6 + 6 rows compute 1.2 s, balanced 8 + 4 rows 0.8 s; the naive step took 1.5 s
    ratio, fixed = step_ratio_with_fixed([10, 5], [8, 4], [6, 6], naive_step_s=1.5)
    assert fixed == pytest.approx(0.3) and ratio == pytest.approx((0.8 + 0.3) / 1.5)
    assert step_ratio_with_fixed([10, 5], [8, 4], [6, 6], naive_step_s=1.0) == pytest.approx((0.8 / 1.2, 0.0))


def fake_result(quotas, naive_s, balanced_s, tokens=1000.0):
    world = len(quotas)
    return {"quotas": quotas, "rows_per_s": [10 * q for q in quotas], "naive_split": [6] * world,
            "balanced_split": rows_per_rank(6 * world, quotas, world), "global_rows": 6 * world,
            "naive_step_s": naive_s, "balanced_step_s": balanced_s, "ratio": balanced_s / naive_s,
            "naive_step_s_rounds": [naive_s], "balanced_step_s_rounds": [balanced_s],
            "theory_ratio": ideal_step_ratio(quotas), "predicted_ratio": 0.7, "ideal_speedups": ideal_speedups(quotas),
            "predicted_ratio_with_fixed": 0.75, "fixed_s": 0.1,
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
    line = local.mode_line()
    assert line.startswith("mode: FALLBACK to localhost, because asked for localhost")
    assert "not shaped" in line and "skipped" in line and "once on loopback" in line
    assert "skipped" not in local.mode_line(demos=False)  # chapter 08: no failure demos to skip
    table = ch05.prerequisites(EXAMPLES["the book's build VM, 2 cores, root"]).set_index("prerequisite")
    assert {"needed for", "present here"} == set(table.columns) and len(table) == 5
    assert table["present here"][["Linux", "root (CAP_NET_ADMIN)", "`ip` and `tc` (iproute2)"]].all()
    mac = ch05.prerequisites(EXAMPLES["macOS laptop, 10 cores"]).set_index("prerequisite")["present here"]
    assert not mac[["Linux", "root (CAP_NET_ADMIN)", "`ip` and `tc` (iproute2)"]].any()


def test_the_fallback_measures_loopback_once_instead_of_each_rate():
    local = host_runs.place(3, force_local=True)
    assert local.link_rates(["100mbit", "1gbit"]) == [hosts.LOOPBACK] and local.why_unshaped
    assert hosts.link_bits(hosts.LOOPBACK) > hosts.rate_bits("10gbit")  # unshaped: the fastest, no rate
    assert math.isnan(hosts.link_bytes_per_s(hosts.LOOPBACK)) and hosts.link_bytes_per_s("1gbit") == 1.25e8
    with pytest.raises(ValueError, match="expected e.g. 100mbit"):
        hosts.rate_bits(hosts.LOOPBACK)  # never accepted as a rate to shape a link to
    names = [r.name for r in lan_ddp._sweep_runs("x", local.link_rates(["100mbit", "1gbit"]))]
    assert names == ["x_loopback_lora", "x_loopback_full"]


def figure_text(svg: Path) -> str:
    """What a saved figure says: matplotlib's SVG keeps every text it drew as a comment."""
    return " ".join(re.findall(r"<!-- (.*?) -->", svg.read_text()))


def loopback_net() -> pd.DataFrame:
    return pd.DataFrame([{"rate": hosts.LOOPBACK, "rate_bytes_per_s": math.nan, "size_bytes": 2**k,
                          "busbw_bytes_per_s": 1e8 * k, "fraction_of_link": math.nan, "placement": "localhost"}
                         for k in (16, 20, 24)])


def test_the_fallback_figures_carry_no_link_rate(tmp_path):
    text = figure_text(ch05.allreduce_figure(loopback_net(), tmp_path / "net.svg", STAMP))
    assert "loopback, not shaped" in text and "bus bandwidth (MB/s)" in text
    assert not re.search(r"\d+ ?[mgk]bit|% of link|tbf rate", text, re.I), text
    sweep = pd.DataFrame([{"rate": hosts.LOOPBACK, "mode": m, "compute_time_s": 0.2, "comm_time_s": c,
                           "step_time_s": 0.2 + c, "comm_share": c / (0.2 + c)} for m, c in (("lora", 0.01),
                                                                                        ("full", 0.1))])
    hooks = pd.DataFrame([{"hook": h, "rate": hosts.LOOPBACK, "steps": [1, 2, 3], "losses": [3.0, 2.9, 2.8],
                           "step_time_s": 0.3, "comm_bytes": b} for h, b in (("none", 8e7), ("fp16", 4e7))])
    text = figure_text(ch05.ddp_figure(sweep, hooks, tmp_path / "ddp.svg", STAMP))
    assert "loopback, not shaped" in text and "agents on localhost" in text
    assert not re.search(r"\d+ ?[mgk]bit|tbf", text, re.I), text
    assert list(ch05.at_slowest_link(sweep).index) == ["lora", "full"]
    shaped = loopback_net().assign(rate="1gbit", fraction_of_link=0.95)
    text = figure_text(ch05.allreduce_figure(shaped, tmp_path / "shaped.svg", STAMP))
    assert "1gbit" in text and "% of link rate" in text and "not shaped" not in text


def test_a_timing_claim_needs_a_core_per_rank_and_must_hold_in_every_round(capsys):
    vm = Sections(EXAMPLES["the book's build VM, 2 cores, root"])
    clear = ch05.faster_in_every_round("b faster", 2, [0.8, 1.2], [0.6, 0.65], vm)  # one slow round of a: still
    assert clear["checked"] and clear["holds"] and clear["slower: fastest round (s)"] == 0.8
    noisy = ch05.faster_in_every_round("b faster", 2, [1.0, 1.1], [0.7, 1.05], vm)  # a round of b lost to a's
    assert noisy["checked"] and not noisy["holds"] and noisy["faster: median (s)"] == pytest.approx(0.875)
    assert capsys.readouterr().out == ""  # both could be checked: no line
    three = ch05.faster_in_every_round("3 hosts", 3, [1.0], [0.7], vm)
    assert not three["checked"] and three["why not checked"].startswith("needs 3 cores (this machine gives 2)")
    assert capsys.readouterr().out.splitlines() == [f"not checked: 3 hosts: {three['why not checked']}"]


def test_the_balance_claims_of_three_hosts_on_two_cores_are_shown_not_checked(capsys):
    three = fake_result([1.0, 0.5, 0.5], 1.0, 0.8)
    three["one_host"] = {"rows": 18, "step_time_s": 1.5, "tokens_per_s": 1000 / 1.5}
    results = {"2 hosts": fake_result([1.0, 0.5], 1.0, 0.7), "3 hosts": three}
    vm = Sections(EXAMPLES["the book's build VM, 2 cores, root"])
    claims = ch05.balance_claims(results, vm)
    assert list(claims.checked) == [True, False, False] and claims.holds.all()
    assert claims.loc["3 hosts: split by speed faster than host 0 alone (same rows per step)",
                      "slower: median (s)"] == 1.5
    assert len(capsys.readouterr().out.splitlines()) == 2 and len(vm.table()) == 2
    laptop = Sections(EXAMPLES["Linux laptop, 8 cores, normal user"])
    assert ch05.balance_claims(results, laptop).checked.all() and laptop.table() == []
    race = {"equal_step_s_rounds": [1.0, 1.02], "measured_step_s_rounds": [0.8, 0.85]}
    pipe = ch05.pipeline_claims(race, Sections(EXAMPLES["cloud VM, 1 core"]))
    assert not pipe.checked.any() and "needs 2 cores" in capsys.readouterr().out


def test_a_failure_demo_needs_the_namespace_cluster_and_says_why_in_one_line(capsys):
    local = host_runs.place(2, force_local=True)
    capsys.readouterr()  # place's own line: falling back
    laptop = Sections(EXAMPLES["Linux laptop, 8 cores, normal user"])
    assert not ch05.cluster_section(laptop, "7. A cut cable", local)
    vm = Sections(EXAMPLES["the book's build VM, 2 cores, root"])
    assert not ch05.cluster_section(vm, "7. A cut cable", local)  # the machine could, this placement did not
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("skipped: 7. A cut cable: needs network namespaces: Linux, root and iproute2")
    assert lines[1] == "skipped: 7. A cut cable: needs the namespace cluster, which failed here: asked for localhost"
    assert len(lines) == 2
