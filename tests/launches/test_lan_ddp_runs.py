"""Gradient compression for DDP (chapter 05) for real: 2-rank gloo runs with each comm hook, timed by the
CommTimer around it (the hook's bytes, not the bucket's). The config field's checks: tests/unit/test_lan_ddp.py."""

from __future__ import annotations

import math

import pytest

from distlab.metrics import read_log
from distlab.paths import EVAL_FILE
from distlab.results import schema
from distlab.strategies.ddp import POWERSGD_START_STEP

# fp16 keeps 11 significant bits of each averaged gradient: over 5 AdamW steps the loss moved by 5e-5
# relative (measured), so 1e-3 is a bug's bound, not noise's.
FP16_REL = 1e-3
BF16_REL = 5e-3  # 8 significant bits instead of 11
# PowerSGD (rank 1) replaces the update itself from its third step on: how far its per-batch loss strays from
# fp32's depends on the data (3.1% on the first helpdesk data, 5.6% at step 5 on the 11-phrasing data), so the
# test asserts what the method promises instead. Error feedback keeps it a descent method: over the same steps
# it lowers the held-out loss by at least half as much as fp32 (measured: 0.29 against 0.39).
POWERSGD_MIN_GAIN = 0.5


def test_compressed_ddp_trains_close_to_fp32_with_the_expected_bytes(tmp_path):
    """One launch, 2 gloo ranks, full fine-tuning: fp32 all-reduce, fp16 timed and untimed, bf16 (gloo on
    CPU sums bfloat16 in this torch), PowerSGD."""
    from distlab.launch.local import launch_sweep

    common = {"strategy": "ddp", "lora": False, "lr": 1e-3, "max_steps": 5, "warmup_steps": 1, "seq_len": 64,
              "micro_batch_size": 2, "logging_steps": 1, "lora_dropout": 0.0, "eval_file": None,
              "eval_at_start": False, "save_model": False, "measure_comm": True}
    held_out = {"eval_file": str(EVAL_FILE), "eval_at_start": True}  # before and after: what PowerSGD's steps gained
    variants = {"t_none": held_out, "t_fp16": {"ddp_comm_hook": "fp16"},
                "t_fp16_untimed": {"ddp_comm_hook": "fp16", "measure_comm": False},
                "t_bf16": {"ddp_comm_hook": "bf16"}, "t_psgd": {**held_out, "ddp_comm_hook": "powersgd"}}
    jobs = launch_sweep("t_hooks", 2, common, variants, runs_dir=tmp_path, echo=False, timeout_s=240)
    logs = {name: read_log(job.log) for name, job in jobs.items()}
    loss = {name: [s["loss"] for s in steps] for name, steps in logs.items()}
    assert all(len(v) == 5 and all(map(math.isfinite, v)) for v in loss.values()), loss
    assert loss["t_fp16"] == pytest.approx(loss["t_none"], rel=FP16_REL)
    assert loss["t_fp16_untimed"] == loss["t_fp16"]  # the timer around the hook changes nothing it computes
    assert loss["t_bf16"] == pytest.approx(loss["t_none"], rel=BF16_REL)
    # plain all-reduces for the first POWERSGD_START_STEP steps, so the loss of the step after them is still
    # fp32's; the next one's is not
    plain = POWERSGD_START_STEP + 1
    assert loss["t_psgd"][:plain] == pytest.approx(loss["t_none"][:plain], rel=1e-6)
    assert loss["t_psgd"][plain] != pytest.approx(loss["t_none"][plain], rel=FP16_REL), loss
    evals = {name: [e["eval_loss"] for e in read_log(jobs[name].log, "eval")] for name in ("t_none", "t_psgd")}
    gain = {name: v[0] - v[-1] for name, v in evals.items()}
    # it trains at all: on the same held-out rows (the training losses of step 1 and step 5 are of other batches,
    # and which is lower depends on the base this machine pretrained)
    assert evals["t_psgd"][0] == evals["t_none"][0] and gain["t_none"] > 0, evals
    assert gain["t_psgd"] >= POWERSGD_MIN_GAIN * gain["t_none"], evals
    steady = {name: [s["comm_bytes"] for s in steps if s["step"] > schema.WARMUP_STEPS]
              for name, steps in logs.items() if name != "t_fp16_untimed"}
    assert all(b == steady["t_none"][0] for b in steady["t_none"])
    assert all(b == pytest.approx(steady["t_none"][0] / 2, rel=1e-3) for b in steady["t_fp16"])  # 2 of 4 bytes
    assert all(b == steady["t_fp16"][0] for b in steady["t_bf16"])
    assert all(b < steady["t_none"][0] / 10 for b in steady["t_psgd"])  # rank-1 factors of every matrix
    assert "comm_bytes" not in logs["t_fp16_untimed"][-1]
