"""Bad input to any `python -m distlab.*` command: one line `<prog>: error: ...` on stderr, exit 2, no
traceback; `--debug` shows the traceback. Every case runs the real command's `__main__` in a process of its own
(its own stdout, stderr and exit status): forked from an interpreter that imported torch and transformers once,
so forty cases do not pay forty interpreter starts. `--debug` runs one as a plain `python -m` subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from distlab.config import ConfigError, TrainConfig, load_config, parse_override
from distlab.paths import REPO_ROOT

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


def alias_bomb(levels: int = 9) -> str:
    """The billion laughs: 9 levels of 9 aliases each, 9**9 strings once expanded, 600 bytes of YAML."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


# (command, args, text the one line must contain); {d} is a folder of bad inputs
CASES = [
    ("distlab.train", ["--config", TINY, "--set", "max_steps=abc"], "--set: max_steps='abc' is not accepted"),
    ("distlab.train", ["--config", TINY, "--set", "seq_len=0"], "seq_len=0 is not accepted: expected an integer >= 1"),
    ("distlab.train", ["--config", TINY, "--set", "lr=-1"], "lr=-1 is not accepted: expected a number > 0"),
    ("distlab.train", ["--config", TINY, "--set", "model=/no/such/model"], "no such folder /no/such/model"),
    ("distlab.train", ["--config", "{d}/bad.yaml"], "bad.yaml:2: lr='fast' is not accepted"),
    ("distlab.train", ["--config", "{d}/missing.yaml"], "missing.yaml: cannot read"),
    ("distlab.train", [], "the following arguments are required: --config"),
    ("distlab.infer", ["--prompts", "{d}/missing.jsonl"], "--prompts"),
    ("distlab.infer", ["--prompts", "{d}/prompts.jsonl", "--adapter", "{d}/nope"], "no such folder"),
    ("distlab.infer", ["--prompts", "{d}/prompts.jsonl", "--adapter", "{d}/not_adapter"], "no adapter_config.json"),
    ("distlab.infer", ["--prompts", "{d}/prompts.jsonl", "--model", "/no/model"], "--model: model='/no/model'"),
    ("distlab.infer", ["--prompts", "{d}/prompts.jsonl", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    ("distlab.scaling", ["{d}/nope"], "no such run folder"),
    ("distlab.scaling", ["{d}/empty_run"], "no step log"),
    ("distlab.scaling", [], "the following arguments are required: RUN"),
    ("distlab.report", ["{d}/nope"], "no such run folder or log file"),
    ("distlab.report", ["{d}/no_markers.log"], "no DISTLAB_RESULT markers"),
    ("distlab.report", ["{d}/truncated.log"], "truncated"),
    ("distlab.report", ["{d}/empty_run"], "no console.log"),
    ("distlab.matrix", ["--strategies", "dpp"], "unknown strategy 'dpp'"),
    ("distlab.matrix", ["--world-sizes", "one"], "expected integers"),
    ("distlab.matrix", ["--strategies", "single", "--world-sizes", "2"], "single runs on 1 rank only"),
    ("distlab.matrix", ["--set", "lr=-1"], "--set: lr=-1 is not accepted"),
    ("distlab.accept", ["{d}/nope"], "no such run folder"),
    ("distlab.accept", ["{d}/empty_run", "--every", "0"], "--every 0"),
    ("distlab.accept", ["{d}/empty_run", "--answers", "{d}/answers"], "no summary.json"),
    ("distlab.monitor", [], "no command to monitor"),
    ("distlab.monitor", ["--", "/no/such/program"], "No such file or directory"),
    ("distlab.monitor", ["--interval-s", "0", "--", "true"], "must be > 0"),
    # issue 21: bounded YAML, NaN, user errors that were tracebacks, silent wrong results
    ("distlab.train", ["--config", "{d}/bomb.yaml"], "bomb.yaml:6: more than 100000 values once aliases"),
    ("distlab.train", ["--config", "{d}/deep.yaml"], "deep.yaml:1: nested more than 64 levels deep"),
    ("distlab.train", ["--config", "{d}/binary.yaml"], "binary.yaml:2: a binary file (NUL byte)"),
    ("distlab.train", ["--config", TINY, "--set", "lr=nan"], "lr='nan' is not accepted: expected a number > 0"),
    ("distlab.train", ["--config", TINY, "--set", "strategy=ddp", "--set", "output_dir={d}/ddp"],
     "strategy 'ddp' needs a launcher: run it under torchrun"),
    ("distlab.publish.regenerate", ["--profile", "nosuch"], "unknown profile 'nosuch'"),
    ("distlab.monitor", ["--interval-s", "nan", "--", "true"], "--interval-s: 'nan' is not a finite number"),
    ("distlab.monitor", ["--timeout-s", "inf", "--", "true"], "--timeout-s: 'inf' is not a finite number"),
    ("distlab.accept", ["{d}/empty_run", "--min-changed", "nan"], "--min-changed: 'nan' is not a finite"),
    ("distlab.infer", ["--prompts", "{d}/prompts.jsonl", "--temperature", "nan"], "'nan' is not a finite number"),
    ("distlab.infer", ["--prompts", "{d}/bad_facts.jsonl", "--out", "{d}/infer_out"],
     "bad_facts.jsonl:1: field 'facts'"),
    ("distlab.infer", ["--prompts", "{d}/prompts.jsonl", "--adapter", "{d}/hub_adapter"],
     "is a hub model that is not in the local cache"),
    ("distlab.matrix", ["--world-sizes", "1000", "--runs-dir", "{d}/matrix"], "a local launch holds at most"),
    ("distlab.publish.freshness", ["check", "--figures-dir", "{d}/answers", "--notebooks-dir", "{d}/empty_run"],
     "no NN_*.ipynb notebooks"),
    ("distlab.launch", ["frobnicate"], "(see python -m"),
    ("distlab.launch.kubernetes.command", ["--no-such-flag"], "(see python -m"),
    ("distlab.bench.trainer_vs_hf", ["--no-such-flag"], "(see python -m"),
    ("distlab.publish.datagen", ["--no-such-flag"], "(see python -m"),
    ("distlab.workers.fingerprint", ["--no-such-flag"], "(see python -m"),
]


# Entry points that keep another tool's exit statuses, with the reason.
OWN_EXIT_STATUSES = {
    "distlab.launch.watchdog": "stands in for coreutils' timeout: the command's own status passes through, 124 "
                               "at the limit, its own errors take timeout's 125/126/127 (test_portable_launch.py)",
}


def _entry_modules():
    """Every module of the package that runs as `python -m` (a __main__ block or a __main__.py)."""
    package = REPO_ROOT / "lib" / "distlab"
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        if path.name == "__main__.py" or 'if __name__ == "__main__":' in text:
            yield path.relative_to(package.parent).with_suffix("").as_posix().replace("/", "."), text


@pytest.mark.parametrize("module,text", list(_entry_modules()), ids=lambda v: v if v.startswith("distlab") else "")
def test_every_entry_point_goes_through_run_main(module, text):
    """The table above runs a sample of them; this holds the rest to the same wrapper."""
    if module in OWN_EXIT_STATUSES:
        assert "run_main(main" not in text, f"{module} now goes through run_main: drop it from OWN_EXIT_STATUSES"
        return
    assert "run_main(main" in text, f"{module}: end with `run_main(main)` from distlab.cli (one-line errors, exit 2)"


def _run(module, args, d):
    cmd = [sys.executable, "-m", module, *[a.replace("{d}", str(d)) for a in args]]
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
    todo = [[module, [a.replace("{d}", str(d)) for a in args], 120] for module, args in cases]
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


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{m.split('.', 1)[1]}:{' '.join(a)[:40]}" for m, a, _ in CASES])
def test_bad_input_is_one_line_and_exit_2(outcomes, i):
    module, args, expected = CASES[i]
    proc = outcomes[i]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, f"exit {proc.returncode}; stderr:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1, f"expected one line, got {len(lines)}:\n{proc.stderr[-3000:]}"
    assert lines[0].startswith(f"python -m {module}: error: "), lines[0]
    assert expected in lines[0], lines[0]


@pytest.mark.slow
def test_debug_shows_the_traceback(tmp_path):
    proc = _run("distlab.train", ["--config", TINY, "--set", "max_steps=abc", "--debug"], tmp_path)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "ConfigError" in proc.stderr


# the config's own checks, in process (the subprocess table above covers how they reach the user)
CONFIG_CASES = [
    ("model=not a model", "neither an existing folder, nor a hub id"),
    ("model=lib", "the folder lib holds no config.json"),
    ("strategy=dpp", "one of single, ddp, fsdp"),
    ("max_stepz=3", "unknown field 'max_stepz'"),
    ("lr", "expected key=value"),
    ("lora_dropout=1", "lora_dropout=1 is not accepted: expected a number in [0, 1)"),
    ("device=gpu", "expected auto, cpu, cuda or cuda:N"),
    ("packing=maybe", "expected true or false"),
    ("lr=nan", "expected a number > 0"),
    ("weight_decay=inf", "weight_decay='inf' is not accepted"),
    ("max_grad_norm=-.inf", "max_grad_norm=-inf is not accepted"),
    ("lora_dropout=.nan", "lora_dropout=nan is not accepted"),
    ("rank_shares=[1, .nan]", "rank_shares=[1, nan] is not accepted"),
    ("stage_layers=[2, 0]", "layer counts >= 1"),
    ("max_steps=2.5", "expected an integer >= 1"),
]


@pytest.mark.parametrize("override,expected", CONFIG_CASES)
def test_config_rejects_bad_values_at_read_time(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(REPO_ROOT / TINY, dict([parse_override(override)]))
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_bad_yaml_names_the_file_and_line(tmp_path):
    (tmp_path / "broken.yaml").write_text("max_steps: [1\n")
    with pytest.raises(ConfigError, match=r"broken.yaml:\d+: invalid YAML"):
        load_config(tmp_path / "broken.yaml")


def test_values_are_converted_to_the_declared_type():
    cfg = load_config(REPO_ROOT / TINY, dict(parse_override(s) for s in
                                             ["lr=2e-4", "max_steps=1e2", "packing=false", "lora_targets=q_proj,v_proj",
                                              "global_batch_size=null"]))
    assert cfg.lr == 0.0002 and isinstance(cfg.lr, float)
    assert cfg.max_steps == 100 and isinstance(cfg.max_steps, int)
    assert cfg.packing is False and cfg.lora_targets == ["q_proj", "v_proj"] and cfg.global_batch_size is None
    with pytest.raises(ConfigError, match=r"seq_len=0 is not accepted"):
        cfg.replace(seq_len=0)
    with pytest.raises(ConfigError, match=r"TrainConfig: lr='fast' is not accepted"):
        TrainConfig(lr="fast")
