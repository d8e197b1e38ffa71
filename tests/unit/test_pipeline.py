"""Pipeline parallelism in one process: the split, the bubble maths on synthetic timelines, the hand-off cost, the
chained stages against the unsplit loss, and the study benchmark's refusals. 2-stage runs under real torchrun
(gloo) against the single-device loop: tests/launches/test_pipeline_runs.py.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from distlab.layer_split import split_layers
from distlab.measure.bubble import (
    bubble_formula,
    cost_bubble,
    formula_text,
    handoff,
    handoff_bubble,
    stage_idle,
    step_summary,
    transfers,
)
from distlab.strategies.split import StageModule, stack_microbatches

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
    assert bubble_formula(2, 1) == pytest.approx(0.5)
    assert bubble_formula(2, 4) == pytest.approx(0.2)
    assert bubble_formula(4, 8) == pytest.approx(3 / 11)
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
    assert all(v == pytest.approx(bubble_formula(p, m)) for v in idle["idle"].values())
    # A message: sent at 1.0, receive posted at 0.5 and done at 1.25 -> 0.25 s in transfer, 0.75 blocked.
    events += [{"stage": 0, "kind": "send", "peer": 1, "what": "act", "t0": 1.0, "t1": 1.1, "bytes": 8},
               {"stage": 1, "kind": "recv", "peer": 0, "what": "act", "t0": 0.5, "t1": 1.25, "bytes": 8}]
    (msg,) = transfers(events)
    assert msg["transfer_s"] == pytest.approx(0.25) and msg["blocked_s"] == pytest.approx(0.75)
    assert step_summary(events)["comm_bytes"] == 8


def test_handoff_cost_and_the_models_built_on_it():
    p, m, t, h = 2, 8, 1.0, 0.05
    assert handoff_bubble(p, m, t, 0.0) == pytest.approx(bubble_formula(p, m))
    excess = m * h / ((m + p - 1) * (t + h))
    assert handoff_bubble(p, m, t, h) == pytest.approx(bubble_formula(p, m) + excess)
    # Imbalance alone: the lighter stage idles more; the cost model's mean is above the theory.
    assert cost_bubble([1.0, 1.2], 0.0, m) > bubble_formula(p, m)
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

    assert bubble_formula(2, 4, 2) == pytest.approx(1 / 9) and formula_text(2) == "(p-1)/(2m+p-1)"
    bub = pd.DataFrame([{"m": m, "schedule": s, "v": v, "theory": bubble_formula(2, m, v),
                         "measured": bubble_formula(2, m, v) + 0.01, "abs_diff": 0.01, "pipeline_span_s": 1.0}
                        for m in (2, 4) for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))])
    table = ch04.interleaved_vs_1f1b(bub)
    assert list(table.index) == [(2, "1f1b"), (2, "interleaved"), (4, "1f1b"), (4, "interleaved")]
    assert table.loc[(4, "interleaved"), "formula"] == "(p-1)/(2m+p-1)"


@pytest.mark.parametrize("packing", [True, False])
def test_chained_stages_give_the_unsplit_loss(packing, tokenizer):
    """Two StageModules run one after the other equal CausalLMWithLoss on the same batch, packed
    (mask from position ids) and padded (attention mask), both padded further to seq_len."""
    from distlab.data import build_sft_data, model_inputs
    from distlab.lm_loss import CausalLMWithLoss
    from distlab.models import load_model
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


# --------------------------------------------------------------------------- the study benchmark


def test_the_study_benchmark_refuses_an_odd_ga_a_run_that_is_all_warm_up_and_a_ga_the_data_cannot_fill(capsys):
    from distlab.bench import pipeline_study

    sequences = pipeline_study.sequences_in(str(pipeline_study.TRAIN_FILE), 1024)
    too_large = 2 * (sequences // 2 + 1)  # micro 2 x this GA needs more sequences than the file packs into
    for argv, said in ((["--gas", "2,3"], "must divide by 2"), (["--steps", "2"], "warm-up"),
                       (["--gas", f"2,{too_large}"], f"packs into {sequences} sequences")):
        with pytest.raises(SystemExit):
            pipeline_study.main(argv)
        assert said in capsys.readouterr().err
