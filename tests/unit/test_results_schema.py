"""One results schema: the summary math on small hand-made step logs (slowest rank, warm-up exclusion,
efficiency, communication share, peak bytes), and every results table (chapter 02's scaling table,
chapter 03's metrics and report, chapter 04's pipeline table, the DDP benchmark's printout) drawing its
column names from distlab.results.schema."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from distlab.bench import ddp_scaling
from distlab.launch import local
from distlab.metrics import StepLog
from distlab.pipeline_sweeps import table_row
from distlab.results import benchmark_report, scaling_table, schema

W = schema.WARMUP_STEPS
MIB = 2**20


def step(n: int, seconds: float, *, world: int = 2, tokens: int = 1000, comm: float | None = 0.1,
         nbytes: int | None = 4 * MIB, peak: int = 100 * MIB, loss: float | None = None, **extra) -> dict:
    rec = {"step": n, "world_size": world, "loss": loss if loss is not None else 3.0 - 0.1 * n,
           "step_time_s": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "peak_mem_bytes": peak, **extra}
    if comm is not None:
        rec.update(comm_time_s=comm, comm_bytes=nbytes)
    return rec


def write_logs(out: Path, steps_by_rank: dict[int, list[dict]], start: dict | None = None) -> Path:
    """Step logs as the training loop writes them (rank 0: train_log.jsonl, rank r: train_log.rank{r}.jsonl)."""
    for rank, steps in steps_by_rank.items():
        log = StepLog(out, rank, all_ranks=True)
        if rank == 0 and start is not None:
            log.write("start", **start)
        for rec in steps:
            log.write("step", **rec)
        if rank == 0:
            log.write("end", final_loss=steps[-1]["loss"])
    return out / "train_log.jsonl"


def test_warmup_is_one_constant_and_leaves_a_steady_step_in_the_shortest_test_runs():
    assert isinstance(W, int) and 1 <= W <= 3  # the quick profile's pipeline table runs 3 steps


def test_slowest_rank_per_step_then_the_steady_mean():
    # warm-up steps are slow on purpose: they must not count
    rank0 = [step(n, 5.0) for n in range(1, W + 1)] + [step(W + 1, 1.0), step(W + 2, 2.0), step(W + 3, 1.0)]
    rank1 = [step(n, 9.0) for n in range(1, W + 1)] + [step(W + 1, 1.5), step(W + 2, 1.0), step(W + 3, 1.0)]
    s = schema.summarise({0: rank0, 1: rank1})
    assert s["world_size"] == 2 and s["steps_averaged"] == 3
    assert s["step_time_s"] == pytest.approx((1.5 + 2.0 + 1.0) / 3)  # max over ranks per step, then the mean
    assert s["tokens_per_s"] == pytest.approx(3000 / 4.5)  # steady tokens / steady time of the slowest rank
    assert s["comm_time_s"] == pytest.approx(0.1) and s["comm_share"] == pytest.approx(0.1 / 1.5)
    assert s["compute_time_s"] == pytest.approx(1.5 - 0.1) and s["comm_bytes"] == 4 * MIB
    assert s["final_loss"] == rank0[-1]["loss"]
    assert s["mean_loss"] == pytest.approx(sum(r["loss"] for r in rank0) / len(rank0))  # every step: a result
    assert set(s) == set(schema.SUMMARY) and list(s) == list(schema.SUMMARY)


def test_warmup_exclusion_counts_step_numbers_not_records():
    """With logging_steps = 2 only even steps are logged; still the steps numbered above the warm-up count."""
    logged = [step(n, 10.0 if n <= W else 1.0, world=1, comm=None) for n in range(2, W + 8, 2)]
    s = schema.summarise({0: logged})
    assert s["steps_averaged"] == sum(1 for r in logged if r["step"] > W)
    assert s["step_time_s"] == pytest.approx(1.0)


def test_comm_share_is_a_mean_over_ranks_and_nan_when_unmeasured():
    rank0 = [step(n, 1.0, comm=0.2, nbytes=8) for n in range(1, W + 3)]
    rank1 = [step(n, 2.0, comm=0.4, nbytes=16) for n in range(1, W + 3)]
    s = schema.summarise({0: rank0, 1: rank1})
    assert s["comm_time_s"] == pytest.approx(0.3) and s["comm_share"] == pytest.approx(0.3 / 2.0)
    assert s["comm_bytes"] == pytest.approx(12)
    unmeasured = schema.summarise({0: rank0, 1: [step(n, 2.0, comm=None) for n in range(1, W + 3)]})
    assert math.isnan(unmeasured["comm_time_s"]) and math.isnan(unmeasured["comm_share"])
    assert math.isnan(unmeasured["compute_time_s"]) and math.isnan(unmeasured["comm_bytes"])
    nan_on_one_step = [step(n, 1.0, comm=float("nan") if n == W + 1 else 0.2) for n in range(1, W + 3)]
    assert math.isnan(schema.summarise({0: nan_on_one_step})["comm_share"])


def test_peak_memory_is_bytes_max_over_ranks_and_steps():
    rank0 = [step(n, 1.0, peak=(100 + n) * MIB) for n in range(1, W + 3)]
    rank1 = [step(n, 1.0, peak=300 * MIB if n == 1 else 200 * MIB) for n in range(1, W + 3)]
    s = schema.summarise({0: rank0, 1: rank1})
    assert s["peak_mem_bytes"] == 300 * MIB  # a peak is a peak, warm-up included
    assert schema.parse_per_rank(s["peak_mem_bytes_per_rank"]) == [(100 + W + 2) * MIB, 300 * MIB]


def test_only_steps_every_rank_logged_count():
    """After a resume, ranks other than 0 log only the new segment."""
    rank0 = [step(n, 1.0) for n in range(1, W + 4)]
    rank1 = [step(n, 3.0) for n in range(W + 2, W + 4)]
    s = schema.summarise({0: rank0, 1: rank1})
    assert s["steps_averaged"] == 2 and s["step_time_s"] == pytest.approx(3.0)


def test_too_short_a_run_is_a_clear_error():
    with pytest.raises(ValueError, match=rf"my run: no step after the {W} warm-up steps.*at least {W + 1}"):
        schema.summarise({0: [step(n, 1.0) for n in range(1, W + 1)]}, source="my run")
    with pytest.raises(ValueError, match="no logged step in common"):
        schema.summarise({0: [step(W + 1, 1.0)], 1: [step(W + 2, 1.0)]})


def test_efficiency_against_the_one_rank_run_of_the_same_setup():
    rows = [{"mode": "lora", "world_size": 1, "tokens_per_s": 100.0},
            {"mode": "lora", "world_size": 2, "tokens_per_s": 180.0},
            {"mode": "full", "world_size": 1, "tokens_per_s": 50.0},
            {"mode": "full", "world_size": 4, "tokens_per_s": 150.0},
            {"mode": "other", "world_size": 2, "tokens_per_s": 10.0}]
    out = {(r["mode"], r["world_size"]): r for r in schema.add_scaling(rows, same_setup=("mode",))}
    assert out[("lora", 1)]["scaling_efficiency"] == 1.0
    assert out[("lora", 2)]["speedup"] == pytest.approx(1.8)
    assert out[("lora", 2)]["scaling_efficiency"] == pytest.approx(0.9)
    assert out[("full", 4)]["scaling_efficiency"] == pytest.approx(0.75)
    assert math.isnan(out[("other", 2)]["scaling_efficiency"])  # no 1-rank run of that setup
    # without a setup key every row compares with the (first) 1-rank row
    assert schema.add_scaling(rows[:2])[1]["scaling_efficiency"] == pytest.approx(0.9)


def test_summary_from_step_logs_on_disk(tmp_path):
    steps = {r: [step(n, 1.0 + r) for n in range(1, W + 3)] for r in range(2)}
    log = write_logs(tmp_path / "run", steps, start={"flops_per_token": 1e6, "peak_flops": 1e12})
    s = schema.summarise_logs(log)
    assert s["step_time_s"] == pytest.approx(2.0)  # rank 1's log beside rank 0's is read: the slowest rank
    assert schema.summarise_logs(log.parent) == s  # the run's folder works too
    assert s["mfu"] == pytest.approx(s["tokens_per_s"] * 1e6 / (1e12 * 2))
    # a stale log of an earlier, larger run in the same folder is not read
    write_logs(tmp_path / "stale", {0: [step(1, 1.0)]})
    (tmp_path / "stale" / "train_log.jsonl").rename(tmp_path / "run" / "train_log.rank2.jsonl")
    assert schema.summarise_logs(log) == s
    (tmp_path / "run" / "train_log.rank1.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match=r"a 2-rank run, but train_log.rank1.jsonl missing"):
        schema.summarise_logs(log)
    with pytest.raises(FileNotFoundError, match="no step log"):
        schema.summarise_logs(tmp_path / "nowhere")


# ----------------------------------------------------------------------------- one vocabulary

def test_schema_tables_are_consistent():
    assert set(schema.SUMMARY) <= set(schema.COLUMNS)
    for chapter, extras in schema.CHAPTER_COLUMNS.items():
        assert not set(extras) & set(schema.COLUMNS), chapter  # an extra never redefines a schema column
    assert schema.unknown_columns(["tokens_per_s", "toks/s", "GA"], "02") == ["toks/s", "GA"]
    assert schema.unknown_columns(["GA"], "04") == []
    with pytest.raises(KeyError):
        schema.unknown_columns([], "99")


def test_chapter_02_scaling_table_uses_the_schema(tmp_path):
    runs = {k: write_logs(tmp_path / f"ws{k}", {r: [step(n, 2.0 / k, world=k) for n in range(1, W + 3)]
                                                 for r in range(k)}) for k in (1, 2)}
    df = scaling_table.scaling_summary(runs)
    assert schema.unknown_columns(df.columns, "02") == []
    assert list(df.columns) == scaling_table.SCALING_COLUMNS
    assert df.set_index("world_size").loc[2, "scaling_efficiency"] == pytest.approx(1.0)
    stamp = {"device": "test", "model": "tiny", "world_size": "1/2", "commit": "x", "date": "today"}
    saved = scaling_table.save_scaling(df, tmp_path / "figures", stamp)
    assert [p.name for p in saved] == ["scaling_summary.csv", "scaling_summary.md", "scaling_plot.png",
                                       "scaling_comm_compute.png"]
    header = (tmp_path / "figures" / "scaling_summary.csv").read_text().splitlines()[0]
    assert header.split(",") == scaling_table.SCALING_COLUMNS
    with pytest.raises(ValueError, match="1-rank baseline"):
        scaling_table.scaling_summary({2: runs[2]})


def test_chapter_03_metrics_and_report_use_the_schema():
    assert schema.unknown_columns(benchmark_report.METRICS, "03") == []
    assert schema.unknown_columns(benchmark_report.REPORT_COLUMNS, "03") == []
    assert all(key in schema.COLUMNS for key in benchmark_report.PLOTS)


def test_chapter_04_pipeline_table_uses_the_schema(tmp_path):
    steps = {r: [step(n, 1.0, bubble_fraction=0.5 if n <= W else 0.25) for n in range(1, W + 3)] for r in range(2)}
    job = SimpleNamespace(log=write_logs(tmp_path / "pp", steps))
    row = table_row(job, strategy="ds_pipeline", micro=2, ga=4, ckpt=False, dtype="fp32", seq_len=256, data_parallel=1)
    assert schema.unknown_columns(row, "04") == []
    assert row["T_eff"] == 256 * 2 * 4 and row["bubble_fraction"] == 0.25 and row["steps_averaged"] == 2
    assert row["tokens_per_s"] == pytest.approx(1000.0) and row["comm_share"] == pytest.approx(0.1)


def test_ddp_benchmark_prints_the_schema_numbers(tmp_path, monkeypatch, capsys):
    order = []

    def fake_launch(name, k, overrides, timeout_s, runs_dir, echo):
        assert overrides["max_steps"] > W
        order.append(k)
        seconds = {1: 1.9, 2: 1.0}[k] * (1 + 0.1 * (len(order) > 2))  # the same global batch: 2 ranks at 0.95
        steps = [step(n, seconds, world=k) for n in range(1, overrides["max_steps"] + 1)]
        log = write_logs(Path(runs_dir) / name, {r: steps for r in range(k)})
        return SimpleNamespace(log=log, result=SimpleNamespace(elapsed_s=1.0))

    def fake_ceiling(steps, rounds, runs_dir):  # its own launches are tested in test_ddp_lesson
        assert steps == W + 2 and rounds == 3
        return pd.DataFrame({"round": [1, 2, 3], "ceiling": [0.98, 0.95, 1.0]}).set_index("round")

    monkeypatch.setattr(local, "launch_training", fake_launch)
    monkeypatch.setattr(ddp_scaling, "ceiling", fake_ceiling)
    assert ddp_scaling.main(["--steps", str(W + 2), "--rounds", "3"]) == 0
    assert order == [1, 2, 1, 2, 1, 2]  # alternating rounds
    out = capsys.readouterr().out
    assert "tokens_per_s" in out and "scaling_efficiency 0.95" in out and "toks" not in out
    assert "ceiling 0.98 (rounds 0.95-1.00)" in out and "DDP reaches 0.97 of it" in out
    assert "pairings of rounds: 0.86-1.04" in out  # 0.95 / 1.1 and 0.95 x 1.1: the spread is printed
    with pytest.raises(ValueError, match="warm-up"):
        ddp_scaling.measure(steps=W)


def test_the_allreduce_model_charges_latency_per_call_and_bandwidth_per_byte():
    m = scaling_table.allreduce_model(calls=3, nbytes=2**20, world_size=2, latency_s=1e-3, busbw_bytes_per_s=1e9)
    assert m["latency_term_s"] == pytest.approx(3e-3)
    assert m["bandwidth_term_s"] == pytest.approx(2**20 / 1e9)  # 2(k-1)/k = 1 at two ranks
    assert m["predicted_s"] == pytest.approx(3e-3 + 2**20 / 1e9)
