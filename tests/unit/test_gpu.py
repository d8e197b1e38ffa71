"""Checks that need a CUDA GPU; skipped (said so) everywhere else. tools/gpu_session.sh runs them on a lent GPU."""

from __future__ import annotations

import pytest
import torch

from distlab import attention

# slow: a CUDA step takes seconds (10 s on the lent H200, tools/gpu_session.sh), over the limit of an unmarked test
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.slow]


def _packed_position_ids(lengths_per_row: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths_per_row])


@pytest.mark.skipif(attention._varlen_attn is None, reason="this PyTorch has no torch.nn.attention.varlen")
def test_flash_varlen_equals_document_by_document_sdpa_forward_and_backward():
    """The CUDA path (one flash varlen call for the micro-batch) against the SDPA loop in float64 on the CPU."""
    gen = torch.Generator().manual_seed(0)
    position_ids = _packed_position_ids([[37, 100, 91], [228]])  # documents of unequal lengths; one alone
    shape = (2, 4, 228, 64)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3))
    grad_out = torch.randn(2, 228, 4, 64, generator=gen, dtype=torch.float64)

    def run(device, dtype):
        leaves = [t.detach().to(device, dtype).clone().requires_grad_() for t in (q, k, v)]
        out, _ = attention._varlen(*leaves, position_ids.to(device), 0.0, 64 ** -0.5)
        out.backward(grad_out.to(device, dtype))
        return [out.detach().double().cpu()] + [t.grad.double().cpu() for t in leaves]

    reference = run("cpu", torch.float64)
    for got, want in zip(run("cuda", torch.bfloat16), reference):
        assert torch.linalg.norm(got - want) / torch.linalg.norm(want) < 2e-2  # bf16 operands
    with torch.autocast("cuda", dtype=torch.bfloat16):  # fp32 inputs under autocast take the flash path too
        for got, want in zip(run("cuda", torch.float32), reference):
            assert torch.linalg.norm(got - want) / torch.linalg.norm(want) < 2e-2


def test_train_step_runs_on_cuda_in_bf16_autocast(tmp_path):
    """The bring-up of GPU.md: the tiny config trains on the GPU and its loss falls."""
    from distlab.config import load_config
    from distlab.metrics import read_log
    from distlab.paths import REPO_ROOT
    from distlab.train import train

    cfg = load_config(REPO_ROOT / "lib/distlab/configs/tiny_lora.yaml").replace(
        device="cuda", dtype="bf16-autocast", max_steps=30, logging_steps=1, output_dir=str(tmp_path),
        eval_at_start=False, eval_at_end=False, save_model=False, progress=False)
    train(cfg)
    losses = [s["loss"] for s in read_log(tmp_path / "train_log.jsonl")]
    assert len(losses) == 30 and losses[-1] < losses[0]
