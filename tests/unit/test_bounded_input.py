"""Hostile input (issue 21): bounded YAML at every read site, NaN refused, non-finite losses failing `accept`,
world sizes a local launch cannot hold, checks with nothing to check, escaped reports, infer checking its whole
input first, and Ctrl-C ending every command in one line and exit 130 with its children killed."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pandas as pd
import psutil
import pytest
import yaml

from distlab import markdown, yaml_input
from distlab.cli import UsageError, finite_float
from distlab.config import ConfigError, load_config, parse_override
from distlab.paths import REPO_ROOT
from helpers import alias_bomb

# ----------------------------------------------------------------------------- bounded YAML


def _refused_quickly(call, *args, **kwargs) -> str:
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as info:
        call(*args, **kwargs)
    # refused, not expanded: an expanded bomb takes minutes (a billion nodes), a refusal well under a second
    # (0.4 s for the deepest case on a 2-core VM); the bound is far from both, so a busy machine cannot fail it
    assert time.perf_counter() - t0 < 5.0, "a bomb must be refused before it is expanded"
    text = str(info.value)
    assert "\n" not in text and len(text) < 300, text  # one short line, not the expanded value
    return text


def test_an_alias_bomb_is_refused_before_it_is_expanded_naming_the_file_and_line(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    assert yaml.safe_load(alias_bomb())  # PyYAML itself accepts it (the expansion happens later, in the caller)
    text = _refused_quickly(load_config, bomb)
    assert text.startswith(f"{bomb}:6: more than {yaml_input.MAX_NODES} values once aliases are expanded"), text


def test_a_bomb_in_a_set_value_or_a_variant_is_refused_not_read_as_a_string():
    value = "[" + ", ".join(["&a [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]"] + ["*a"] * 9) + "]"  # fine: 100 values
    assert len(parse_override(f"lora_targets={value}")[1]) == 10
    nested = "".join(f"- &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]\n" for i in range(1, 7))
    with pytest.raises(ConfigError, match="--set lora_targets:.*more than 100000 values"):
        parse_override("lora_targets=" + "- &a0 [x, x, x, x, x, x, x, x, x, x]\n" + nested)


@pytest.mark.parametrize("text, words", [
    ("a: " + "[" * 10_000 + "]" * 10_000, "nested more than 64 levels deep"),
    ("a: &a [*a]", "a recursive alias"),
    # 40 levels of text, each alias adding 40 more: deep only once expanded
    ("a: &a " + "[" * 40 + "1" + "]" * 40 + "\nb: " + "[" * 30 + "*a" + "]" * 30,
     "nested more than 64 levels deep once aliases are expanded"),
])
def test_deep_or_recursive_yaml_is_one_line_not_a_recursion_error(tmp_path, text, words):
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    assert words in _refused_quickly(load_config, path)


def test_depth_and_size_within_the_bounds_still_load():
    deep = "[" * 60 + "1" + "]" * 60
    value = yaml_input.load(deep, "t")
    for _ in range(59):
        value = value[0]
    assert value == [1]
    assert yaml_input.load("---\na: 1\n---\nb: [1, 2]\n", "t", all_documents=True) == [{"a": 1}, {"b": [1, 2]}]


@pytest.mark.parametrize("content, words", [
    (b"max_steps: 3\nlr: 1\n\x00\x00\x01", "binary.yaml:3: a binary file (NUL byte), not text"),
    (b"max_steps: 3\n\xff\xfe lr", "binary.yaml:2: not UTF-8 text (byte 0xff"),
    (b"max_steps: 3\n\x07", "binary.yaml:2: not text: control character U+0007"),
])
def test_a_binary_config_is_named_with_its_line(tmp_path, content, words):
    path = tmp_path / "binary.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert words in str(info.value)


def test_a_binary_or_bomb_manifest_is_a_problem_naming_the_file(tmp_path):
    from distlab.launch.kubernetes.checks import load_docs

    binary = tmp_path / "job.yaml"
    binary.write_bytes(b"apiVersion: batch/v1\nkind: Job\n\x00\xff")
    docs, (problem,) = load_docs(binary)
    assert docs == [] and f"{binary}:3: a binary file" in str(problem)
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("apiVersion: v1\nkind: ConfigMap\n---\n" + alias_bomb())
    docs, (problem,) = load_docs(bomb)
    assert "more than 100000 values" in str(problem)


@pytest.mark.slow  # it imports distlab.train (torch, transformers): over 5 s when it is the first test to do so
def test_every_other_yaml_reader_is_bounded(tmp_path):
    from distlab.launch.network import NetworkPresetError, presets
    from distlab.publish.datagen import TableError, load_tables
    from distlab.publish.profiles import load_profiles
    from distlab.train import variant_configs

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    _refused_quickly(load_profiles, bomb)
    _refused_quickly(presets, bomb)
    with pytest.raises(ValueError, match="--variant 1:1: nested more than 64"):
        variant_configs(REPO_ROOT / "lib/distlab/configs/tiny_lora.yaml", {}, ["[" * 100 + "]" * 100])
    tables = tmp_path / "tables"
    tables.mkdir()
    (tables / "shared.yaml").write_text(alias_bomb())
    with pytest.raises(TableError, match=r"shared.yaml:6: more than 100000 values"):
        load_tables(tables)
    assert issubclass(NetworkPresetError, ValueError)


# ----------------------------------------------------------------------------- NaN and infinities

@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-inf", "Infinity", "1e999"])
def test_finite_float_refuses_nan_and_infinities(text):
    with pytest.raises(argparse.ArgumentTypeError, match="is not a finite number"):
        finite_float(text)
    with pytest.raises(ValueError):  # also the ValueError a command parsing a list by hand catches
        finite_float(text)
    assert finite_float("0.25") == 0.25 and finite_float("-3") == -3.0


def test_no_float_option_is_parsed_by_bare_float():
    """Every float CLI option goes through finite_float: a bare `type=float` accepts nan and inf."""
    offenders = [str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "lib" / "distlab").rglob("*.py")
                 if re.search(r"(?<![a-z_])type=float\b", p.read_text())]  # not `dtype=float`
    assert offenders == []


# ----------------------------------------------------------------------------- accept: a non-finite loss

def _run_folder(tmp_path, losses, final_loss):
    run = tmp_path / "run"
    run.mkdir()
    records = [{"event": "start", "config": {"logging_steps": 1}}]
    records += [{"event": "step", "step": i, "loss": loss, "world_size": 1, "step_time_s": 0.1,
                 "tokens_per_s": 100.0} for i, loss in enumerate(losses, 1)]
    records.append({"event": "end", "final_loss": final_loss})
    (run / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))  # NaN as json writes it
    return run


def test_accept_fails_a_run_whose_loss_is_not_finite_naming_the_step(tmp_path):
    from distlab.commands.accept import check_log_fields

    ok, detail = check_log_fields(_run_folder(tmp_path, [2.0, 1.5, 1.2], 1.2), None)
    assert ok, detail
    bad = tmp_path / "bad"
    bad.mkdir()
    ok, detail = check_log_fields(_run_folder(bad, [2.0, math.nan, math.inf], math.nan), None)
    assert not ok
    assert "step 2: loss=nan is not finite" in detail and "step 3: loss=inf is not finite" in detail
    assert "end: final_loss=nan is not finite" in detail


# ----------------------------------------------------------------------------- matrix

def test_matrix_refuses_more_ranks_than_the_local_target_holds_before_launching(tmp_path):
    from distlab.commands import matrix
    from distlab.launch.local import CPU_RANKS_PER_CORE, max_local_ranks
    from distlab.machine import usable_cores

    most, why = max_local_ranks("cpu")
    assert most == usable_cores() * CPU_RANKS_PER_CORE and "usable CPU core" in why
    with pytest.raises(UsageError, match=f"--world-sizes {most + 1}: a local launch holds at most {most} ranks"):
        matrix.main(["--world-sizes", f"1,{most + 1}", "--runs-dir", str(tmp_path / "m"), "--set", "device=cpu"])
    assert not (tmp_path / "m").exists()  # nothing launched, nothing written


def test_matrix_scripts_go_under_its_runs_dir():
    import inspect

    from distlab.commands import matrix
    from distlab.launch import local

    assert "scripts_dir" in inspect.signature(local.launch_training).parameters
    assert 'scripts_dir=Path(args.runs_dir) / "launch"' in inspect.getsource(matrix.main)


# ----------------------------------------------------------------------------- reports escape what they copy

def test_markdown_cells_escape_pipes_newlines_and_html():
    assert markdown.cell("a|b\nc\r\n<script>&x") == "a\\|b c &lt;script&gt;&amp;x"
    table = markdown.table(pd.DataFrame({"run<1>": ["x|y\nz"], "n": [1.5]}))
    rows = table.splitlines()
    assert len(rows) == 3 and rows[0].count("|") == 3 and "run&lt;1&gt;" in rows[0]
    assert "x\\|y z" in rows[2]


def test_benchmark_report_escapes_run_names_from_logs(tmp_path):
    from distlab.provenance import stamp
    from distlab.results.benchmark_report import write_report

    df = pd.DataFrame([{"run": "evil|run\n<img src=x>", "mode": "lora", "strategy": "ddp|x", "world_size": 2,
                        "tokens_per_s": 1.5, "step_time_s": 0.1, "scaling_efficiency": 0.9, "comm_share": 0.1,
                        "peak_mem_bytes": 100, "mean_loss": 1.0, "peak_mem_bytes_per_rank": "1;2"}])
    text = write_report(df, tmp_path, stamp("m", 2), title="T<b>").read_text()
    assert "<img" not in text and "<b>" not in text and "evil\\|run &lt;img src=x&gt;" in text
    table_rows = [ln for ln in text.splitlines() if ln.startswith("|")]
    assert len({ln.count("|") - ln.count("\\|") for ln in table_rows if "peak_mem_bytes_per_rank" in ln
                or "evil" in ln}) == 1  # the escaped run name adds no column


# ----------------------------------------------------------------------------- infer checks its input first

def test_infer_checks_every_fact_before_loading_anything_and_writes_nothing(tmp_path, monkeypatch):
    from distlab.commands import infer
    from distlab.data import DataError

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # restored after the test: infer sets it
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p1", "prompt": "Hi", "facts": ["Okta"]}) + "\n"
                       + json.dumps({"id": "p2", "prompt": "Ho", "facts": [""]}) + "\n")
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"prompts.jsonl:2: field 'facts'"):
        infer.main(["--prompts", str(prompts), "--out", str(out)])
    assert not out.exists() and not (tmp_path / "out.partial").exists()  # nothing generated, nothing written
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # no --model hub id: offline


def test_infer_refuses_an_adapter_whose_hub_base_is_not_cached(tmp_path, monkeypatch):
    from distlab.commands import infer

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p1", "prompt": "Hi"}) + "\n")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "nobody-distlab/none"}))
    with pytest.raises(UsageError, match="'nobody-distlab/none' is a hub model that is not in the local cache.*"
                                         "pass --model nobody-distlab/none"):
        infer.main(["--prompts", str(prompts), "--adapter", str(adapter), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- Ctrl-C

def test_sigint_ends_a_command_in_one_line_exit_130_and_kills_its_children(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "distlab", "monitor", "--out", str(tmp_path), "--quiet", "--",
                             "sleep", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO_ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        sleeps: list[psutil.Process] = []
        while not sleeps and time.monotonic() < deadline:
            sleeps = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name() == "sleep"]
            time.sleep(0.1)
        assert sleeps, "the monitored command never started"
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group gets it
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert proc.returncode == 130, err
    assert lines == ["python -m distlab monitor: interrupted"], err
    time.sleep(0.5)
    assert not [p for p in sleeps if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_a_cuda_device_without_cuda_is_a_config_error_not_an_assertion():
    import torch

    from distlab.device import DeviceError, choose_device

    if torch.cuda.is_available():
        with pytest.raises(DeviceError, match="this machine has"):
            choose_device(f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(DeviceError, match="device=cuda: no CUDA"):
            choose_device("cuda")
