"""Pipeline parallelism: the split, the bubble maths, and 2-stage runs under real torchrun (gloo).

The multi-rank tests compare against the single-device loop on the same global batch: the first
step's loss must be equal (the same batch through the same weights, split over two processes),
later steps equal to rounding; GPipe, 1F1B, interleaved 1F1B (two model chunks per rank) and DeepSpeed's
PipelineModule all run, the timeline gives the bubble on a small m, and the saved adapter/model loads
with from_pretrained.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from distlab.launch.local import launch_training
from distlab.layer_split import split_layers
from distlab.measure.bubble import (
    cost_bubble,
    handoff,
    handoff_bubble,
    read_timeline,
    stage_idle,
    step_summary,
    theoretical_bubble,
    transfers,
)
from distlab.metrics import read_log
from distlab.strategies.split import StageModule, stack_microbatches

COMMON = {"max_steps": 3, "micro_batch_size": 2, "grad_accum": 2, "seq_len": 128, "logging_steps": 1,
          "lora_dropout": 0.0, "eval_at_start": False, "warmup_steps": 1}


def losses(log):
    return [r["loss"] for r in read_log(log)]


# --------------------------------------------------------------------------- no processes

def test_split_layers_balanced_and_explicit():
    assert [list(r) for r in split_layers(4, 2)] == [[0, 1], [2, 3]]
    assert [len(r) for r in split_layers(5, 2)] == [3, 2]  # the extra layer goes first: the last stage has the head
    assert [list(r) for r in split_layers(4, 2, [3, 1])] == [[0, 1, 2], [3]]
    for bad in ([2, 1], [1, 1, 2], [5, -1]):
        with pytest.raises(ValueError):
            split_layers(4, 2, bad)
    with pytest.raises(ValueError):
        split_layers(1, 2)


def test_bubble_theory_and_measurement_on_a_synthetic_timeline():
    assert theoretical_bubble(2, 1) == pytest.approx(0.5)
    assert theoretical_bubble(2, 4) == pytest.approx(0.2)
    assert theoretical_bubble(4, 8) == pytest.approx(3 / 11)
    # An ideal GPipe timeline, p=2, m=3, forward 1 and backward 2 time units per micro-batch.
    p, m, f, b = 2, 3, 1.0, 2.0
    events = []
    for s in range(p):
        for i in range(m):
            events.append({"stage": s, "kind": "F", "mb": i, "t0": (s + i) * f, "t1": (s + i + 1) * f})
    fwd_end = (m + p - 1) * f
    for s in range(p):
        for i in range(m):
            t0 = fwd_end + (p - 1 - s + i) * b
            events.append({"stage": s, "kind": "B", "mb": i, "t0": t0, "t1": t0 + b})
    idle = stage_idle(events)
    assert idle["span_s"] == pytest.approx((m + p - 1) * (f + b))
    assert all(v == pytest.approx(theoretical_bubble(p, m)) for v in idle["idle"].values())
    # A message: sent at 1.0, receive posted at 0.5 and done at 1.25 -> 0.25 s in transfer, 0.75 blocked.
    events += [{"stage": 0, "kind": "send", "peer": 1, "what": "act", "t0": 1.0, "t1": 1.1, "bytes": 8},
               {"stage": 1, "kind": "recv", "peer": 0, "what": "act", "t0": 0.5, "t1": 1.25, "bytes": 8}]
    (msg,) = transfers(events)
    assert msg["transfer_s"] == pytest.approx(0.25) and msg["blocked_s"] == pytest.approx(0.75)
    assert step_summary(events)["comm_bytes"] == 8


def test_handoff_cost_and_the_models_built_on_it():
    p, m, t, h = 2, 8, 1.0, 0.05
    assert handoff_bubble(p, m, t, 0.0) == pytest.approx(theoretical_bubble(p, m))
    excess = m * h / ((m + p - 1) * (t + h))
    assert handoff_bubble(p, m, t, h) == pytest.approx(theoretical_bubble(p, m) + excess)
    # Imbalance alone: the lighter stage idles more; the cost model's mean is above the theory.
    assert cost_bubble([1.0, 1.2], 0.0, m) > theoretical_bubble(p, m)
    # One stage: F0 [0, 1], gap 0.1, F1 [1.1, 2.1]; a receive posted at 2.1 whose send came at 2.5, done
    # at 2.6, then B [2.6, 3.6]: 0.4 s waiting for the peer, 0.2 s of hand-off over 2 micro-batches.
    events = [{"stage": 0, "kind": "F", "mb": 0, "t0": 0.0, "t1": 1.0},
              {"stage": 0, "kind": "F", "mb": 1, "t0": 1.1, "t1": 2.1},
              {"stage": 0, "kind": "recv", "peer": 1, "t0": 2.1, "t1": 2.6},
              {"stage": 1, "kind": "send", "peer": 0, "t0": 2.5, "t1": 2.5},
              {"stage": 0, "kind": "B", "mb": 0, "t0": 2.6, "t1": 3.6},
              {"stage": 1, "kind": "B", "mb": 0, "t0": 1.5, "t1": 2.5}]
    costs = handoff(events)
    assert costs["compute_per_mb_s"][0] == pytest.approx(1.5)
    assert costs["handoff_per_mb_s"][0] == pytest.approx(0.1)


def test_a_receive_posted_early_waits_only_from_its_wait():
    """Interleaved schedules post a receive, compute, then wait: only the wait (tw..t1) is blocked time."""
    events = [{"stage": 0, "kind": "F", "mb": 0, "t0": 0.0, "t1": 1.0},
              {"stage": 0, "kind": "recv", "peer": 1, "t0": 0.0, "tw": 1.0, "t1": 1.5},
              {"stage": 1, "kind": "send", "peer": 0, "t0": 1.4, "t1": 1.4},
              {"stage": 0, "kind": "B", "mb": 0, "t0": 1.5, "t1": 2.5},
              {"stage": 1, "kind": "F", "mb": 0, "t0": 0.2, "t1": 1.4}]
    (msg,) = transfers(events)
    assert msg["blocked_s"] == pytest.approx(0.5) and msg["transfer_s"] == pytest.approx(0.1)
    assert handoff(events)["handoff_per_mb_s"][0] == pytest.approx(0.1)  # 2.5 - 2.0 busy - 0.4 waiting


def test_interleaved_formula_and_its_table():
    from distlab.chapters import ch04

    assert ch04.bubble_formula(2, 4, 2) == pytest.approx(1 / 9) and ch04.formula_text(2) == "(p-1)/(2m+p-1)"
    bub = pd.DataFrame([{"m": m, "schedule": s, "v": v, "theory": ch04.bubble_formula(2, m, v),
                         "measured": ch04.bubble_formula(2, m, v) + 0.01, "abs_diff": 0.01, "pipeline_span_s": 1.0}
                        for m in (2, 4) for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))])
    table = ch04.interleaved_vs_1f1b(bub)
    assert list(table.index) == [(2, "1f1b"), (2, "interleaved"), (4, "1f1b"), (4, "interleaved")]
    assert table.loc[(4, "interleaved"), "formula"] == "(p-1)/(2m+p-1)"


@pytest.mark.parametrize("packing", [True, False])
def test_chained_stages_give_the_unsplit_loss(packing, tokenizer):
    """Two StageModules run one after the other equal CausalLMWithLoss on the same batch, packed
    (mask from position ids) and padded (attention mask), both padded further to seq_len."""
    from distlab.data import build_sft_data, model_inputs
    from distlab.models import CausalLMWithLoss, load_model
    from distlab.paths import TRAIN_FILE

    torch.manual_seed(0)
    model = CausalLMWithLoss(load_model(None)).eval()
    data = build_sft_data(TRAIN_FILE, tokenizer, 128, packing=packing)
    batch = data.batch([0, 1, 2])
    with torch.no_grad():
        want = float(model(**model_inputs(batch, torch.device("cpu"))))
        causal = model.causal_lm
        ranges = split_layers(causal.config.num_hidden_layers, 2, [3, 1])
        first, last = StageModule(causal, ranges[0], True, False), StageModule(causal, ranges[1], False, True)
        s = stack_microbatches([batch], 160, torch.device("cpu"))  # wider than the batch: padding on top
        kw = {k: s[k] for k in ("position_ids", "attention_mask") if k in s}
        got = float(last(first(s["input_ids"], **kw), labels=s["labels"], **kw))
    assert got == pytest.approx(want, rel=1e-5)


# --------------------------------------------------------------------------- 2 ranks

@pytest.fixture(scope="module")
def single_lora(tmp_path_factory):
    return launch_training("t_pp_single", 1, {**COMMON, "strategy": "single"},
                           runs_dir=tmp_path_factory.mktemp("pp"), echo=False)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_two_stage_schedules_match_single_device(schedule, single_lora, tmp_path):
    job = launch_training(f"t_pp_{schedule}", 2, {**COMMON, "strategy": "pipeline", "pipeline_schedule": schedule,
                                                  "measure_comm": True}, runs_dir=tmp_path, echo=False)
    want, got = losses(single_lora.log), losses(job.log)
    assert got[0] == pytest.approx(want[0], rel=1e-6)  # the first step: same batch, same weights
    assert got == pytest.approx(want, rel=1e-5)
    def evals(log):
        return [r["eval_loss"] for r in read_log(log, event="eval")]

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
    assert abs(summary["bubble_fraction"] - theoretical_bubble(p, v * m)) < 0.25
    hidden = 256  # a micro-batch crosses the ranks 2 p v - 2 times, forward and backward
    assert summary["comm_bytes"] == (2 * p * v - 2) * m * COMMON["micro_batch_size"] * COMMON["seq_len"] * hidden * 4
    step = read_log(job.log)[-1]
    assert step["comm_time_s"] >= 0 and step["bubble_fraction"] == pytest.approx(step["bubble_fraction"])
    assert len(step["stage_activation_peak_bytes"]) == 2 and min(step["stage_activation_peak_bytes"]) > 0

    # One adapter, loadable with from_pretrained, with the same tensors as the single-device one.
    from safetensors.torch import load_file

    a = load_file(single_lora.output_dir / "model" / "adapter_model.safetensors")
    b = load_file(job.output_dir / "model" / "adapter_model.safetensors")
    assert sorted(a) == sorted(b)
    # Three AdamW steps at lr 1e-2 turn rounding-level gradient differences into ~1e-4 differences
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 2e-3


@pytest.mark.slow
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


@pytest.mark.slow
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

    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(single.output_dir / "model").state_dict()
    b = AutoModelForCausalLM.from_pretrained(pp.output_dir / "model").state_dict()
    assert sorted(a) == sorted(b)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4


def test_the_study_benchmark_refuses_an_odd_ga_a_run_that_is_all_warm_up_and_a_ga_the_data_cannot_fill(capsys):
    from distlab.bench import pipeline_study

    sequences = pipeline_study.sequences_in(str(pipeline_study.TRAIN_FILE), 1024)
    too_large = 2 * (sequences // 2 + 1)  # micro 2 x this GA needs more sequences than the file packs into
    for argv, said in ((["--gas", "2,3"], "must divide by 2"), (["--steps", "2"], "warm-up"),
                       (["--gas", f"2,{too_large}"], f"packs into {sequences} sequences")):
        with pytest.raises(SystemExit):
            pipeline_study.main(argv)
        assert said in capsys.readouterr().err
