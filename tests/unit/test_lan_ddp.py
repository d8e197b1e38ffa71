"""Gradient compression for DDP (chapter 05): the config field's checks and the benchmark's refusals. Real 2-rank
gloo runs with each comm hook: tests/launches/test_lan_ddp_runs.py."""

from __future__ import annotations

import pytest

from distlab.config import ConfigError, TrainConfig, from_dict


@pytest.mark.parametrize("value,expected", [(None, None), ("none", None), ("null", None), ("fp16", "fp16"),
                                            ("bf16", "bf16"), ("powersgd", "powersgd")])
def test_comm_hook_choices_are_accepted(value, expected):
    assert from_dict({"strategy": "ddp", "ddp_comm_hook": value}).ddp_comm_hook == expected


def test_bad_comm_hooks_are_refused_with_one_line():
    with pytest.raises(ConfigError, match=r"--set: ddp_comm_hook='int8' is not accepted: expected one of fp16, "
                                          r"bf16, powersgd, or null"):
        from_dict({"strategy": "ddp", "ddp_comm_hook": "int8"}, sources={"ddp_comm_hook": "--set"})
    with pytest.raises(ConfigError, match=r"ddp_comm_hook='fp16' needs strategy=ddp \(strategy='fsdp'"):
        TrainConfig(strategy="fsdp", ddp_comm_hook="fp16")
    with pytest.raises(ConfigError, match=r"powersgd_rank=0 is not accepted: expected an integer >= 1"):
        TrainConfig(strategy="ddp", ddp_comm_hook="powersgd", powersgd_rank=0)


def test_the_bench_refuses_bad_arguments_in_one_line(capsys):
    from distlab.bench import lan_ddp

    assert lan_ddp.main(["--hooks", "none,int8"]) == 2
    assert lan_ddp.main(["--steps", "2"]) == 2
    assert lan_ddp.main(["--rates", "100mb"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and all(line.startswith("python -m distlab.bench.lan_ddp: error:") for line in lines)
