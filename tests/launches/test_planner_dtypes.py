"""The memory planner against measured bytes in every dtype the trainer accepts: fp32, bf16 (weights
stored in bf16), bf16-autocast and fp16-autocast (torch 2.13 runs fp16 autocast on CPU too), for single,
DDP, FSDP, ZeRO-2 and ZeRO-3, LoRA and full fine-tuning. One launch per strategy runs every dtype and
mode back to back (local.launch_sweep); each rank's weights, adapters, gradients and optimizer state must
match plan_memory(dtype=...) within 5%. Then the ZeRO paper's per-parameter formulas against both.
"""

from __future__ import annotations

import pytest

from distlab.config import LORA_TARGETS, TrainConfig
from distlab.device import DTYPE_ALIASES, choose_device
from distlab.launch.local import launch_sweep
from distlab.planning import plan, shapes, zero_paper
from distlab.results import extract

STRATEGIES = ["single", "ddp", "fsdp", "zero2", "zero3"]
MODES = ["lora", "full"]
PARTS = ("weights", "adapter_weights", "gradients", "optimizer_state")
STATE_RTOL = 0.05
# Two steps: ZeRO's state point is before its optimizer step, so AdamW's moments exist from step 2 on.
COMMON = {"max_steps": 2, "micro_batch_size": 2, "seq_len": 64, "logging_steps": 1, "warmup_steps": 1,
          "lora_dropout": 0.0, "eval_file": None, "eval_at_start": False, "eval_at_end": False, "save_model": False,
          "measure_state": True, "device": "cpu"}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """(strategy, dtype, mode) -> rank -> state_bytes, from one launch per strategy."""
    root = tmp_path_factory.mktemp("dtypes")
    out = {}
    for strategy in STRATEGIES:
        world = 1 if strategy == "single" else 2
        variants = {f"{strategy}_{d}_{m}": {"dtype": d, "lora": m == "lora"}
                    for d in plan.TRAINER_DTYPES for m in MODES}
        launch_sweep(f"dtypes_{strategy}", world, {**COMMON, "strategy": strategy, "global_batch_size": 2 * world},
                     variants, runs_dir=root, echo=False, timeout_s=600)
        results = extract.collect_sweep(root / f"dtypes_{strategy}", world)
        assert list(results) == list(variants), strategy
        for name, extra in variants.items():
            out[(strategy, extra["dtype"], "lora" if extra["lora"] else "full")] = {
                rank: rec["state_bytes"] for rank, rec in results[name].items()}
    return out


def test_the_planner_knows_every_dtype_the_trainer_accepts():
    with pytest.raises(ValueError, match="expected one of") as err:
        choose_device("cpu", "no-such-dtype")  # the trainer's table of dtypes, named in its error
    accepted = str(err.value).split("expected one of ")[1].split(", ")
    assert set(accepted) - set(DTYPE_ALIASES) == set(plan.TRAINER_DTYPES)  # aliases resolve to one of them
    for dtype in plan.TRAINER_DTYPES:
        TrainConfig(dtype=dtype)
        choose_device("cpu", dtype)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_owned_state_bytes_match_the_planner_in_every_dtype(measured, strategy, tiny_model):
    """Per dtype, mode, rank and component: within 5% (the layouts are exact: they match to the byte)."""
    world = 1 if strategy == "single" else 2
    for dtype in plan.TRAINER_DTYPES:
        for mode in MODES:
            for rank, got in measured[(strategy, dtype, mode)].items():
                planned = plan.plan_memory(tiny_model.config, strategy=strategy, world_size=world, rank=rank,
                                           dtype=dtype, lora_r=16 if mode == "lora" else None,
                                           lora_targets=LORA_TARGETS)
                for part in PARTS:
                    assert got[part] == pytest.approx(getattr(planned, part), rel=STATE_RTOL, abs=1), \
                        (strategy, dtype, mode, rank, part, got)


def test_what_each_dtype_stores(measured, tiny_model):
    """The rules the planner follows, seen in the measured bytes."""
    n = shapes.parameter_count(tiny_model.config)
    n_lora = shapes.lora_parameter_count(tiny_model.config, 16, LORA_TARGETS)
    single = {d: measured[("single", d, m)][0] for d in plan.TRAINER_DTYPES for m in ["full"]}
    # bf16 storage: bf16 weights, gradients and torch AdamW moments (2 + 2 + 4 bytes); autocast keeps fp32
    assert (single["bf16"]["weights"], single["bf16"]["gradients"], single["bf16"]["optimizer_state"]) == \
        (2 * n, 2 * n, 4 * n)
    for dtype in ("fp32", "bf16-autocast", "fp16-autocast"):
        assert (single[dtype]["weights"], single[dtype]["optimizer_state"]) == (4 * n, 8 * n)
    # PEFT keeps adapters in fp32 over a bf16 base; DeepSpeed's bf16 mode (bf16-autocast) casts them to bf16
    assert measured[("ddp", "bf16", "lora")][0]["adapter_weights"] == 4 * n_lora
    assert measured[("zero3", "bf16-autocast", "lora")][0]["gradients"] < \
        measured[("zero3", "fp32", "lora")][0]["gradients"]


@pytest.mark.parametrize("dtype", ["bf16-autocast", "fp32"])
@pytest.mark.parametrize("mode", MODES)
def test_zero_paper_formulas_against_planner_and_measured(measured, tiny_model, dtype, mode):
    """The ZeRO paper's (2 + 2 + K) Psi split over N_d, next to the planner and the measured rank 0."""
    cfg, lora_r = tiny_model.config, (16 if mode == "lora" else None)
    got = {s: measured[(s, dtype, mode)][0] for s in ("ddp", "zero2", "zero3")}
    table = zero_paper.zero_paper_table(cfg, world_size=2, dtype=dtype, lora_r=lora_r, lora_targets=LORA_TARGETS,
                                        measured=got)
    r = table.set_index(["strategy", "component"])["planner / paper"]
    seen = table.dropna(subset=["measured / planner"])
    assert ((seen["measured / planner"] - 1).abs() <= STATE_RTOL).all(), seen
    # optimizer state: K = 12 bytes on 1/N_d of the trained weights (fp32 master + 2 fp32 moments), up to padding
    for s in ("zero2", "zero3"):
        assert r[(s, "optimizer_state")] == pytest.approx(1.0, abs=1e-3)
    # DDP: no master copy (fp32 weights are their own), so only 8 of the K bytes, on every weight
    assert r[("ddp", "optimizer_state")] == pytest.approx(8 / 12)
    # ZeRO-3 keeps tensors under the persistence threshold whole on every rank: more than 2 Psi / N_d
    assert r[("zero3", "params")] > 1.1
    if dtype == "bf16-autocast":  # DeepSpeed's bf16 mode is the paper's mixed precision
        assert r[("zero2", "params")] == pytest.approx(1.0, abs=1e-3)
        assert r[("zero3", "gradients")] == pytest.approx(1.0, abs=1e-3)
        assert 1.0 <= r[("zero2", "gradients")] < 1.25  # whole tensors straddling the partition boundary
    else:  # fp32: 4-byte weights and gradients, and DeepSpeed still keeps an fp32 master copy
        assert r[("zero2", "params")] == pytest.approx(2.0, abs=1e-3)
        assert r[("zero3", "gradients")] == pytest.approx(2.0, abs=1e-3)
    if mode == "full":  # DDP with fp32 weights: 4 + 4 + 8 bytes, the paper's 2 + 2 + 12 split otherwise
        assert r[("ddp", "total")] == pytest.approx(1.0)
    text = zero_paper.explain_zero_paper(table, cfg, dtype=dtype, lora_r=lora_r, lora_targets=LORA_TARGETS)
    assert "persistence" in text and f"{r[('zero3', 'params')]:.2f}x" in text
