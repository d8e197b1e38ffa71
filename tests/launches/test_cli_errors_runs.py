"""Bad input to any command (`python -m distlab <command>`, `python -m distlab.<module>`): one line
`<prog>: error: ...` on stderr, exit 2, no traceback; `--debug` shows the traceback. Every case runs the real
command's `__main__` in a process of its own (its own stdout, stderr and exit status): forked from an interpreter
that imported torch and transformers once, so forty cases do not pay forty interpreter starts. `--debug` runs
one as a plain `python -m` subprocess. The config's checks in process, and every entry point's wrapper:
tests/unit/test_cli_errors.py."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from distlab.paths import REPO_ROOT
from helpers import alias_bomb

TINY = "lib/distlab/configs/tiny_lora.yaml"


def _files(root):
    """Bad inputs on disk: {name: path}."""
    (root / "bad.yaml").write_text("max_steps: 10\nlr: fast\n")
    (root / "broken.yaml").write_text("max_steps: [1\n")
    (root / "empty_run").mkdir()
    (root / "not_adapter").mkdir()
    (root / "prompts.jsonl").write_text(json.dumps({"id": "p1", "prompt": "Hi", "facts": ["Okta"]}) + "\n")
    (root / "no_markers.log").write_text("hello\nworld\n")
    (root / "truncated.log").write_text("=== DISTLAB_RESULT_START rank=0 ===\n{\"rank\": 0\n")
    (root / "answers").mkdir()
    (root / "bomb.yaml").write_text(alias_bomb())
    (root / "deep.yaml").write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    (root / "binary.yaml").write_bytes(b"max_steps: 3\n\x00\x01\xff")
    (root / "bad_facts.jsonl").write_text(json.dumps({"id": "p1", "prompt": "Hi", "facts": "Okta"}) + "\n")
    (root / "hub_adapter").mkdir()
    (root / "hub_adapter" / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": "nobody-distlab/never-cached"}))
    return root


# (command, args, text the one line must contain): "distlab.x" is `python -m distlab.x`, "distlab x" the user's
# command `python -m distlab x`; {d} is a folder of bad inputs
CASES = [
    ("distlab.train", ["--config", TINY, "--set", "max_steps=abc"], "--set: max_steps='abc' is not accepted"),
    ("distlab.train", ["--config", TINY, "--set", "seq_len=0"], "seq_len=0 is not accepted: expected an integer >= 1"),
    ("distlab.train", ["--config", TINY, "--set", "lr=-1"], "lr=-1 is not accepted: expected a number > 0"),
    ("distlab.train", ["--config", TINY, "--set", "model=/no/such/model"], "no such folder /no/such/model"),
    ("distlab.train", ["--config", "{d}/bad.yaml"], "bad.yaml:2: lr='fast' is not accepted"),
    ("distlab.train", ["--config", "{d}/missing.yaml"], "missing.yaml: cannot read"),
    ("distlab.train", [], "the following arguments are required: --config"),
    ("distlab infer", ["--prompts", "{d}/missing.jsonl"], "--prompts"),
    ("distlab infer", ["--prompts", "{d}/prompts.jsonl", "--adapter", "{d}/nope"], "no such folder"),
    ("distlab infer", ["--prompts", "{d}/prompts.jsonl", "--adapter", "{d}/not_adapter"], "no adapter_config.json"),
    ("distlab infer", ["--prompts", "{d}/prompts.jsonl", "--model", "/no/model"], "--model: model='/no/model'"),
    ("distlab infer", ["--prompts", "{d}/prompts.jsonl", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    ("distlab scaling", ["{d}/nope"], "no such run folder"),
    ("distlab scaling", ["{d}/empty_run"], "no step log"),
    ("distlab scaling", [], "the following arguments are required: RUN"),
    ("distlab report", ["{d}/nope"], "no such run folder or log file"),
    ("distlab report", ["{d}/no_markers.log"], "no DISTLAB_RESULT markers"),
    ("distlab report", ["{d}/truncated.log"], "truncated"),
    ("distlab report", ["{d}/empty_run"], "no console.log"),
    ("distlab matrix", ["--strategies", "dpp"], "unknown strategy 'dpp'"),
    ("distlab matrix", ["--world-sizes", "one"], "expected integers"),
    ("distlab matrix", ["--strategies", "single", "--world-sizes", "2"], "single runs on 1 rank only"),
    ("distlab matrix", ["--set", "lr=-1"], "--set: lr=-1 is not accepted"),
    ("distlab accept", ["{d}/nope"], "no such run folder"),
    ("distlab accept", ["{d}/empty_run", "--every", "0"], "--every 0"),
    ("distlab accept", ["{d}/empty_run", "--answers", "{d}/answers"], "no summary.json"),
    ("distlab monitor", [], "no command to monitor"),
    ("distlab monitor", ["--", "/no/such/program"], "No such file or directory"),
    ("distlab monitor", ["--interval-s", "0", "--", "true"], "must be > 0"),
    # issue 21: bounded YAML, NaN, user errors that were tracebacks, silent wrong results
    ("distlab.train", ["--config", "{d}/bomb.yaml"], "bomb.yaml:6: more than 100000 values once aliases"),
    ("distlab.train", ["--config", "{d}/deep.yaml"], "deep.yaml:1: nested more than 64 levels deep"),
    ("distlab.train", ["--config", "{d}/binary.yaml"], "binary.yaml:2: a binary file (NUL byte)"),
    ("distlab.train", ["--config", TINY, "--set", "lr=nan"], "lr='nan' is not accepted: expected a number > 0"),
    ("distlab.train", ["--config", TINY, "--set", "strategy=ddp", "--set", "output_dir={d}/ddp"],
     "strategy 'ddp' needs a launcher: run it under torchrun"),
    ("distlab.publish.regenerate", ["--profile", "nosuch"], "unknown profile 'nosuch'"),
    ("distlab monitor", ["--interval-s", "nan", "--", "true"], "--interval-s: 'nan' is not a finite number"),
    ("distlab monitor", ["--timeout-s", "inf", "--", "true"], "--timeout-s: 'inf' is not a finite number"),
    ("distlab accept", ["{d}/empty_run", "--min-changed", "nan"], "--min-changed: 'nan' is not a finite"),
    ("distlab infer", ["--prompts", "{d}/prompts.jsonl", "--temperature", "nan"], "'nan' is not a finite number"),
    ("distlab infer", ["--prompts", "{d}/bad_facts.jsonl", "--out", "{d}/infer_out"],
     "bad_facts.jsonl:1: field 'facts'"),
    ("distlab infer", ["--prompts", "{d}/prompts.jsonl", "--adapter", "{d}/hub_adapter"],
     "is a hub model that is not in the local cache"),
    ("distlab matrix", ["--world-sizes", "1000", "--runs-dir", "{d}/matrix"], "a local launch holds at most"),
    # the one entry point of the user's commands: its own errors, and argparse's hint naming the command's --help
    ("distlab", ["frobnicate"], "unknown command 'frobnicate'; one of "),
    ("distlab", [], "no command given"),
    ("distlab scaling", ["--no-such-flag"], "(see python -m distlab scaling --help)"),
    ("distlab.publish.freshness", ["check", "--figures-dir", "{d}/answers", "--notebooks-dir", "{d}/empty_run"],
     "no NN_*.ipynb notebooks"),
    ("distlab.launch", ["frobnicate"], "(see python -m"),
    ("distlab.launch.kubernetes.command", ["--no-such-flag"], "(see python -m"),
    ("distlab.bench.trainer_vs_hf", ["--no-such-flag"], "(see python -m"),
    ("distlab.publish.datagen", ["--no-such-flag"], "(see python -m"),
    ("distlab.workers.fingerprint", ["--no-such-flag"], "(see python -m"),
]


def _argv(command: str, args, d) -> tuple[str, list[str]]:
    """The module `python -m` runs and its arguments: "distlab x" is `python -m distlab x ...`."""
    module, *words = command.split()
    return module, [*words, *(a.replace("{d}", str(d)) for a in args)]


def _case_id(command: str) -> str:
    """A case's test id: "distlab.launch" -> "launch", "distlab infer" -> "infer", "distlab" -> "distlab"."""
    return command.removeprefix("distlab").lstrip(". ") or "distlab"


def _run(command, args, d):
    module, argv = _argv(command, args, d)
    cmd = [sys.executable, "-m", module, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO_ROOT)


# Runs each [module, args, timeout_s] read from stdin as `python -m module args` would (runpy, run_name
# "__main__"), in a child forked after the third-party imports most commands pay (torch's compiler stack
# included: distlab.attention reaches it); prints [{returncode, stdout, stderr}]. No distlab module is imported
# up front (each case imports its own), nor bitsandbytes (through peft): it prints a line when a command loads it.
FORK_RUNNER = """
import json, os, runpy, signal, sys, tempfile, traceback
import matplotlib.pyplot, pandas, torch, torch._dynamo, torch.distributed.fsdp, transformers  # noqa: F401,E401
results = []
for module, args, timeout_s in json.load(sys.stdin):
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            signal.alarm(int(timeout_s))  # a hung case dies by SIGALRM and fails its test
            sys.argv = [module, *args]
            code = 0
            try:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            except SystemExit as e:
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        results.append({"returncode": os.waitstatus_to_exitcode(status),
                        "stdout": out.read().decode(errors="replace"), "stderr": err.read().decode(errors="replace")})
json.dump(results, sys.__stdout__)
"""


def _run_forked(cases, d) -> list[SimpleNamespace]:
    """Every (module, args) in `cases`, one forked child each (see FORK_RUNNER), in one interpreter."""
    todo = [[*_argv(command, args, d), 120] for command, args in cases]
    proc = subprocess.run([sys.executable, "-c", FORK_RUNNER], input=json.dumps(todo), capture_output=True,
                          text=True, timeout=600, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [SimpleNamespace(**r) for r in json.loads(proc.stdout)]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every case, in two interpreters side by side (one per core), each forking a child per case."""
    d = _files(tmp_path_factory.mktemp("bad"))
    cases = [(module, args) for module, args, _ in CASES]
    halves = [cases[0::2], cases[1::2]]
    with ThreadPoolExecutor(max_workers=2) as pool:
        even, odd = pool.map(lambda half: _run_forked(half, d), halves)
    merged = [None] * len(cases)
    merged[0::2], merged[1::2] = even, odd
    return merged


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{_case_id(m)}:{' '.join(a)[:40]}" for m, a, _ in CASES])
def test_bad_input_is_one_line_and_exit_2(outcomes, i):
    module, args, expected = CASES[i]
    proc = outcomes[i]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, f"exit {proc.returncode}; stderr:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1, f"expected one line, got {len(lines)}:\n{proc.stderr[-3000:]}"
    assert lines[0].startswith(f"python -m {module}: error: "), lines[0]
    assert expected in lines[0], lines[0]


def test_debug_shows_the_traceback(tmp_path):
    proc = _run("distlab.train", ["--config", TINY, "--set", "max_steps=abc", "--debug"], tmp_path)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "ConfigError" in proc.stderr
