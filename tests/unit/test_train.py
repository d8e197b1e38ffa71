"""The one training loop on one device: it learns, logs what it promises, saves, and splits batches exactly.
The command line (`python -m distlab.train` in a process of its own): tests/launches/test_train_runs.py."""

from __future__ import annotations

import json

import pytest
import torch

from distlab.batching import StepBatches
from distlab.config import TrainConfig, load_config
from distlab.metrics import read_log
from distlab.train import train

QUICK = dict(max_steps=8, seq_len=256, micro_batch_size=2, logging_steps=2, lr=1e-2, warmup_steps=2,
             num_threads=1, progress=False)
STEP_FIELDS = {"step", "world_size", "loss", "lr", "step_time_s", "tokens_per_s", "samples_per_s",
               "peak_mem_bytes", "mfu", "hfu", "grad_norm"}


@pytest.mark.slow  # an 8-step run with two evaluations in process: ~5 s on 2 cores
def test_lora_run_learns_logs_and_saves(tmp_path):
    result = train(TrainConfig(**QUICK, output_dir=str(tmp_path)))
    assert result.eval_loss_after < result.eval_loss_before
    steps = read_log(result.log_path)
    assert [s["step"] for s in steps] == [2, 4, 6, 8]
    start = read_log(result.log_path, event="start")[0]
    for s in steps:
        assert STEP_FIELDS <= set(s)
        assert s["tokens_per_s"] > 0 and s["peak_mem_bytes"] > 0
        # MFU is achieved FLOP/s over the peak. On a CPU the peak is a matmul measured once and cached: measured
        # while the machine was busier than now, it can sit below what a run achieves, so `mfu < 1` is not a
        # property of the code; the ratio itself is.
        assert s["mfu"] == pytest.approx(s["tokens_per_s"] * start["flops_per_token"] / start["peak_flops"], rel=1e-9)
        # per-document attention executes exactly the model's pairs: HFU is MFU (no recomputation here)
        assert s["hfu"] == pytest.approx(s["mfu"], rel=1e-9) and start["executed_flops_per_token"] == \
            pytest.approx(start["flops_per_token"], rel=1e-12)
    events = [r["event"] for r in read_log(result.log_path, event=None)]
    assert events[0] == "start" and events[-1] == "end" and events.count("eval") == 2
    meta = json.loads((tmp_path / "run_metadata.json").read_text())
    assert meta["config"]["lora_r"] == 16 and meta["versions"]["torch"].startswith("2.13")
    assert {"device", "commit", "date", "model", "world_size"} <= set(meta["provenance"])
    assert (tmp_path / "model" / "adapter_config.json").exists()


@pytest.mark.slow  # the same 8-step run, then a reload: ~5 s
def test_saved_adapter_reloads_with_the_same_eval_loss(tmp_path):
    from peft import PeftModel

    from distlab.data import build_sft_data
    from distlab.device import choose_device
    from distlab.lm_loss import CausalLMWithLoss
    from distlab.models import load_model, load_tokenizer
    from distlab.strategies import make_strategy

    cfg = TrainConfig(**QUICK, output_dir=str(tmp_path), eval_at_start=False)
    result = train(cfg)
    model = CausalLMWithLoss(PeftModel.from_pretrained(load_model(None), tmp_path / "model"))
    data = build_sft_data(cfg.eval_file, load_tokenizer(None), cfg.seq_len)
    loss = make_strategy("single").evaluate(model, data, choose_device("cpu", "fp32"))
    assert loss == pytest.approx(result.eval_loss_after, abs=1e-5)


@pytest.mark.slow  # two 4-step runs: ~3 s on 2 cores
def test_accumulation_split_does_not_change_the_step():
    """micro 4 x accumulation 1 and micro 2 x accumulation 2 are the same optimizer step."""
    common = dict(QUICK, max_steps=4, logging_steps=1, lora_dropout=0.0, eval_file=None, save_model=False)
    a = read_log(train(TrainConfig(**{**common, "micro_batch_size": 4}, output_dir="build/test-runs/acc1")).log_path)
    b = read_log(train(TrainConfig(**{**common, "micro_batch_size": 2, "grad_accum": 2},
                                   output_dir="build/test-runs/acc2")).log_path)
    assert [s["loss"] for s in a] == pytest.approx([s["loss"] for s in b], rel=1e-5)


def test_full_finetune_and_activation_checkpointing_agree(tmp_path):
    common = dict(QUICK, max_steps=2, logging_steps=1, lora=False, eval_file=None, save_model=False,
                  lora_dropout=0.0)
    plain = read_log(train(TrainConfig(**common, output_dir=str(tmp_path / "p"))).log_path)
    ckpt_cfg = TrainConfig(**common, activation_checkpointing=True, output_dir=str(tmp_path / "c"))
    ckpt = read_log(train(ckpt_cfg).log_path)
    assert [s["loss"] for s in plain] == pytest.approx([s["loss"] for s in ckpt], rel=1e-5)


@pytest.mark.parametrize("micro,accum,world", [(4, 1, 2), (2, 2, 2), (1, 4, 2), (2, 1, 4)])
def test_global_batch_is_the_same_rows_whatever_the_world_size(micro, accum, world):
    single = StepBatches(100, micro=micro * accum * world, accum=1, world=1, rank=0, seed=7)
    ranks = [StepBatches(100, micro=micro, accum=accum, world=world, rank=r, seed=7) for r in range(world)]
    for _ in range(2 * single.steps_per_epoch + 1):  # across an epoch boundary too
        expected = sorted(i for mb in single.next_step() for i in mb)
        got = sorted(i for rk in ranks for mb in rk.next_step() for i in mb)
        assert got == expected


def test_batch_position_resumes_exactly():
    a = StepBatches(50, micro=2, accum=2, world=1, rank=0, seed=3)
    for _ in range(17):
        a.next_step()
    b = StepBatches(50, micro=2, accum=2, world=1, rank=0, seed=3)
    b.load_state_dict(a.state_dict())
    assert [a.next_step() for _ in range(5)] == [b.next_step() for _ in range(5)]


def test_global_batch_size_derives_accumulation():
    cfg = TrainConfig(micro_batch_size=2, global_batch_size=8)
    assert (cfg.micro_steps(1), cfg.micro_steps(2), cfg.micro_steps(4)) == (4, 2, 1)
    with pytest.raises(ValueError, match="not divisible"):
        cfg.micro_steps(3)


def test_bad_config_names_the_file_and_field(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("max_stepz: 2\n")
    with pytest.raises(ValueError, match=r"bad.yaml: unknown field\(s\) max_stepz"):
        load_config(config)
    config.write_text("max_steps: [1\n")
    with pytest.raises(ValueError, match=r"bad.yaml:\d+: invalid YAML"):
        load_config(config)


def test_variants_need_their_own_output_dirs(tmp_path):
    from distlab.train import variant_configs

    config = tmp_path / "c.yaml"
    config.write_text("max_steps: 3\n")
    cfgs = variant_configs(config, {"seq_len": 128}, [f"{{output_dir: {tmp_path}/a, max_steps: 5}}",
                                                      f"{{output_dir: {tmp_path}/b}}"])
    assert [(c.max_steps, c.seq_len) for c in cfgs] == [(5, 128), (3, 128)]
    with pytest.raises(ValueError, match="must be a mapping that sets output_dir"):
        variant_configs(config, {}, ["{max_steps: 5}"])
    with pytest.raises(ValueError, match="--variant 2 and --variant 1 share output_dir"):
        variant_configs(config, {}, [f"{{output_dir: {tmp_path}/a}}", f"{{output_dir: {tmp_path}/a}}"])
    with pytest.raises(ValueError, match=r"--variant 1:\d+: invalid YAML"):
        variant_configs(config, {}, ["{output_dir: [unclosed"])
    assert len(variant_configs(config, {}, [])) == 1


def test_measuring_the_peak_leaves_the_runs_random_numbers_alone():
    """The trainer measures its MFU peak between seeding a run and its first step (on a cold cache): the
    measurement must not draw from the global generator, or the run's dropout would depend on the cache."""
    from distlab.device import measure_matmul_flops

    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    assert measure_matmul_flops("cpu", n=64, seconds=0.01) > 0
    assert torch.equal(torch.rand(3), expected)
