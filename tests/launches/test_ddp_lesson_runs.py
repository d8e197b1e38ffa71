"""Chapter 02's traced DDP step for real: two gloo ranks under torchrun, each bucket's all-reduce started
before the last gradient (overlapping backward), in reverse parameter order. The trace's parsing and figures on a
made-up trace: tests/unit/test_ddp_lesson.py."""

from __future__ import annotations

from distlab.chapters import ch02


def test_a_traced_ddp_step_overlaps_its_bucket_all_reduces_with_backward(tmp_path):
    traced = ch02.trace_ddp_step(tmp_path, bucket_cap_mb=1.0, timeout_s=300)
    table = ch02.overlap_table(traced)
    assert (table["all_reduces"] > 1).all() and (table["started_before_last_gradient"] > 0).all()
    assert [b["params"][0] for b in traced[0]["buckets"]][0] == "model.norm.weight"  # reverse order
    assert not list(tmp_path.glob("*.trace.json"))  # the raw traces are not left behind
