"""distlab.bench.compiled_step: the eager and the compiled LoRA step side by side. What is checked is the table's
shape, that the two models computed the same loss before anything was timed, and what --out writes; never a speed
(ratios are printed by the benchmark, not asserted)."""

from __future__ import annotations

import json
import os

import pandas as pd
import pytest

from distlab.bench import compiled_step


@pytest.mark.slow
def test_a_tiny_run_prints_the_table_and_saves_it_with_provenance(tmp_path, capsys):
    argv = ["--steps", "2", "--rounds", "1", "--warmup", "1", "--seq-len", "64", "--micro-batch-size", "2",
            "--warm-cache", "--out", str(tmp_path)]
    assert compiled_step.main(argv) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("training"))
    assert header.split() == list(compiled_step.COLUMNS)
    assert "compiled blocks: " in out and "x eager tokens/s (range " in out and "compile took " in out

    table = tmp_path / compiled_step.TABLE
    df = pd.read_csv(table)
    assert list(df.columns) == list(compiled_step.COLUMNS)
    assert list(zip(df.training, df.blocks)) == [("lora", "eager"), ("lora", "compiled")]
    assert (df.loss_rel_diff <= compiled_step.LOSS_RTOL).all()  # the same computation, checked before timing
    assert df.check_loss.iloc[0] == pytest.approx(df.check_loss.iloc[1], rel=compiled_step.LOSS_RTOL)
    assert (df.ms_per_step > 0).all() and (df.tokens_per_s > 0).all() and (df.recompiles == 0).all()
    assert df.vs_eager.iloc[0] == 1.0

    side = json.loads(table.with_name(table.name + ".provenance.json").read_text())
    assert side["benchmark"] == "distlab.bench.compiled_step"
    assert side["arguments"] == {"steps": 2, "rounds": 1, "warmup": 1, "micro_batch_size": 2, "seq_len": 64,
                                 "full": False, "warm_cache": True}
    assert side["threads_per_rank"] == 1 and side["inputs"] and side["commit"]


class _FakeLine:
    """A Line that builds nothing: its loss check answers `loss`, and its steps are only counted."""

    losses = {False: 2.0, True: 2.0}
    steps = 0

    def __init__(self, cfg, compiled):
        self.compiled, self.model, self.ms = compiled, None, []
        self.data = _Data([None] * 8)

    def check_loss(self, batch):
        return self.losses[self.compiled], 0.5

    def run(self, batches):
        type(self).steps += len(batches)
        return 0.1 * len(batches) * (0.5 if self.compiled else 1.0)


class _Data(list):
    def batch(self, rows):
        return {"n_real_tokens": 10 * len(rows)}


@pytest.fixture
def fake_lines(monkeypatch):
    class Line(_FakeLine):
        losses = dict(_FakeLine.losses)
        steps = 0

    monkeypatch.setattr(compiled_step, "Line", Line)
    monkeypatch.setattr(compiled_step, "_same_weights", lambda a, b: True)
    monkeypatch.setattr(compiled_step, "_unique_graphs", lambda: 0)
    return Line


def test_losses_that_differ_stop_the_benchmark_before_any_step_is_timed(fake_lines):
    fake_lines.losses[True] = 2.0 * (1 + 10 * compiled_step.LOSS_RTOL)
    with pytest.raises(compiled_step.LossMismatch, match="not timed"):
        compiled_step.compare(steps=2, rounds=1, warmup=1, cold=False, echo=lambda *_: None)
    assert fake_lines.steps == 0


def test_the_ratio_is_of_medians_with_the_per_round_range_and_the_compile_seconds_apart(fake_lines):
    df = compiled_step.compare(steps=2, rounds=3, warmup=1, cold=False, echo=lambda *_: None)
    assert list(df.columns) == list(compiled_step.COLUMNS)
    compiled = df[df.blocks == "compiled"].iloc[0]
    assert compiled.vs_eager == pytest.approx(2.0) and compiled.vs_eager_min == pytest.approx(2.0)
    assert compiled.tokens_per_s == pytest.approx(2 * df[df.blocks == "eager"].iloc[0].tokens_per_s)
    assert fake_lines.steps == 2 * (1 + 3 * 2)  # each line: the warm-up step, then 3 rounds of 2
    assert compiled_step.compile_seconds(df) == (pytest.approx(-0.05), 0.0)  # the fake's warm-up is no compile
    assert "2.00x eager tokens/s (range 2.00-2.00 over 3 rounds)" in compiled_step.summary(df, 3)


def test_a_mismatch_is_one_line_and_exit_1(monkeypatch, capsys):
    def mismatch(*args, **kwargs):
        raise compiled_step.LossMismatch("lora: losses differ: not timed")

    monkeypatch.setattr(compiled_step, "compare", mismatch)
    assert compiled_step.main([]) == 1
    assert capsys.readouterr().err.strip() == "distlab.bench.compiled_step: lora: losses differ: not timed"


def test_a_cold_compile_uses_an_empty_cache_and_restores_the_variable(monkeypatch):
    monkeypatch.setenv(compiled_step.CACHE_VARIABLE, "/somewhere/else")
    with compiled_step.cold_compile():
        folder = os.environ[compiled_step.CACHE_VARIABLE]
        assert folder != "/somewhere/else" and os.path.isdir(folder) and not os.listdir(folder)
    assert os.environ[compiled_step.CACHE_VARIABLE] == "/somewhere/else" and not os.path.exists(folder)
    monkeypatch.delenv(compiled_step.CACHE_VARIABLE)
    with compiled_step.cold_compile():
        pass
    assert compiled_step.CACHE_VARIABLE not in os.environ
