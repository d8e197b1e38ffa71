"""The log-marker collector: results come back from noisy, interleaved, prefixed logs, and every
broken case (truncated JSON, START without END, END without START, duplicates, missing ranks) is an
error naming the log and line, never a silently dropped rank."""

from __future__ import annotations

import io
import json
import math
from types import SimpleNamespace

import pytest

from distlab.metrics import StepLog
from distlab.results import benchmark_report, extract, recorder, schema
from distlab.results.extract import ResultLogError, extract_results
from distlab.results.recorder import emit_result
from distlab.results.schema import MemoryBreakdown

W = schema.WARMUP_STEPS
STEPS = list(range(1, W + 2))  # the warm-up steps, then one steady step


def record(rank: int, world: int = 2, strategy: str = "fsdp", mode: str = "lora", run: str = "r", tps: float = 100.0,
           step_time: float = 0.5, comm: float | None = 0.1) -> dict:
    """A rank's result record; its warm-up steps take twice as long (they must not count)."""
    n = len(STEPS)
    return {"schema": recorder.SCHEMA, "run": run, "strategy": strategy, "mode": mode, "rank": rank,
            "world_size": world,
            "global_batch_size": 8, "steps": STEPS, "loss": [3.0 - 0.5 * i for i in range(n)],
            "tokens": [tps * step_time] * n, "step_time_s": [step_time * 2] * W + [step_time],
            "comm_time_s": [comm] * n, "comm_bytes": [1000] * n, "peak_mem_bytes": (500 + rank) * 2**20,
            "final_loss": 3.0 - 0.5 * (n - 1), "warmup_steps": W}


def block(rank: int, rec: dict | None = None, prefix: str = "") -> list[str]:
    buf = io.StringIO()
    emit_result(rec or record(rank), stream=buf)
    return [prefix + line for line in buf.getvalue().splitlines()]


NOISE = ["[W socket.cpp:123] warning: some noise", "Traceback-looking noise {\"not\": json", "",
         "=== not a marker ===", "loss 2.3 tok/s 4000"]


def test_emit_then_extract_round_trip():
    text = "\n".join(NOISE + block(0) + NOISE + block(1) + NOISE)
    results = extract_results(text, expected_ranks=2)
    assert list(results) == [0, 1] and results[1] == json.loads(json.dumps(record(1)))


def test_interleaved_torchrun_console_with_timestamps():
    """torchrun --tee prefixes lines with [defaultN]:, and two ranks' lines interleave; kubectl logs
    --timestamps adds a timestamp in front of every line."""
    a, b = block(0, prefix="[default0]:"), block(1, prefix="[default1]:")
    lines = [a[0], b[0], "[default1]:noise from rank 1", a[1], b[1], "[default0]:more noise", b[2], a[2]]
    stamped = [f"2026-01-06T12:00:0{i % 10}.123456789Z {line}" for i, line in enumerate(NOISE + lines)]
    for text in ("\n".join(lines), "\n".join(stamped)):
        assert sorted(extract_results(text, expected_ranks=2)) == [0, 1]


def test_per_rank_files(tmp_path):
    paths = []
    for rank in range(2):
        p = tmp_path / f"{rank}" / "stdout.log"
        p.parent.mkdir()
        p.write_text("\n".join(NOISE + block(rank) + NOISE) + "\n")
        paths.append(p)
    assert sorted(extract_results(paths, expected_ranks=[0, 1])) == [0, 1]
    with pytest.raises(ResultLogError, match="rank 1 reported twice"):
        extract_results([paths[0], paths[1], paths[1]])


def test_truncated_json_names_the_log_and_lines(tmp_path):
    lines = block(0)
    lines[1] = lines[1][: len(lines[1]) // 2]  # the pod was killed mid-write, then the END was printed
    log = tmp_path / "console.log"
    log.write_text("\n".join(NOISE + lines + block(1)) + "\n")
    with pytest.raises(ResultLogError) as info:
        extract_results(log, expected_ranks=2)
    msg = str(info.value)
    start = len(NOISE) + 1
    assert f"{log}:{start}-{start + 2}" in msg and "rank 0" in msg and "not valid JSON" in msg


def test_start_without_end_at_end_of_log():
    lines = NOISE + block(0) + block(1)[:2]  # the log was cut after rank 1's JSON
    with pytest.raises(ResultLogError, match=r"<log text>:%d: result of rank 1 has a START marker but the log ends"
                       % (len(NOISE) + 4)):
        extract_results("\n".join(lines))


def test_start_without_end_before_next_start():
    lines = block(0)[:2] + block(1)
    with pytest.raises(ResultLogError, match="rank 0 has a START marker but no END before the next START"):
        extract_results("\n".join(lines))


def test_end_without_start_and_mismatched_markers():
    with pytest.raises(ResultLogError, match=r":2: END marker of rank 0 without a START"):
        extract_results("\n".join(["noise"] + block(0)[2:]))
    lines = block(0)
    lines[2] = lines[2].replace("rank=0", "rank=1")
    with pytest.raises(ResultLogError, match="START of rank 0 closed by END of rank 1"):
        extract_results("\n".join(lines))


def test_record_rank_must_agree_with_markers():
    buf = io.StringIO()
    emit_result(record(0), rank=1, stream=buf)
    with pytest.raises(ResultLogError, match="markers say rank 1, the record says rank 0"):
        extract_results(buf.getvalue())


def test_duplicate_and_missing_and_unexpected_ranks():
    with pytest.raises(ResultLogError, match="rank 0 reported twice"):
        extract_results("\n".join(block(0) + block(0)))
    with pytest.raises(ResultLogError, match=r"missing rank\(s\) 1, 3 \(expected 0, 1, 2, 3; found 0, 2\)"):
        extract_results("\n".join(block(0) + NOISE + block(2)), expected_ranks=4)
    with pytest.raises(ResultLogError, match=r"unexpected rank\(s\) 2"):
        extract_results("\n".join(block(0) + block(1) + block(2)), expected_ranks=2)
    with pytest.raises(ResultLogError, match="found none"):
        extract_results("\n".join(NOISE), expected_ranks=1)


def test_collect_run_prefers_console_then_rank_logs(tmp_path):
    run = tmp_path / "run"
    ranks = run / "torchrun" / "abc_1" / "attempt_0"
    for rank in range(2):
        (ranks / str(rank)).mkdir(parents=True)
        (ranks / str(rank) / "stdout.log").write_text("\n".join(block(rank)) + "\n")
    assert sorted(extract.collect_run(run, expected_ranks=2)) == [0, 1]  # no console.log: rank logs
    (run / "console.log").write_text("\n".join(block(0, prefix="[default0]:")) + "\n")
    with pytest.raises(ResultLogError, match="missing rank"):
        extract.collect_run(run, expected_ranks=2)  # the console wins, and it lacks rank 1
    assert sorted(extract.collect_run(run, expected_ranks=2, source="ranks")) == [0, 1]
    with pytest.raises(ResultLogError, match="no console.log and no per-rank logs"):
        extract.collect_run(tmp_path / "empty")


def test_aggregate_plots_and_report(tmp_path):
    runs = [{0: record(0, world=1, strategy="single", run="base", tps=100)},
            {r: record(r, strategy="ddp", run="ddp", tps=180) for r in range(2)},
            {r: record(r, strategy="fsdp", run="fsdp", tps=150, comm=None) for r in range(2)}]
    df = benchmark_report.aggregate(runs)
    assert list(df.columns) == benchmark_report.METRICS
    row = df.set_index("run").loc["ddp"]
    assert row["scaling_efficiency"] == pytest.approx(0.9) and row["speedup"] == pytest.approx(1.8)
    assert row["tokens_per_s"] == pytest.approx(180.0)  # steady state: the slow warm-up steps are left out
    assert row["steps_averaged"] == 1 and row["step_time_s"] == pytest.approx(0.5)
    assert row["peak_mem_bytes"] == 501 * 2**20
    assert row["peak_mem_bytes_per_rank"] == f"{500 * 2**20};{501 * 2**20}" and row["comm_share"] == pytest.approx(0.2)
    assert math.isnan(df.set_index("run").loc["fsdp", "comm_share"])
    stamp = {"device": "test", "model": "tiny", "world_size": "1/2", "commit": "x", "date": "today"}
    csv = benchmark_report.save_metrics(df, tmp_path, stamp)
    plots = benchmark_report.save_plots(df, tmp_path, stamp)
    report = benchmark_report.write_report(df, tmp_path, stamp, sections={"Extra": df[["run", "mean_loss"]]})
    assert csv.name == "strategy_metrics.csv" and [p.name for p in plots] == list(benchmark_report.PLOTS.values())
    assert csv.read_text().splitlines()[0].split(",") == benchmark_report.METRICS
    assert all(p.exists() and p.with_name(p.name + ".provenance.json").exists() for p in plots + [csv, report])
    text = report.read_text()
    assert "#### LoRA: metrics" in text and "#### Extra" in text and "_Provenance: test |" in text
    assert f"- comm_share: {schema.COLUMNS['comm_share']}" in text  # definitions come from the schema
    assert not any(line.startswith(("# ", "## ", "### ")) for line in text.splitlines())  # nests in the book
    later = STEPS[1:]  # after a resume rank 1 logs only the new steps
    resumed = {0: record(0), 1: {**record(1), "steps": later, "loss": record(1)["loss"][1:],
                                 "tokens": [50.0] * len(later), "step_time_s": [0.6] * len(later),
                                 "comm_time_s": [0.1] * len(later), "comm_bytes": [1000] * len(later)}}
    row = benchmark_report.run_metrics(resumed)
    assert row["steps_averaged"] == 1 and row["step_time_s"] == pytest.approx(0.6)  # the slower rank 1
    with pytest.raises(FileNotFoundError, match="no such log file"):
        extract_results(tmp_path / "missing.log")
    with pytest.raises(ValueError, match="another run"):
        benchmark_report.run_metrics({0: record(0), 1: record(1, strategy="ddp")})
    with pytest.raises(ValueError, match="expected 0..1"):
        benchmark_report.run_metrics({0: record(0)})
    with pytest.raises(ValueError, match=f"run r: no step after the {W} warm-up steps"):
        short = {r: {**record(r), "steps": STEPS[:W], "loss": [2.0] * W, "tokens": [1.0] * W,
                     "step_time_s": [1.0] * W, "comm_time_s": [0.1] * W, "comm_bytes": [1] * W} for r in range(2)}
        benchmark_report.run_metrics(short)


def fake_run(tmp_path, world: int = 2, steps: int = W + 2):
    """What the training loop leaves behind: every rank's step log, and cfg/strategy as rank_result reads them."""
    out = tmp_path / "03_ddp_lora_ws2"
    for rank in range(world):
        log = StepLog(out, rank, all_ranks=True)
        for n in range(1, steps + 1):
            seconds = (2.0 if n <= W else 1.0) + 0.5 * rank  # rank 1 is the slower one
            log.write("step", step=n, world_size=world, loss=3.0 - 0.1 * n, step_time_s=seconds, tokens=800,
                      tokens_per_s=800 / seconds, peak_mem_bytes=(100 + rank) * 2**20, comm_time_s=0.1 * (rank + 1),
                      comm_bytes=4096)
    cfg = SimpleNamespace(output_dir=str(out), lora=True, lora_r=16, vocab_parallel=False, model=None, device="cpu",
                          dtype="fp32", micro_batch_size=2, seq_len=256, seed=0, micro_steps=lambda dp: 8 // (2 * dp))
    strategies = [SimpleNamespace(name="ddp", rank=r, world_size=world, data_parallel_size=world) for r in range(world)]
    return out, cfg, strategies


def test_rank_results_summarise_like_the_step_logs(tmp_path):
    """The collector's row and chapter 02's summary of the same run's step logs are the same numbers."""
    out, cfg, strategies = fake_run(tmp_path)
    logs = [out / "train_log.jsonl", out / "train_log.rank1.jsonl"]
    state = MemoryBreakdown(weights=10, adapter_weights=2, gradients=3, optimizer_state=4, activations=99, buffers=5)
    results = {s.rank: recorder.rank_result(cfg, s, logs[s.rank], {"final_loss": 2.6, "peak_mem_bytes": 0},
                                           measured_state=state if s.rank == 0 else None) for s in strategies}
    assert results[0]["state_bytes"] == {"weights": 10, "adapter_weights": 2, "gradients": 3, "optimizer_state": 4,
                                         "buffers": 5}  # activations are not state a rank owns
    assert "state_bytes" not in results[1]
    assert results[1]["rank_summary"]["step_time_s"] == pytest.approx(1.5)
    assert results[0]["rank_summary"]["comm_share"] == pytest.approx(0.1)
    row = benchmark_report.run_metrics(results)
    from_logs = schema.summarise_logs(logs[0])
    for key in schema.SUMMARY:
        assert row[key] == pytest.approx(from_logs[key]) if isinstance(row[key], float) else row[key] == from_logs[key]
    assert row["step_time_s"] == pytest.approx(1.5) and row["comm_share"] == pytest.approx(0.15 / 1.5)


def test_emit_rank_result_prints_only_for_launched_ranks(tmp_path, monkeypatch):
    out, cfg, strategies = fake_run(tmp_path, world=1, steps=W)  # no steady step: the rank's own numbers are NaN
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("DISTLAB_EMIT_RESULT", raising=False)
    buf = io.StringIO()
    assert recorder.emit_rank_result(cfg, strategies[0], out / "train_log.jsonl", {}, stream=buf) is None
    assert buf.getvalue() == ""
    monkeypatch.setenv("RANK", "0")
    rec = recorder.emit_rank_result(cfg, strategies[0], out / "train_log.jsonl", {}, stream=buf)
    assert math.isnan(rec["rank_summary"]["tokens_per_s"]) and rec["warmup_steps"] == W
    back = extract_results(buf.getvalue(), expected_ranks=1)[0]
    assert back["steps"] == list(range(1, W + 1)) and math.isnan(back["rank_summary"]["step_time_s"])


def test_results_and_step_logs_are_strict_json_and_nan_reads_back(tmp_path):
    def strict(text):  # what jq or a browser accepts: no bare NaN or Infinity
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in {text[:80]!r}"))

    buf = io.StringIO()
    emit_result({"rank": 0, "loss": float("nan"), "rank_summary": {"step_time_s": float("inf"), "steps": 3}},
                stream=buf)
    strict(buf.getvalue().splitlines()[1])
    back = extract_results(buf.getvalue(), expected_ranks=1)[0]
    assert math.isnan(back["rank_summary"]["step_time_s"]) and back["rank_summary"]["steps"] == 3
    log = StepLog(tmp_path)
    log.write("step", step=1, loss=float("nan"))
    assert strict(log.path.read_text())["loss"] is None
