"""Chapter 03's FSDP trace: the profiler's spans read back, and the overlap of communication with compute."""

from __future__ import annotations

import math

import pytest

from distlab.chapters import ch03
from distlab.measure import fsdp_trace

STAMP = {"device": "test", "model": "tiny", "world_size": 2, "commit": "x", "date": "today"}


def chrome_trace():
    """One step (0-100 us): matmuls on the training thread at 10-40 and 60-70 us; an all-gather on a gloo
    thread at 30-50 us (half under compute), a reduce-scatter at 65-75 us (half under compute)."""
    def ev(name, ts, dur, tid=1):
        return {"ph": "X", "name": name, "ts": 5000 + ts, "dur": dur, "tid": tid}
    gather, scatter = list(fsdp_trace.COLLECTIVES)
    return {"traceEvents": [
        ev("step", 0, 100), ev("aten::mm", 10, 20), ev("aten::addmm", 20, 20), ev("aten::mm", 60, 10),
        ev(gather, 30, 20, tid=7), ev(scatter, 65, 10, tid=8), ev("aten::copy_", 40, 5),
        {"ph": "i", "name": "marker", "ts": 1}]}


def test_the_trace_keeps_steps_compute_and_collectives():
    spans = fsdp_trace.spans_of(chrome_trace())
    kinds = [s["kind"] for s in spans]
    assert kinds.count("compute") == 3 and kinds.count("all-gather") == 1 and kinds.count("reduce-scatter") == 1
    assert kinds.count("step") == 1 and not any(s["name"] == "aten::copy_" for s in spans)
    gather = next(s for s in spans if s["kind"] == "all-gather")
    assert gather["start_ms"] == pytest.approx(0.030) and gather["thread"] == 7


def test_overlap_is_the_collectives_time_under_compute(tmp_path):
    trace = {"steps": 1, "spans": fsdp_trace.spans_of(chrome_trace())}
    table = ch03.overlap_share(trace)
    assert table.loc["all-gather", "overlap_share"] == pytest.approx(0.5)
    assert table.loc["reduce-scatter", "overlap_share"] == pytest.approx(0.5)
    assert table.loc["compute (training thread)", "time_ms"] == pytest.approx(0.040)  # the union, not the sum
    assert math.isnan(table.loc["compute (training thread)", "overlap_share"])
    assert ch03.plot_fsdp_trace(trace, tmp_path / "fsdp.png", STAMP).exists()
