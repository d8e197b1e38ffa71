"""Pipeline parallelism: 2-stage runs under real torchrun (gloo), against the single-device loop on the same global
batch: the first step's loss must be equal (the same batch through the same weights, split over two processes),
later steps equal to rounding; GPipe, 1F1B, interleaved 1F1B (two model chunks per rank) and DeepSpeed's
PipelineModule all run, the timeline gives the bubble on a small m, and the saved adapter/model loads
with from_pretrained. The split and the bubble maths in one process: tests/unit/test_pipeline.py.
"""

from __future__ import annotations

import pytest

from distlab.launch.local import launch_training
from distlab.measure.bubble import bubble_formula, read_timeline, step_summary
from distlab.metrics import read_log
from helpers import exported_model, held_out_loss

COMMON = {"max_steps": 3, "micro_batch_size": 2, "grad_accum": 2, "seq_len": 128, "logging_steps": 1,
          "lora_dropout": 0.0, "eval_at_start": False, "warmup_steps": 1}


def losses(log):
    return [r["loss"] for r in read_log(log)]


def evals(log):
    return [r["eval_loss"] for r in read_log(log, event="eval")]


# --------------------------------------------------------------------------- 2 ranks

@pytest.fixture(scope="module")
def single_lora(tmp_path_factory):
    return launch_training("t_pp_single", 1, {**COMMON, "strategy": "single"},
                           runs_dir=tmp_path_factory.mktemp("pp"), echo=False)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_two_stage_schedules_match_single_device(schedule, single_lora, tmp_path):
    job = launch_training(f"t_pp_{schedule}", 2, {**COMMON, "strategy": "pipeline", "pipeline_schedule": schedule,
                                                  "measure_comm": True}, runs_dir=tmp_path, echo=False)
    want, got = losses(single_lora.log), losses(job.log)
    assert got[0] == pytest.approx(want[0], rel=1e-6)  # the first step: same batch, same weights
    assert got == pytest.approx(want, rel=1e-5)
    assert evals(job.log) == pytest.approx(evals(single_lora.log), rel=1e-5)

    # The bubble on a small m, from the recorded timeline.
    m, p = COMMON["grad_accum"], 2
    records = read_timeline(job.output_dir)
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["schedule"] == schedule for r in records)
    events = records[-1]["events"]
    v = 2 if schedule == "interleaved" else 1  # model chunks per rank
    assert all(r["virtual"] == v for r in records)
    for s in range(p):
        for kind in "FB":
            assert sorted(e["mb"] for e in events if e["stage"] == s and e["kind"] == kind) == sorted([*range(m)] * v)
    order = [f"{e['kind']}{e['mb']}" + (f"c{e['chunk']}" if v > 1 else "")
             for e in sorted(events, key=lambda e: e["t0"]) if e["stage"] == 1 and e["kind"] in "FB"]
    assert order == {"gpipe": ["F0", "F1", "B0", "B1"], "1f1b": ["F0", "B0", "F1", "B1"],
                     "interleaved": ["F0c0", "F1c0", "F0c1", "B0c1", "F1c1", "B1c1", "B0c0", "B1c0"]}[schedule]
    summary = step_summary(events)
    assert 0.05 < summary["bubble_fraction"] < 0.75
    # loose: the tiny model is unbalanced; (p-1)/(v m+p-1) with v m chunk-sized slots
    assert abs(summary["bubble_fraction"] - bubble_formula(p, m, v)) < 0.25
    hidden = 256  # a micro-batch crosses the ranks 2 p v - 2 times, forward and backward
    assert summary["comm_bytes"] == (2 * p * v - 2) * m * COMMON["micro_batch_size"] * COMMON["seq_len"] * hidden * 4
    step = read_log(job.log)[-1]
    assert step["comm_time_s"] >= 0 and step["bubble_fraction"] == pytest.approx(step["bubble_fraction"])
    assert len(step["stage_activation_peak_bytes"]) == 2 and min(step["stage_activation_peak_bytes"]) > 0

    # One adapter from both stages, loadable with from_pretrained: the tensors the single-device run saves, and
    # the model this run trained (its logged held-out loss, to rounding; weights: see helpers.held_out_loss)
    from safetensors.torch import load_file

    from distlab.data import build_sft_data
    from distlab.models import load_tokenizer
    from distlab.paths import EVAL_FILE

    a = load_file(single_lora.output_dir / "model" / "adapter_model.safetensors")
    b = load_file(job.output_dir / "model" / "adapter_model.safetensors")
    assert sorted(a) == sorted(b) and all(a[k].shape == b[k].shape for k in a)
    held_out = build_sft_data(EVAL_FILE, load_tokenizer(None), COMMON["seq_len"])
    exported = held_out_loss(exported_model(job.output_dir / "model", lora=True), held_out)
    assert exported == pytest.approx(evals(job.log)[-1], rel=1e-5)


def test_deepspeed_pipeline_matches_single_device(single_lora, tmp_path):
    job = launch_training("t_ds_pp", 2, {**COMMON, "strategy": "ds_pipeline", "measure_comm": True},
                          runs_dir=tmp_path, echo=False, timeout_s=600)
    want, got = losses(single_lora.log), losses(job.log)
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    assert got == pytest.approx(want, rel=1e-5)
    step = read_log(job.log)[-1]
    assert step["pipeline_schedule"] == "deepspeed-1f1b" and 0 < step["bubble_fraction"] < 1
    assert step["comm_time_s"] >= 0 and step["comm_bytes"] > 0
    assert (job.output_dir / "model" / "adapter_model.safetensors").exists()


def test_full_finetuning_tied_embeddings_checkpoint_and_resume(tmp_path):
    """Full fine-tuning trains the tied embedding/head on both end stages; a per-stage checkpoint
    resumes to the same losses, and the saved model loads with from_pretrained."""
    full = {**COMMON, "lora": False, "lr": 1e-3, "max_steps": 4, "eval_file": None}
    single = launch_training("t_pp_full_single", 1, {**full, "strategy": "single"}, runs_dir=tmp_path, echo=False)
    overrides = {**full, "strategy": "pipeline", "stage_layers": [3, 1], "checkpoint_steps": 2}
    pp = launch_training("t_pp_full", 2, overrides, runs_dir=tmp_path, echo=False)
    assert losses(pp.log) == pytest.approx(losses(single.log), rel=1e-5)
    ckpt = pp.output_dir / "checkpoints" / "step-00000002"
    assert sorted(p.name for p in ckpt.glob("training_state.stage*.pt")) == ["training_state.stage0.pt",
                                                                              "training_state.stage1.pt"]
    first = losses(pp.log)
    again = launch_training("t_pp_full", 2, overrides, runs_dir=tmp_path, echo=False, fresh=False)
    assert any("resumed from" in line for line in again.result.tail)
    assert losses(again.log) == first  # bitwise: same stages, same floats

    # Both exports load, with the same tensors by name and the same loss on a training batch after the last
    # update (which the loss curve does not see); weights element by element: see helpers.held_out_loss
    import torch

    from distlab.data import build_sft_data, model_inputs
    from distlab.models import load_tokenizer
    from distlab.paths import TRAIN_FILE

    batch = model_inputs(build_sft_data(TRAIN_FILE, load_tokenizer(None), COMMON["seq_len"]).batch([0, 1]),
                         torch.device("cpu"))
    a, b = (exported_model(run.output_dir / "model", lora=False) for run in (single, pp))
    assert sorted(a.state_dict()) == sorted(b.state_dict())
    with torch.no_grad():
        assert float(b(**batch)) == pytest.approx(float(a(**batch)), rel=1e-5)
