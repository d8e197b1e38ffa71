"""Chapter 01's additions: MFU and HFU counts, the data counts they use, the paraphrased key-fact
questions, the benchmark's saved tables and attention share, and the chapter module's plumbing."""

from __future__ import annotations

import difflib
import json
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from distlab import paths
from distlab.config import TrainConfig
from distlab.data import IGNORE_INDEX, SFTData, load_jsonl
from distlab.metrics import mean_attention_span, train_flops_per_token, utilisation
from distlab.train import run_flops_per_token

CONFIG = SimpleNamespace(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=16, vocab_size=32)
LAYER_WEIGHTS = 2 * (8 * 8 * 2 + 8 * 4 * 2 + 3 * 8 * 16)  # 2 layers of q,o + k,v (one KV head of 4) + MLP
HEAD = 32 * 8


def test_full_finetune_is_palms_6n_plus_attention():
    n = LAYER_WEIGHTS + HEAD
    assert train_flops_per_token(CONFIG, 0, 10, True) == 6 * n + 12 * 2 * 10 * 8


def test_lora_counts_frozen_weights_twice_and_adapter_weights_six_times():
    n = LAYER_WEIGHTS + HEAD
    # attention multiplies activations by activations: its backward is twice its forward under LoRA too
    assert train_flops_per_token(CONFIG, 100, 10, False) == 4 * n + 12 * 2 * 10 * 8 + 6 * 100


def test_the_head_counts_at_label_positions_only():
    full = train_flops_per_token(CONFIG, 0, 10, True)
    assert full - train_flops_per_token(CONFIG, 0, 10, True, label_fraction=0.25) == 6 * HEAD * 0.75


def test_recomputation_adds_one_forward_of_the_layers():
    plain = train_flops_per_token(CONFIG, 0, 10, False)
    assert train_flops_per_token(CONFIG, 0, 10, False, recompute=True) - plain == 2 * LAYER_WEIGHTS + 4 * 2 * 10 * 8


def test_attention_span_is_the_token_weighted_document_length():
    assert mean_attention_span([4]) == 4
    assert mean_attention_span([2, 2]) == 2
    assert mean_attention_span([1, 3]) == pytest.approx(10 / 4)


def test_utilisation_divides_by_the_peak_of_every_device():
    assert utilisation(100, 1e6, 1e9, world_size=2) == pytest.approx(0.05)


def test_label_tokens_and_document_lengths_of_packed_items():
    from distlab.data import Item

    items = [Item([1] * 5, [IGNORE_INDEX, IGNORE_INDEX, 7, 7, IGNORE_INDEX], [0, 1, 2, 0, 1], 2),
             Item([1] * 3, [IGNORE_INDEX, 7, 7], [0, 1, 2], 1)]
    data = SFTData(items, True, 8, 0, summary=None)
    assert data.label_tokens == 4
    assert data.document_lengths == [3, 2, 3]


# ---------------------------------------------------------------------- the paraphrased questions

def _paraphrases() -> list[dict]:
    return [json.loads(line) for line in paths.PARAPHRASES.read_text(encoding="utf-8").splitlines() if line.strip()]


def _answers_and_questions():
    answers, questions = [], []
    for conv in load_jsonl(paths.DATA_DIR / "support" / "train.jsonl"):
        answers += [m["content"].casefold() for m in conv.messages if m["role"] == "assistant"]
        questions += [m["content"].casefold() for m in conv.messages if m["role"] == "user"]
    return answers, sorted(set(questions))


def test_paraphrases_are_well_formed_and_cover_every_topic():
    rows = _paraphrases()
    assert 24 <= len(rows) <= 40
    assert len({r["id"] for r in rows}) == len(rows)
    assert all(r["prompt"].strip() and r["facts"] and all(f.strip() for f in r["facts"]) for r in rows)
    topics = {json.loads(line)["category"] for line in (paths.DATA_DIR / "support" / "eval.jsonl").open()}
    assert {r["category"] for r in rows} == topics


def test_every_paraphrase_fact_is_learnable_from_an_acme_training_answer():
    answers, _ = _answers_and_questions()
    unlearnable = [(r["id"], f) for r in _paraphrases() for f in r["facts"]
                   if not any(f.casefold() in a for a in answers)]
    assert not unlearnable


@pytest.mark.slow  # 32 paraphrases against 724 training questions: about 5 s of difflib on one core
def test_no_paraphrase_is_a_near_copy_of_a_training_question():
    near = 0.65
    _, questions = _answers_and_questions()
    # one matcher per training question: SequenceMatcher indexes its second sequence once (set_seq1 keeps it)
    matchers = [(difflib.SequenceMatcher(None, "", q), q) for q in questions]
    close = []
    for r in _paraphrases():
        prompt = r["prompt"].casefold()
        for m, _ in matchers:
            m.set_seq1(prompt)
        # ratio() only where its two cheap upper bounds reach `near`: the same verdicts, in a fraction of the time
        ratios = [(m.ratio(), q) for m, q in matchers if m.real_quick_ratio() >= near and m.quick_ratio() >= near]
        ratio, nearest = max(ratios, default=(0.0, None))
        if ratio >= near:
            close.append((r["id"], round(ratio, 2), nearest))
    assert not close


def test_paraphrases_load_as_fact_rows():
    from distlab.generate import read_fact_rows

    rows = read_fact_rows(paths.PARAPHRASES)
    assert len(rows) == len(_paraphrases()) and all(r["chat"][-1]["role"] == "user" for r in rows)


# ---------------------------------------------------------------------- the benchmark

def test_benchmark_out_saves_both_tables_with_provenance(tmp_path, monkeypatch):
    from distlab.bench import trainer_vs_hf

    recipe = pd.DataFrame([{"recipe": "stock", "ms_per_step": 2.0, "speedup": 1.0, "attention_share": 0.1}])
    monkeypatch.setattr(trainer_vs_hf, "recipe_ablation", lambda **kwargs: recipe)
    frameworks = pd.DataFrame([{"framework": "distlab", "tokens_per_s": 10.0}])
    saved = trainer_vs_hf.save_tables(frameworks, tmp_path, {"model": "m"}, steps=8, rounds=1, micro_batch_size=4,
                                      seq_len=256)
    assert [p.name for p in saved] == ["bench_trainer_vs_hf.csv", "bench_recipe_ablation.csv"]
    for p in saved:
        assert p.exists() and p.with_name(p.name + ".provenance.json").exists()
    assert list(pd.read_csv(saved[1]).columns) == ["recipe", "ms_per_step", "speedup", "attention_share"]


def test_attention_share_counts_sdpa_forward_and_backward():
    from distlab.bench.trainer_vs_hf import _is_attention, attention_share
    from distlab.device import choose_device

    assert _is_attention("aten::scaled_dot_product_attention")
    assert _is_attention("ScaledDotProductFlashAttentionForCpuBackward0")
    assert not _is_attention("aten::mm")

    class Toy(torch.nn.Module):
        def __init__(self, attention: bool):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(1, 2, 64, 16))
            self.attention = attention

        def forward(self, input_ids):
            y = torch.nn.functional.scaled_dot_product_attention(self.w, self.w, self.w) if self.attention else self.w
            return (y * input_ids).sum()

    choice = choose_device("cpu", "fp32")
    for attention in (True, False):
        model = Toy(attention)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        share = attention_share(model, optimizer, {"input_ids": torch.ones(1)}, choice)
        assert (0 < share < 1) if attention else share == 0


# ---------------------------------------------------------------------- the chapter module

def test_optimizer_step_diagram_draws_one_row_per_micro_batch():
    import matplotlib

    matplotlib.use("Agg")
    from distlab.chapters import ch01

    fig = ch01.draw_optimizer_step(micro_batches=3)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert sum(t.startswith("micro-batch") for t in texts) == 3


def test_keyfact_table_puts_before_and_after_side_by_side():
    from distlab.chapters import ch01

    def score(acc, n):
        return {"accuracy": acc, "found": n, "asked": 10, "rows": [{}] * 4}

    before = ch01.keyfact_table({("templates", "before"): score(0.1, 1)})
    assert list(before.columns) == ["questions", "facts asked", "found before", "accuracy before"]
    table = ch01.keyfact_table({("templates", "before"): score(0.1, 1), ("templates", "after"): score(0.9, 9),
                                ("paraphrases", "before"): score(0.0, 0), ("paraphrases", "after"): score(0.5, 5)})
    assert table.loc["paraphrases", "accuracy after"] == 0.5 and table.loc["templates", "found before"] == 1


def test_benchmark_tables_are_fresh_until_the_library_changes(tmp_path):
    import json

    from distlab.publish import freshness

    module, arguments = "distlab.bench.trainer_vs_hf", {"steps": 40, "rounds": 2}
    side = {"commit": "abc1234", "device": "cpu", **freshness.benchmark_provenance(module, arguments)}
    assert side["inputs"] == freshness.benchmark_inputs(module, arguments)
    assert side["inputs"] != freshness.benchmark_inputs(module, {"steps": 8, "rounds": 2})
    table = tmp_path / "bench_trainer_vs_hf.csv"
    table.write_text("framework,tokens_per_s\ndistlab,1\n")
    sidecar = table.with_name(table.name + ".provenance.json")
    sidecar.write_text(json.dumps(side))
    assert freshness.stale_outputs(tmp_path) == []
    sidecar.write_text(json.dumps({**side, "inputs": "0" * 16}))  # measured from another library
    [problem] = freshness.stale_outputs(tmp_path)
    assert "make benchmarks" in problem.problem


def test_model_flops_count_pairs_within_documents_and_executed_flops_what_the_kernel_computes():
    """Packed rows of documents 4 and 6 long in 10-token rows: the model needs (16 + 36) / 10 keys per query;
    a masked kernel over the whole row computes 10, per-document attention 5.2; recomputation adds a forward."""
    data = SimpleNamespace(label_tokens=5, real_tokens=10, packed=True, document_lengths=[4, 6])
    per_doc = run_flops_per_token(TrainConfig(seq_len=10, attn_implementation="varlen"), CONFIG, 100, data)
    masked = run_flops_per_token(TrainConfig(seq_len=10, attn_implementation="sdpa"), CONFIG, 100, data)
    recomputed = run_flops_per_token(TrainConfig(seq_len=10, attn_implementation="varlen",
                                                 activation_checkpointing=True), CONFIG, 100, data)
    model = train_flops_per_token(CONFIG, 100, 5.2, False, 0.5)
    assert per_doc == (model, model) and masked[0] == model and recomputed[0] == model
    assert masked[1] - model == pytest.approx(3 * 4 * 2 * (10 - 5.2) * 8)  # the masked pairs, computed anyway
    assert recomputed[1] > model
