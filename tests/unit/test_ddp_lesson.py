"""Chapter 02's lesson plumbing: the traced DDP step's parsing and figures, the step split, the fault demo's
timeline, and the scaling benchmark's rule that throughput runs carry no timing hook. A real traced step under
torchrun: tests/launches/test_ddp_lesson_runs.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pandas as pd
import pytest

from distlab.bench import ddp_scaling
from distlab.chapters import ch02
from distlab.launch import local, scripts
from distlab.measure import ddp_trace

STAMP = {"device": "test", "model": "tiny", "world_size": 2, "commit": "x", "date": "today"}


def chrome_trace():
    """A step (0-100 us) with forward, backward (two autograd ops) and two buckets' all-reduces, one of
    which starts before the last backward op ends."""
    def ev(name, ts, dur, tid=1):
        return {"ph": "X", "name": name, "ts": 1000 + ts, "dur": dur, "tid": tid}
    return {"traceEvents": [
        ev("step", 0, 100), ev("forward", 0, 30), ev("backward", 30, 60), ev("optimizer step", 90, 10),
        ev(ddp_trace.BACKWARD_OP + "MmBackward0", 30, 20), ev(ddp_trace.BACKWARD_OP + "AccumulateGrad", 60, 20),
        ev(ddp_trace.ALLREDUCE_CALL, 52, 1), ev(ddp_trace.GLOO_ALLREDUCE, 53, 15, tid=7),
        ev(ddp_trace.GLOO_ALLREDUCE, 81, 8, tid=8), ev("aten::mm", 31, 5), {"ph": "i", "name": "marker", "ts": 1}]}


def traces():
    spans = ddp_trace.spans_of(chrome_trace())
    buckets = [{"index": 0, "params": ["model.norm.weight", "model.layers.1.mlp.up_proj.weight"], "bytes": 2**20},
               {"index": 1, "params": ["model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight"],
                "bytes": 2**21}]
    return [{"rank": r, "spans": spans, "buckets": buckets} for r in (0, 1)]


def test_the_trace_keeps_phases_backward_ops_and_all_reduces_in_ms_from_the_step():
    spans = ddp_trace.spans_of(chrome_trace())
    kinds = [s["kind"] for s in spans]
    assert kinds.count("phase") == 3 and kinds.count("backward op") == 2 and kinds.count("all-reduce") == 2
    assert kinds.count("all-reduce call") == 1 and not any(s["name"] == "aten::mm" for s in spans)
    first = next(s for s in spans if s["kind"] == "all-reduce")
    assert first["start_ms"] == pytest.approx(0.053) and first["end_ms"] == pytest.approx(0.068)
    assert first["thread"] == 7
    assert any(s["name"] == "AccumulateGrad" for s in spans)  # the autograd prefix is dropped


def test_overlap_counts_the_all_reduces_that_start_before_the_last_gradient(tmp_path):
    table = ch02.overlap_table(traces())
    assert list(table.index) == [0, 1]
    row = table.loc[0]
    assert row["last_gradient_ms"] == pytest.approx(0.080) and row["all_reduces"] == 2
    assert row["started_before_last_gradient"] == 1 and row["all_reduce_threads"] == 2
    buckets = ch02.bucket_table(traces()[0])
    assert list(buckets["MiB"]) == [1.0, 2.0] and buckets.loc[1, "last parameter"] == "model.embed_tokens.weight"
    assert ch02.plot_ddp_trace(traces(), tmp_path / "trace.png", STAMP).exists()


def test_the_step_split_labels_every_segment(tmp_path):
    import matplotlib.pyplot as plt

    texts = []
    real_close = plt.close
    rows = {"1 rank(s)": {"compute_s": 0.5}, "2 rank(s)": {"compute_s": 0.27, "comm_wait_s": 0.004,
                                                         "comm_transfer_s": 0.0008}}

    def keep_texts(fig):
        texts.extend(t.get_text() for ax in fig.axes for t in ax.texts)
        real_close(fig)

    plt.close = keep_texts
    try:
        ch02.plot_step_split(rows, tmp_path / "split.png", STAMP)
    finally:
        plt.close = real_close
    assert texts == ["500.0 ms", "270.0 ms", "the transfer itself: 0.80 ms", "waiting for the slower rank: 4.00 ms"]


def test_the_fault_timeline_leaves_out_the_shell_wrappers_and_marks_events(tmp_path):
    procs = [("10", "torchrun (pid 10)", 0, 1.5), ("11", "bash (pid 11)", 0, 3),  # timeout, bash: wrappers
             ("12", "torchrun (pid 12)", 2, 280), ("13", "rank 1 (pid 13)", 90, 600)]
    rows = [{"t_s": t, "source": "process", "id": i, "label": label, "util_pct": u, "mem_mib": m}
            for t in (0.5, 1.0, 1.5) for i, label, u, m in procs]
    csv = tmp_path / "util.csv"
    pd.DataFrame(rows).to_csv(csv, index=False)
    lines = [(100.2, "[default1]:[distlab.faults] rank 1: SIGKILL after step 7"),
             (101.0, "[default0]:[distlab] resumed from x (step 4)")]
    marks = ch02.line_times(lines, "SIGKILL", "resumed from", "never printed")
    assert marks == {"SIGKILL": 100.2, "resumed from": 101.0, "never printed": None}
    fig = ch02.plot_fault_timeline(csv, tmp_path / "fault.png", STAMP, 100.0,
                                   {"killed": 100.2, "resumed": 101.0, "missing": None}, "t")
    strip, util, _ = fig.axes
    assert [t.get_text() for t in util.get_legend().get_texts()] == ["torchrun (pid 12)", "rank 1 (pid 13)"]
    assert [t.get_text() for t in strip.texts] == ["killed", "resumed"]
    assert sorted(round(line.get_xdata()[0], 3) for line in util.lines if line.get_linestyle() == "--") == [0.2, 1.0]


def test_throughput_runs_carry_no_timing_hook_and_the_breakdown_does(tmp_path, monkeypatch):
    assert ddp_scaling.SETUP["measure_comm"] is False
    with pytest.raises(ValueError, match="timing hook off"):
        ddp_scaling.measure(steps=5, overrides={"measure_comm": True})
    seen = []

    def fake_launch(name, k, overrides, timeout_s, runs_dir, echo):
        seen.append((k, overrides["measure_comm"]))
        return SimpleNamespace(log=tmp_path / name / "train_log.jsonl", result=SimpleNamespace(elapsed_s=1.0))

    monkeypatch.setattr(local, "launch_training", fake_launch)
    jobs = ddp_scaling.breakdown(steps=5, runs_dir=tmp_path, progress=None)
    assert seen == [(1, True), (2, True)] and sorted(jobs) == [1, 2]


def test_the_ceiling_runs_one_rank_alone_then_two_at_once(tmp_path, monkeypatch):
    import threading

    tokens = {"alone": 100.0, "pair": 90.0}
    running, peak = [], []
    lock = threading.Lock()

    def fake_launch(name, k, overrides, timeout_s, runs_dir, echo):
        assert k == 1 and overrides["measure_comm"] is False
        with lock:
            running.append(name)
            peak.append(len(running))
        threading.Event().wait(0.05)  # long enough for the pair's two threads to overlap
        with lock:
            running.remove(name)
        return SimpleNamespace(log=tokens["alone" if "alone" in name else "pair"])

    monkeypatch.setattr(ddp_scaling, "launch_training", fake_launch)
    monkeypatch.setattr(ddp_scaling.scaling_table, "run_summary", lambda log: {"tokens_per_s": log})
    table = ddp_scaling.ceiling(steps=5, rounds=2, runs_dir=tmp_path, progress=None)
    assert table["ceiling"].tolist() == [0.9, 0.9] and max(peak) == 2  # the pair ran at the same time


def test_the_torchrun_result_line_is_read_back():
    run = SimpleNamespace(tail=["noise", "[default0]:RESULT " + json.dumps({"max_param_diff": 0.0}), "exit"])
    assert scripts.result_line(run) == {"max_param_diff": 0.0}
    with pytest.raises(ValueError, match="no RESULT"):
        scripts.result_line(SimpleNamespace(tail=["nothing"]))
