"""Bad input, in process: the config's checks one line each naming the field (the file and line for YAML), values
converted to their declared types, and every module that runs as `python -m` ending through distlab.cli's
run_main (one-line errors, exit 2). The same errors as each command prints them from a process of its own
(`<prog>: error: ...` on stderr, exit 2, no traceback; `--debug` shows it): tests/launches/test_cli_errors_runs.py."""

from __future__ import annotations

import pytest

from distlab.config import ConfigError, TrainConfig, load_config, parse_override
from distlab.paths import REPO_ROOT

TINY = "lib/distlab/configs/tiny_lora.yaml"


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
    """The table of tests/launches/test_cli_errors_runs.py runs a sample of them; this holds the rest to the same
    wrapper."""
    if module in OWN_EXIT_STATUSES:
        assert "run_main(main" not in text, f"{module} now goes through run_main: drop it from OWN_EXIT_STATUSES"
        return
    assert "run_main(main" in text, f"{module}: end with `run_main(main)` from distlab.cli (one-line errors, exit 2)"


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
    ("labels=prompts", "expected one of replies, all"),
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
