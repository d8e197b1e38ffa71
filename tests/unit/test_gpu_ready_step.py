"""The training step a GPU can run without waiting on the host, checked on a CPU: document boundaries and label
positions built in the collate, no host read inside a step, each block compiled whole (no graph break, no
recompile after the first batch whatever the documents' layout), and cross entropy a slice of rows at a time
with the plain version's loss and gradients."""

from __future__ import annotations

import contextlib
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from distlab import attention, lm_loss
from distlab.batching import StepBatches
from distlab.config import TrainConfig
from distlab.data import IGNORE_INDEX, collate, document_bounds, label_positions
from distlab.models import QWEN25_05B_SHAPE
from distlab.paths import REPO_ROOT
from distlab.prepare import prepare_run
from distlab.strategies import make_strategy
from distlab.strategies.base import compile_layers

HOST_READS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__")


@contextlib.contextmanager
def no_host_reads():
    """Every Tensor method that reads a value back to the host raises. The one read allowed is the CPU attention
    kernel's own (attention.host_boundaries): the CPU stand-in for flash-attention reading cu_seqlens."""
    tolist = torch.Tensor.tolist
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    kernel_read = attention.host_boundaries

    def refuse(name):
        def method(self, *args, **kwargs):
            raise AssertionError(f"host read inside a training step: Tensor.{name}")
        return method

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, refuse(name))
        attention.host_boundaries = lambda cu: tolist(cu)
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
        attention.host_boundaries = kernel_read


def test_collate_builds_document_bounds_and_label_positions_on_the_host():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 0, 1, 2]])
    bounds = document_bounds(pos)
    assert bounds["cu_seq_lens_q"].tolist() == [0, 3, 5, 8, 13, 16] and bounds["cu_seq_lens_q"].dtype == torch.int32
    assert bounds["max_length_q"] == 8  # the row width: the same bound for every batch
    labels = torch.tensor([[IGNORE_INDEX, 5, 6, IGNORE_INDEX], [IGNORE_INDEX, IGNORE_INDEX, 7, IGNORE_INDEX]])
    picked = label_positions(labels)
    # position t is kept when token t + 1 is a label: rows flattened, width 4
    assert picked["label_index"].tolist() == [0, 1, 5] and picked["label_targets"].tolist() == [5, 6, 7]


def test_collated_label_positions_pick_what_the_mask_picks(tokenizer):
    from distlab.data import build_sft_data  # deferred: the data set, for this test only

    cfg = TrainConfig()
    data = build_sft_data(cfg.train_file, tokenizer, cfg.seq_len, True, cfg.overlong)
    batch = data.batch([0, 1, 2])
    hidden = torch.randn(*batch["input_ids"].shape, 8)
    keep = batch["labels"][:, 1:] != IGNORE_INDEX
    by_mask, by_index = hidden[:, :-1][keep], hidden.reshape(-1, 8)[batch["label_index"]]
    assert torch.equal(by_mask, by_index) and batch["n_label_tokens"] == len(batch["label_targets"])
    assert torch.equal(batch["labels"][:, 1:][keep], batch["label_targets"])
    assert len(batch["cu_seq_lens_q"]) > len(batch["input_ids"]) + 1, "rows must hold several documents"


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("weight_trains", [False, True])
def test_chunked_cross_entropy_equals_the_plain_one(monkeypatch, autocast, weight_trains):
    monkeypatch.setattr(lm_loss, "CHUNK_ELEMENTS", 1000 * 64)  # 64 rows a slice: 300 rows take five
    torch.manual_seed(0)
    weight = torch.randn(1000, 32, requires_grad=weight_trains)
    rows, targets = torch.randn(300, 32, requires_grad=True), torch.randint(0, 1000, (300,))
    grads = []
    for loss_of in (lm_loss.chunked_cross_entropy_sum,
                    lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t, reduction="sum")):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_of(rows, weight, targets)
        loss.backward(torch.tensor(0.5))  # the loop scales the summed loss: the backward must follow
        grads.append((loss.detach(), rows.grad, weight.grad))
        rows.grad, weight.grad = None, None
    (loss, grad_rows, grad_weight), (want, want_rows, want_weight) = grads
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad_rows, want_rows, rtol=1e-5, atol=1e-6)
    if weight_trains:
        # under autocast the plain weight gradient is one bf16 matmul; the chunked one sums the slices in fp32
        tolerance = 2e-2 * want_weight.abs().max().item() if autocast else 1e-5
        torch.testing.assert_close(grad_weight, want_weight, rtol=0, atol=tolerance)
    else:
        assert grad_weight is None


def test_chunked_cross_entropy_never_holds_every_rows_logits(monkeypatch):
    """The largest fp32 tensor a chunked loss makes is one slice of logits, not rows x vocabulary."""
    monkeypatch.setattr(lm_loss, "CHUNK_ELEMENTS", 500 * 50)
    weight, rows = torch.randn(500, 16, requires_grad=True), torch.randn(400, 16, requires_grad=True)
    largest = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: largest.append(t.numel()) or t, lambda t: t):
        loss = lm_loss.chunked_cross_entropy_sum(rows, weight, torch.randint(0, 500, (400,)))
    loss.backward()
    # what the backward keeps: the two gradients, rows x hidden and vocabulary x hidden, never rows x vocabulary
    assert largest and max(largest) <= max(400 * 16, 500 * 16)


def _prepared(cfg: TrainConfig):
    strategy = make_strategy(cfg.strategy)
    strategy.setup(cfg)
    choice, _, data, _, model = prepare_run(cfg, strategy)
    model, optimizer, scheduler = strategy.prepare(model, choice, cfg)
    return strategy, choice, data, model, optimizer, scheduler


@pytest.mark.slow
def test_a_compiled_step_reads_nothing_on_the_host_and_never_recompiles(tmp_path):
    """The tiny LoRA step with every block compiled (fullgraph) and fused AdamW: after the first step (the
    compile), steps over batches of other document layouts neither recompile nor read the device. (Fused AdamW
    keeps its step counter on the device; the per-tensor AdamW reads a host-side counter, no device sync.)"""
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), attn_implementation="varlen", micro_batch_size=2,
                      grad_accum=2, seq_len=128, fused_optimizer=True, compile=True, eval_at_start=False)
    strategy, choice, data, model, optimizer, scheduler = _prepared(cfg)
    batches = StepBatches(len(data), 2, 2, 1, 0, cfg.seed)
    layouts, losses = set(), []
    counters.clear()
    with contextlib.ExitStack() as warm:
        for step in range(6):
            micro = [data.batch(rows) for rows in batches.next_step()]  # the collate is the host's work
            layouts.update(len(b["cu_seq_lens_q"]) for b in micro)
            labels = sum(b["n_label_tokens"] for b in micro)
            if step == 1:  # warm: from here on a recompile raises
                graphs = counters["stats"]["unique_graphs"]
                warm.enter_context(torch._dynamo.config.patch(error_on_recompile=True))
            with no_host_reads() if step >= 1 else contextlib.nullcontext():
                loss, _ = strategy.train_step(model, micro, choice, labels, optimizer, scheduler, cfg.max_grad_norm)
            losses.append(float(loss))
    assert len(layouts) >= 2, f"the batches must differ in their number of documents: {layouts}"
    assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]
    assert all(map(torch.isfinite, torch.tensor(losses)))


@pytest.mark.slow
def test_the_half_billion_block_compiles_whole_and_never_recompiles():
    """Qwen2.5-0.5B's block shape (hidden 896, 14 query and 2 key/value heads, FFN 4864), 2 layers, full fine-
    tuning: compiled whole, batches of other document layouts run without a recompile; the loss and gradients
    equal the eager block's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM  # deferred: transformers is slow to import

    torch.manual_seed(0)
    config = Qwen2Config(**{**QWEN25_05B_SHAPE, "num_hidden_layers": 2, "vocab_size": 4096},
                         attn_implementation=attention.resolve("varlen"))
    eager = lm_loss.CausalLMWithLoss(Qwen2ForCausalLM(config))
    compiled = lm_loss.CausalLMWithLoss(Qwen2ForCausalLM(config))
    compiled.load_state_dict(eager.state_dict())
    assert compile_layers(compiled) == 2

    def batch(lengths):
        items = []
        for row in lengths:
            ids = torch.randint(0, 4096, (sum(row),)).tolist()
            positions = [p for n in row for p in range(n)]
            items.append(type("Item", (), {"input_ids": ids, "labels": ids, "position_ids": positions,
                                           "n_samples": len(row)}))
        return collate(items, 0, packed=True, pad_to=96)

    counters.clear()
    layouts = [[[40, 30, 26], [96]], [[10, 20, 30, 36], [50, 46]], [[96], [1, 95]], [[20] * 4 + [16], [60, 36]]]
    for i, lengths in enumerate(layouts):
        b = batch(lengths)
        if i == 1:
            graphs = counters["stats"]["unique_graphs"]
        results = []
        with torch._dynamo.config.patch(error_on_recompile=i >= 1):  # warm after the first batch
            for model in (eager, compiled):
                model.zero_grad(set_to_none=True)
                loss = model(**{k: b[k] for k in ("input_ids", "labels", "position_ids", "cu_seq_lens_q",
                                                  "max_length_q", "label_index", "label_targets")})
                loss.backward()
                results.append((loss.detach(), model.lm.model.layers[0].mlp.down_proj.weight.grad.clone()))
        torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-4, atol=0)
        torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-3, atol=1e-3 * results[0][1].abs().max())
    assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]


def test_the_other_torch_check_parses_lints_and_says_its_usage():
    """tools/check_other_torch.sh (these tests under another torch release): valid bash, clean under shellcheck
    where it is installed (make test installs it), and one usage line when called without a version."""
    script = REPO_ROOT / "tools" / "check_other_torch.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(script)], check=True)
    bare = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30)
    assert bare.returncode != 0 and "usage: bash tools/check_other_torch.sh <torch version" in bare.stderr, bare.stderr
