"""distlab's two speed-ups of the LoRA step: per-document attention and 16-bit dropout coins.
Both must compute what the stock versions compute (the same math, or the same distribution)."""

from __future__ import annotations

import pytest
import torch

from distlab.attention import VARLEN, document_spans, varlen_attention
from distlab.config import TrainConfig
from distlab.data import build_sft_data, model_inputs
from distlab.device import choose_device, native_bf16
from distlab.dropout import Dropout16, replace_lora_dropout
from distlab.lm_loss import CausalLMWithLoss
from distlab.models import load_model
from distlab.prepare import apply_lora


def test_document_spans_follow_restarting_positions():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8], [1, 1, 1, 0, 1, 2, 3, 4, 5]])
    assert document_spans(pos) == [[(0, 3), (3, 5), (5, 9)], [(0, 9)], [(0, 1), (1, 2), (2, 3), (3, 9)]]


def _loss_and_grads(impl: str, batch):
    torch.manual_seed(0)
    model = CausalLMWithLoss(load_model(None, attn_implementation=impl))
    loss = model(**model_inputs(batch, torch.device("cpu")))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_varlen_attention_matches_sdpa_with_the_packing_mask(tokenizer):
    cfg = TrainConfig()
    data = build_sft_data(cfg.train_file, tokenizer, cfg.seq_len, True, cfg.overlong)
    batch = data.batch([0, 1, 2, 3])
    assert any(len(row) > 1 for row in document_spans(batch["position_ids"])), "rows must hold several documents"
    ref_loss, ref_grads = _loss_and_grads("sdpa", batch)
    loss, grads = _loss_and_grads("varlen", batch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-4 * g.abs().max().item(), msg=name)


def test_varlen_attention_runs_in_fp32_under_cpu_bf16_autocast():
    """PyTorch's CPU flash-attention backward is slow in bf16, so under autocast the attention is
    computed in fp32 and handed back in the caller's dtype."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 12, 16).bfloat16() for _ in range(3))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]] * 2)
    module = torch.nn.Module().eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = varlen_attention(module, q, k, v, None, position_ids=positions)
    ref, _ = varlen_attention(module, q.float(), k.float(), v.float(), None, position_ids=positions)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref.bfloat16())


def test_varlen_attention_runs_in_fp32_with_bf16_weights_on_cpu():
    """DeepSpeed's bf16 mode hands attention bf16 queries without autocast: it too runs in fp32, since CPU's bf16
    attention backward keeps a kernel per document length (a resident-memory leak over a packed run)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 12, 16).bfloat16().requires_grad_() for _ in range(3))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]] * 2)
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(query, *args, **kwargs):
        seen.append(query.dtype)
        return sdpa(query, *args, **kwargs)

    module = torch.nn.Module().eval()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
        out, _ = varlen_attention(module, q, k, v, None, position_ids=positions)
    out.sum().backward()
    assert seen and set(seen) == {torch.float32} and out.dtype == q.grad.dtype == torch.bfloat16


def test_auto_bf16_picks_bf16_autocast_only_where_it_is_native():
    choice = choose_device("cpu", "auto-bf16")
    assert choice.dtype == torch.float32  # master weights stay fp32 either way
    assert choice.autocast_dtype == (torch.bfloat16 if native_bf16("cpu") else None)
    assert choose_device("cpu", "auto").autocast_dtype is None  # the distributed chapters' CPU default: fp32


def test_varlen_model_generates_like_sdpa_with_left_padding(tokenizer):
    """Generation: the prefill of left-padded rows goes per document (every pad alone), the decode
    steps fall back to SDPA with the cache's mask; the tokens must be the stock model's."""
    prompts = ["How do I reset my VPN password?", "Expense policy for a taxi at night, please, quickly"]
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(prompts, return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = "right"
    assert (enc["attention_mask"] == 0).any(), "the prompts must differ in length"
    outs = {}
    for impl in ("sdpa", "varlen"):
        model = load_model(None, attn_implementation=impl).eval()
        assert model.config._attn_implementation == (VARLEN if impl == "varlen" else "sdpa")
        with torch.no_grad():
            outs[impl] = model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert torch.equal(outs["varlen"], outs["sdpa"])


def test_dropout16_keeps_the_expected_fraction_and_mean():
    torch.manual_seed(1)
    drop = Dropout16(0.05)
    x = torch.ones(2000, 1000)
    y = drop(x)
    dropped = (y == 0).float().mean().item()
    assert abs(dropped - 0.05) < 0.002, dropped  # 2e6 coins: the standard error is 1.5e-4
    assert abs(y.mean().item() - 1.0) < 0.003  # inverted dropout: the expectation is unchanged
    assert torch.equal(y.unique(), torch.tensor([0.0, drop.scale]))
    torch.manual_seed(1)
    assert torch.equal(drop(x), y), "torch.manual_seed makes it reproducible"
    drop.eval()
    assert drop(x) is x
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        Dropout16(1.0)


def test_dropout16_gradient_is_the_mask_times_the_scale():
    torch.manual_seed(2)
    x = torch.randn(64, 33, requires_grad=True)  # an odd count: the last 64-bit draw is partly used
    y = Dropout16(0.3)(x)
    y.sum().backward()
    kept = y != 0
    assert torch.allclose(x.grad[kept], torch.full_like(x.grad[kept], 1 / (1 - 19661 / 65536)))
    assert torch.all(x.grad[~kept] == 0)


def test_lora_gets_dropout16_unless_switched_off():
    cfg = TrainConfig()
    fast = apply_lora(load_model(None), cfg)
    stock = apply_lora(load_model(None), cfg.replace(fast_dropout=False))
    n_layers = fast.base_model.model.config.num_hidden_layers
    assert sum(isinstance(m, Dropout16) for m in fast.modules()) == n_layers * len(cfg.lora_targets)
    assert not any(isinstance(m, Dropout16) for m in stock.modules())
    assert replace_lora_dropout(fast) == 0, "nothing left to swap"
    no_dropout = apply_lora(load_model(None), cfg.replace(lora_dropout=0.0))
    assert not any(isinstance(m, Dropout16) for m in no_dropout.modules())
