"""Tensor parallelism (chapter 07) under torchrun: the notebook's by-hand split against one device, the `tp` run
(with and without sequence parallelism) against one device, the bytes a step sends under ddp, fsdp, tp and tp +
sequence parallelism, formula against counted, LoRA dropout on a replicated block input keeping the replicas equal,
and the 2-D `fsdp_tp` layout that chapter 08 runs (its loss under sequence parallelism and LoRA). The strategy's
registration, refusals and plans, in one process: tests/unit/test_tensor_parallel.py."""

from __future__ import annotations

import pytest

from distlab import lessons, paths
from distlab.chapters import ch07
from distlab.launch import local, scripts
from distlab.models import load_model
from distlab.planning import plan
from distlab.results import extract
from helpers import notebook_scripts

NOTEBOOK = paths.NOTEBOOKS_DIR / "07_tensor_parallel.ipynb"


def test_the_notebook_scripts_match_one_device_under_torchrun(tmp_path):
    written = notebook_scripts(NOTEBOOK, tmp_path)
    by_hand = scripts.run_script(written["check_by_hand.py"], nproc=2, timeout_s=300)
    assert (ch07.differences(by_hand) < 1e-5).all().all()
    assert all(b["forward_calls"] == b["backward_calls"] == 1 for b in by_hand.values())
    dtensor = scripts.run_script(written["dtensor_layer.py"], nproc=2, timeout_s=300)
    for run in (dtensor, dtensor["block_input"]):
        assert max(run["output"], run["input_grad"], run["q_proj_grad"]) < 1e-5
    assert [len(dtensor[p]) for p in ("forward", "backward")] == [2, 5], "per projection: 5 sums in backward"
    assert [len(dtensor["block_input"][p]) for p in ("forward", "backward")] == [2, 2], "one per block: Megatron's"
    vocab = scripts.run_script(written["vocab_parallel_loss.py"], nproc=2, timeout_s=300)
    assert vocab["by_hand"]["loss"] < 1e-6 and vocab["by_hand"]["logit_grad"] < 1e-6
    assert [op for op, _ in vocab["by_hand"]["calls"]] == ["all_reduce"] * 3, "max, sum of exp, target logit"
    assert vocab["model"]["loss"] < 1e-6 and vocab["model"]["embedding_grad"] < 1e-5 and vocab["model"]["tied"]


LORA = {"lora": True, "lora_dropout": 0.0}


def test_tp_training_has_the_loss_of_one_device(tmp_path):
    """tp, tp + sequence parallelism (full fine-tuning and LoRA) and tp + vocabulary parallelism in one launch
    (one interpreter start), each against one device."""
    common = {"lora": False, "max_steps": 3, "micro_batch_size": 2, "grad_accum": 1, "seq_len": 128, "lr": 1e-3,
              "logging_steps": 1, "eval_at_start": False, "eval_at_end": False, "save_model": False}
    single = local.launch_sweep("t07_single_runs", 1, {**common, "strategy": "single"},
                                {"t07_single": {}, "t07_single_lora": LORA}, runs_dir=tmp_path, scripts_dir=tmp_path,
                                echo=False)
    runs = local.launch_sweep("t07_tp_runs", 2, {**common, "strategy": "tp"},
                              {"t07_tp": {"save_model": True}, "t07_tp_lora": LORA,
                               "t07_tp_sp": {"sequence_parallel": True},
                               "t07_tp_sp_lora": {**LORA, "sequence_parallel": True},
                               "t07_tp_vocab": {"vocab_parallel": True, "measure_state": True, "eval_at_end": True}},
                              runs_dir=tmp_path, scripts_dir=tmp_path, echo=False)
    tp = runs["t07_tp"]
    for name, job in runs.items():
        reference = single["t07_single_lora" if name.endswith("lora") else "t07_single"]
        losses = lessons.loss_comparison(reference.log, job.log)
        assert len(losses) == 3 and losses["difference"].max() < 1e-5, name
    # the vocabulary split: each rank holds half the embedding (tied to the head) and its moments, as planned
    config = load_model(None).config
    vocab_run = extract.collect_sweep(tmp_path / "t07_tp_runs", 2)["t07_tp_vocab"]
    for rank, rec in vocab_run.items():
        planned = plan.plan_memory(config, strategy="tp", world_size=2, rank=rank, dtype="fp32", vocab_parallel=True)
        whole = plan.plan_memory(config, strategy="tp", world_size=2, rank=rank, dtype="fp32")
        assert planned.weights < whole.weights - 0.4 * config.vocab_size * config.hidden_size * 4
        for part in ("weights", "gradients", "optimizer_state"):
            assert rec["state_bytes"][part] == pytest.approx(getattr(planned, part), rel=0.05), (rank, part)
    saved = load_model(tp.output_dir / "model")  # rank 0 wrote whole weights, gathered from the slices
    cfg = saved.config
    assert saved.model.layers[0].mlp.down_proj.weight.shape == (cfg.hidden_size, cfg.intermediate_size)


def test_fsdp_tp_with_sequence_parallelism_and_lora_has_the_loss_of_one_device(tmp_path):
    """The 2-D layout (2 x 2, four ranks oversubscribed on two cores) with sequence parallelism and LoRA: the
    frozen norms stay frozen (torch's SequenceParallel re-registers their weights as trainable) and the loss is
    one device's."""
    common = {**LORA, "max_steps": 2, "micro_batch_size": 2, "global_batch_size": 4, "seq_len": 128, "lr": 1e-3,
              "logging_steps": 1, "eval_at_start": False, "eval_at_end": False, "save_model": False}
    single = local.launch_training("t07_single_lora4", 1, {**common, "strategy": "single"}, runs_dir=tmp_path,
                                   scripts_dir=tmp_path, echo=False)
    two_d = local.launch_training("t07_fsdp_tp_sp_lora", 4, {**common, "strategy": "fsdp_tp", "tp_size": 2,
                                                              "sequence_parallel": True},
                                  runs_dir=tmp_path, scripts_dir=tmp_path, echo=False)
    losses = lessons.loss_comparison(single.log, two_d.log)
    assert len(losses) == 2 and losses["difference"].max() < 1e-5  # trained norms would differ from step 2


def test_each_strategy_sends_what_its_formula_says():
    """One counting launch: ddp, fsdp, tp, tp + sequence parallelism and tp + the vocabulary split, one step each on
    the same batch."""
    measured = ch07.measure_step_bytes(rows=2, seq_len=64, timeout_s=300)
    table = ch07.step_bytes_table(measured, load_model(None).config)
    assert (table["measured / formula"] - 1).abs().max() < 1e-9, table
    assert (table["step loss"] - table.loc["ddp", "step loss"]).abs().max() < 1e-5, "the same step, five splits"
    sp_calls = {op for op, _, _ in measured["runs"]["tp + sequence parallel"]["calls"]}
    assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= sp_calls


DROPOUT_SCRIPT = '''
import json
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from distlab.config import TrainConfig
from distlab.lm_loss import CausalLMWithLoss
from distlab.models import load_model
from distlab.prepare import apply_lora, seed_everything
from distlab.strategies.tp import apply_tp_plan

mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
seed_everything(0)
model = CausalLMWithLoss(apply_lora(load_model(None), TrainConfig(lora=True, lora_dropout=0.2)))
apply_tp_plan(model, mesh)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=False)
rows = torch.randint(0, 1000, (2, 32))
for _ in range(3):
    model(input_ids=rows, labels=rows).backward()
    for p in model.parameters():  # the replicated factors' partial gradients summed, as the strategy does
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
            p.grad = p.grad.redistribute(p.grad.device_mesh, p.placements)
    optimizer.step()
    optimizer.zero_grad()
a = next(p for n, p in model.named_parameters() if "layers.0.self_attn.q_proj.lora_A" in n)
local = a.to_local().detach().clone()
other = [torch.empty_like(local) for _ in range(2)]
dist.all_gather(other, local)
if dist.get_rank() == 0:
    print("RESULT", json.dumps({"replica_gap": (other[0] - other[1]).abs().max().item(),
                                "placement": str(a.placements), "moved": (local.abs().sum() > 0).item()}))
dist.destroy_process_group()
'''


def test_lora_dropout_on_a_replicated_block_input_keeps_the_replicas_equal(tmp_path):
    """q_proj's lora_A, whole on both ranks, reads the block input as a DTensor through LoRA's dropout: both ranks
    must drop the same elements, or the two copies of one replicated weight drift apart step by step."""
    script = tmp_path / "dropout_tp.py"
    script.write_text(DROPOUT_SCRIPT)
    result = scripts.run_script(script, nproc=2, timeout_s=300)
    assert result["placement"] == "(Replicate(),)" and result["moved"]
    assert result["replica_gap"] == 0.0
