"""Chapter 05's remaining failure modes on the emulated LAN, and the pipeline split for uneven hosts:
a rank over its host's memory cap is OOM-killed and the job fails fast, the planner's advice then fits;
a node started with the wrong node rank is refused before training; the measured stage split gives the
slow host fewer layers. Each cluster test checks that no namespace, cgroup or process of ours survives.
"""

from __future__ import annotations

import os

import pytest

from distlab.lan import host_runs

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")


def test_memory_overflow_is_killed_fast_then_the_advice_fits(clean, our_processes):
    from distlab.lan.overflow import overflow_demo, report

    placement = host_runs.place(2)
    with placement.running():
        r = overflow_demo(placement)
    print(report(r))
    assert not r["full_ok"] and r["cap_bytes"] < r["allowance_bytes"] + r["planned_full_ddp_bytes"]
    assert r["oom"]["oom_kills"] >= 1, r["oom"]
    assert "-9" in r["error_line"] and "rank 1" in r["error_line"], r["error_line"]
    assert "memory cap hit (OOM kill)" in [d["rule"] for d in r["diagnosis"]]
    assert r["full_elapsed_s"] < 60, "the peer must fail on the broken connection, not the collective timeout"
    assert r["advised_ok"], r["advised_failure"]
    assert r["advised_oom"]["oom_kills"] == 0
    assert not our_processes("overflow_")


def test_wrong_node_rank_is_refused_fast(clean, our_processes):
    from distlab.lan.noderank import wrong_node_rank_demo

    placement = host_runs.place(2)
    with placement.running():
        r = wrong_node_rank_demo(placement)
    print(r["line"], f"({r['elapsed_s']:.1f} s)")
    assert r["refused"] and r["elapsed_s"] < 20, r
    assert placement.addresses[0] in r["line"] and placement.addresses[1] in r["line"]
    assert "wrong node rank" in [d["rule"] for d in r["diagnosis"]]
    assert not our_processes("wrong_rank")


def test_measured_pipeline_split_gives_the_slow_host_fewer_layers(clean):
    from distlab.bench.lan_pipeline import compare, report

    placement = host_runs.place(2)
    with placement.running():
        r = compare(placement, 0.5, steps=3, rounds=1, micro=1, name="t_pipe_split")
    print(report(r))
    assert r["measured_split"][1] < r["equal_split"][1], r["measured_split"]
    assert sum(r["measured_split"]) == r["layers"] and r["equal_step_s"] > 0 and r["measured_step_s"] > 0
