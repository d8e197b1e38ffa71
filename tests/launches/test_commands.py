"""The enterprise assistant's commands on the run folders of a real launch: distlab.commands.matrix launches a
1-rank and a 2-rank DDP run with the generated torchrun scripts, then scaling, report, infer, accept and monitor
run on them."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pandas as pd
import psutil
import pytest

from distlab.paths import REPO_ROOT
from distlab.results.benchmark_report import PLOTS

COMMANDS = ["infer", "scaling", "report", "matrix", "accept", "monitor"]
PROMPTS = REPO_ROOT / "data" / "prompts" / "demo_prompts.jsonl"


def cli(command: str, *args, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distlab", command, *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO_ROOT)


def _left_running(marker: str) -> list[str]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if marker in cmd:
            found.append(cmd[:120])
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 1-rank and a 2-rank run folder from one matrix launch (4 steps, no eval: seconds, not minutes; the
    generous limit covers a first-use build of the base model, which waits on its lock)."""
    root = tmp_path_factory.mktemp("matrix")
    proc = cli("matrix", "--strategies", "ddp", "--world-sizes", "1,2", "--steps", "4", "--runs-dir", root,
               "--set", "logging_steps=1", "--set", "eval_at_start=false", "--set", "eval_at_end=false",
               "--set", "micro_batch_size=2", "--set", "seq_len=128", "--quiet", "--timeout-s", "900", timeout=1900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert _left_running(str(root)) == []
    return root


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_help(name, capsys):
    module = importlib.import_module(f"distlab.commands.{name}")  # in process: an interpreter start each is slow
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0 and f"python -m distlab {name}" in capsys.readouterr().out


def test_matrix_writes_what_the_other_commands_read(runs):
    for name, world in (("ddp_ws1", 1), ("ddp_ws2", 2)):
        run = runs / name
        for f in ("train_log.jsonl", "console.log", "monitor.csv", "monitor.png", "model/adapter_config.json"):
            assert (run / f).exists(), f"{run / f} missing"
        assert (run / "train_log.rank1.jsonl").exists() == (world == 2)


def test_scaling_summary_from_step_logs(runs, tmp_path):
    proc = cli("scaling", runs / "ddp_ws1", runs / "ddp_ws2", "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    df = pd.read_csv(tmp_path / "scaling_summary.csv")
    assert list(df["world_size"]) == [1, 2] and df.loc[0, "speedup"] == 1.0
    assert (df["tokens_per_s"] > 0).all()
    assert (tmp_path / "scaling_summary.md").exists() and (tmp_path / "scaling_plot.png").exists()
    print(proc.stdout)


def test_report_from_log_markers(runs, tmp_path):
    proc = cli("report", runs / "ddp_ws1", runs / "ddp_ws2", "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    df = pd.read_csv(tmp_path / "strategy_metrics.csv")
    assert sorted(df["run"]) == ["ddp_ws1", "ddp_ws2"]
    assert "ddp_ws2" in (tmp_path / "BENCHMARK_REPORT.md").read_text()
    assert all((tmp_path / name).exists() for name in PLOTS.values())
    print(proc.stdout)


@pytest.fixture(scope="module")
def answers(runs, tmp_path_factory):
    out = tmp_path_factory.mktemp("infer")
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(PROMPTS.read_text().splitlines(keepends=True)[:2]))
    proc = cli("infer", "--adapter", runs / "ddp_ws2" / "model", "--prompts", prompts, "--out", out,
               "--max-new-tokens", "16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    return out


def test_infer_before_after_with_an_adapter(answers):
    before = [json.loads(line) for line in (answers / "before.jsonl").read_text().splitlines()]
    after = [json.loads(line) for line in (answers / "after.jsonl").read_text().splitlines()]
    assert len(before) == len(after) == 2
    assert before[0]["config"] == {"max_new_tokens": 16, "greedy": False, "seed": 42, "temperature": 0.2,
                                   "top_p": 0.9}
    summary = json.loads((answers / "summary.json").read_text())
    assert summary["before"]["asked"] > 0 and summary["after"]["accuracy"] is not None
    assert "| id | prompt | before | after |" in (answers / "before_after.md").read_text()


def test_accept_passes_on_a_good_run(runs):
    proc = cli("accept", runs / "ddp_ws2", "--every", "1")
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS  log fields" in proc.stdout and "PASS  activity" in proc.stdout


def test_accept_fails_naming_the_check_on_a_log_without_fields(runs, tmp_path):
    bad = tmp_path / "no_tokens"
    bad.mkdir()
    records = [json.loads(line) for line in (runs / "ddp_ws1" / "train_log.jsonl").read_text().splitlines()]
    (bad / "train_log.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "tokens_per_s"})
                                                 + "\n" for r in records))
    (bad / "monitor.csv").write_text((runs / "ddp_ws1" / "monitor.csv").read_text())
    proc = cli("accept", bad, "--every", "1")
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 1
    assert "FAIL  log fields  no_tokens:" in proc.stdout and "tokens_per_s=None" in proc.stdout
    assert "check(s) failed: log fields (no_tokens)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_accept_judges_answers_and_throughput(runs, answers):
    proc = cli("accept", runs / "ddp_ws1", runs / "ddp_ws2", "--answers", answers)
    print(proc.stdout, proc.stderr)
    lines = {ln.split()[1]: ln for ln in proc.stdout.splitlines() if ln[:4] in ("PASS", "FAIL", "SKIP")}
    assert set(lines) == {"log", "activity", "answers", "throughput"}
    assert lines["throughput"].startswith(("PASS", "FAIL"))  # two world sizes: judged (its outcome is timing)
    assert proc.returncode == (1 if "FAIL" in proc.stdout else 0)


def test_monitor_wraps_a_command(tmp_path):
    busy = "import time; t = time.time()\nwhile time.time() - t < 1.5: pass"
    proc = cli("monitor", "--out", tmp_path, "--interval-s", "0.2", "--quiet", "--", sys.executable, "-c", busy)
    assert proc.returncode == 0, proc.stderr
    df = pd.read_csv(tmp_path / "monitor.csv")
    assert len(df) >= 3 and df["util_pct"].max() > 0 and df["mem_mib"].max() > 0
    assert (tmp_path / "monitor.png").exists()
    failing = cli("monitor", "--out", tmp_path / "f", "--quiet", "--", sys.executable, "-c", "raise SystemExit(3)")
    assert failing.returncode == 3
