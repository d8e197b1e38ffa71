"""The memory planner from configs alone: the parameter layout it assumes is the real one (checked
against models built on the meta device, so 7B shapes cost nothing), the strategy rules hold, the
state measurer counts what a model holds, and the recommender walks the LAN-cluster guide's decision
tree with numbers. The planner against measured per-rank bytes of real 2-rank runs is in
tests/launches/test_fsdp_zero.py."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from distlab import compat, strategies
from distlab.config import LORA_TARGETS
from distlab.measure import state
from distlab.planning import advice, cards, plan, shapes

GIB = 2**30


def meta_model(shape: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(shape)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", list(shapes.CASE_STUDY_MODELS))
def test_layout_is_the_real_models_parameters(name):
    shape = shapes.CASE_STUDY_MODELS[name]
    model = meta_model(shape)
    real = [(n, tuple(p.shape)) for n, p in model.named_parameters()]  # a tied head appears once
    planned = [(p.name, p.shape) for p in shapes.parameter_layout(shape)]
    assert planned == real
    published = {"Llama-2-7B": 6.74e9, "Qwen2.5-7B-Instruct": 7.62e9, "Qwen2.5-3B-Instruct": 3.09e9,
                 "Qwen3-0.6B": 0.596e9}
    assert shapes.parameter_count(shape) == pytest.approx(published[name], rel=0.005)


def test_lora_layout_follows_peft(tiny_model):
    """PEFT's trainable adapters, in the order ZeRO-2 flattens them, for the tiny model (a real config object)."""
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(copy.deepcopy(tiny_model), LoraConfig(r=8, target_modules=["q_proj", "down_proj"]))
    real = [(n.replace("base_model.model.", "").replace(".base_layer", "").replace(".default", ""), tuple(p.shape),
             p.requires_grad) for n, p in peft.named_parameters()]
    planned = [(p.name, p.shape, p.trainable)
               for p in shapes.parameter_layout(tiny_model.config, 8, ["q_proj", "down_proj"])]
    assert planned == real
    assert shapes.lora_parameter_count(tiny_model.config, 8, ["q_proj", "down_proj"]) == \
        sum(p.numel() for p in peft.parameters() if p.requires_grad)


def test_planner_rules(tiny_model):
    cfg = tiny_model.config
    kw = dict(lora_r=None, micro_batch=2, seq_len=256)
    single = plan.plan_memory(cfg, strategy="single", **kw)
    ddp = plan.plan_memory(cfg, strategy="ddp", world_size=4, **kw)
    assert single.state == ddp.state and ddp.buffers == single.gradients  # DDP's buckets copy the gradients
    n = shapes.parameter_count(cfg)
    assert single.weights == single.gradients == 4 * n and single.optimizer_state == 8 * n
    for world in (2, 4):
        fsdp = plan.plan_memory(cfg, strategy="fsdp", world_size=world, **kw)
        zero2 = plan.plan_memory(cfg, strategy="zero2", world_size=world, **kw)
        zero3 = plan.plan_memory(cfg, strategy="zero3", world_size=world, **kw)
        assert fsdp.weights == pytest.approx(single.weights / world, rel=0.01)  # dim-0 shards, padded
        assert fsdp.optimizer_state == pytest.approx(single.optimizer_state / world, rel=0.01)
        assert zero2.weights == pytest.approx(single.weights, rel=0.001)  # replicated (flat, padded)
        assert zero2.optimizer_state == pytest.approx(12 * n / world, rel=0.01)  # fp32 master + 2 moments
        assert zero3.optimizer_state == pytest.approx(12 * n / world, rel=0.01)
        assert zero3.weights > fsdp.weights  # small tensors stay whole under ZeRO-3's persistence threshold
        for b in (fsdp, zero2):
            assert b.activations == single.activations  # sharding state does not shard activations
        # ZeRO-3's head weight is a partition the chunked loss cannot read: its loss is the plain cross entropy
        plain = plan.plan_memory(cfg, strategy="single", **kw, cross_entropy="plain")
        assert zero3.activations == plain.activations > single.activations
    # The ranks of ZeRO-2 differ where a partition boundary cuts a tensor: the planner knows which.
    per_rank = [plan.plan_memory(cfg, strategy="zero2", world_size=2, rank=r, **kw).gradients for r in (0, 1)]
    assert per_rank[0] != per_rank[1] and max(per_rank) == plan.plan_memory(cfg, strategy="zero2",
                                                                               world_size=2, **kw).gradients


def test_pipeline_divides_layers_and_replicates_nothing_else():
    cfg = shapes.LLAMA2_7B
    whole = plan.plan_memory(cfg, strategy="single", lora_r=None, weight_bytes=2)
    stages = [plan.plan_memory(cfg, strategy="pipeline", world_size=4, pipeline_stages=4, rank=r, lora_r=None,
                               weight_bytes=2, grad_accum=8) for r in range(4)]
    assert sum(s.weights for s in stages) == pytest.approx(whole.weights)  # untied: every tensor on one stage
    assert stages[0].activations > stages[3].activations - (whole.activations - plan.plan_memory(
        cfg, strategy="single", lora_r=None, weight_bytes=2, loss_token_fraction=0.0).activations)  # 1F1B: 4 in flight
    with pytest.raises(ValueError, match="multiple of pipeline_stages"):
        plan.plan_memory(cfg, strategy="pipeline", world_size=6, pipeline_stages=4)


def test_dtypes_and_guards():
    cfg = shapes.QWEN25_7B
    bf16 = plan.plan_memory(cfg, dtype="bf16", lora_r=16)
    q4 = plan.plan_memory(cfg, dtype="4bit", lora_r=16)
    # PEFT keeps its adapters in fp32 over any 16-bit or quantised base (autocast_adapter_dtype)
    assert q4.adapter_weights == bf16.adapter_weights
    # a 4-bit base as bitsandbytes holds it: the projections at 4 bits + one 8-bit scale per 64 weights (double
    # quantisation); embedding and LM head in fp32 (prepare_model_for_kbit_training), which for Qwen2.5-7B's
    # 152k vocabulary is more than the projections: twice the flat "a quarter of bf16"
    frozen = [p for p in shapes.parameter_layout(cfg, 16) if not p.trainable]
    proj = sum(p.numel for p in frozen if p.name.split(".")[-2].endswith("_proj") and p.name.endswith("weight"))
    other = sum(p.numel for p in frozen) - proj
    assert q4.weights == pytest.approx(proj * (0.5 + 1 / 64) + other * 4, rel=0.01)
    assert q4.weights > 2 * bf16.weights / 4
    n_lora = shapes.lora_parameter_count(cfg, 16, LORA_TARGETS)
    assert bf16.adapter_weights == bf16.gradients == 4 * n_lora and bf16.optimizer_state == 8 * n_lora
    with pytest.raises(ValueError, match="only be trained through LoRA"):
        plan.plan_memory(cfg, dtype="4bit", lora_r=None)
    with pytest.raises(ValueError, match="unknown strategy"):
        plan.plan_memory(cfg, strategy="tensor")
    # DeepSpeed's bf16 mode: bf16 model, fp32 master copy in the optimizer state
    z3 = plan.plan_memory(cfg, strategy="zero3", world_size=8, dtype="bf16-autocast", lora_r=None)
    n = shapes.parameter_count(cfg)
    assert z3.optimizer_state == pytest.approx(12 * n / 8, rel=0.01)


def test_every_strategy_has_a_planner_and_ds_pipeline_plans_like_pipeline():
    assert set(plan.PLANNERS) == set(strategies.STRATEGY_NAMES)
    cfg = shapes.QWEN3_06B
    for rank in range(4):
        kw = dict(world_size=4, pipeline_stages=2, rank=rank, lora_r=16, grad_accum=4)
        torch_pp = plan.plan_memory(cfg, strategy="pipeline", **kw)
        assert plan.plan_memory(cfg, strategy="ds_pipeline", **kw).as_dict() == torch_pp.as_dict()


def test_pipeline_planner_follows_stage_layers():
    cfg = shapes.LLAMA2_7B  # 32 layers, untied
    kw = dict(strategy="pipeline", world_size=2, lora_r=None, weight_bytes=2)
    balanced = [plan.plan_memory(cfg, rank=r, **kw) for r in (0, 1)]
    uneven = [plan.plan_memory(cfg, rank=r, stage_layers=[8, 24], **kw) for r in (0, 1)]
    layer = sum(p.numel for p in shapes.parameter_layout(cfg) if p.name.startswith("model.layers.0.")) * 2
    assert uneven[0].weights == balanced[0].weights - 8 * layer and uneven[1].weights == balanced[1].weights + 8 * layer
    assert "layers 0-7" in uneven[0].notes[0] and "layers 8-31" in uneven[1].notes[0]
    with pytest.raises(ValueError, match="stage_layers"):
        plan.plan_memory(cfg, rank=0, stage_layers=[8, 8], **kw)


def test_estimate_is_the_single_device_plan(tiny_model):
    kw = dict(lora_r=16, micro_batch=2, seq_len=256)
    est = plan.estimate_training_memory(tiny_model.config, lora_dropout=0.0, **kw)
    single = plan.plan_memory(tiny_model.config, strategy="single", lora_targets=LORA_TARGETS, **kw)
    assert est.as_dict() == single.as_dict()
    # chapter 01's defaults: fp32 weights and adapters, LoRA dropout on (its input and mask are kept)
    n = shapes.parameter_count(tiny_model.config)
    n_lora = shapes.lora_parameter_count(tiny_model.config, 16, LORA_TARGETS)
    est = plan.estimate_training_memory(tiny_model.config, **kw)
    assert (est.weights, est.adapter_weights, est.gradients, est.optimizer_state) == \
        (4 * n, 4 * n_lora, 4 * n_lora, 8 * n_lora)
    assert est.activations > single.activations
    with pytest.raises(ValueError, match="optimizer 'lion'"):
        plan.estimate_training_memory(tiny_model.config, optimizer="lion")


def test_measure_state_matches_the_single_device_plan(tiny_model):
    model = copy.deepcopy(tiny_model)
    opt = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    opt.step()
    got = state.measure_state(model, opt)
    planned = plan.plan_memory(tiny_model.config, strategy="single", lora_r=None)
    for part in ("weights", "adapter_weights", "gradients", "optimizer_state"):
        assert getattr(got, part) == getattr(planned, part), part
    flat = torch.zeros(10)
    assert state.owned_bytes([flat[:3], flat[3:], flat]) == 40  # views of one buffer: the buffer, once


def test_measure_state_counts_a_plain_model_after_one_step(tiny_model):
    x = dict(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]]))
    model = copy.deepcopy(tiny_model)
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters())
    model(**x).loss.backward()
    opt.step()
    got = state.measure_state(model, opt)
    assert (got.weights, got.adapter_weights, got.gradients, got.optimizer_state) == (4 * n, 0, 4 * n, 8 * n)
    assert (got.activations, got.buffers) == (0, 0)
    assert state.measure_state(model).optimizer_state == 0

    # frozen base, trained "adapters" (here the MLPs): reported apart, gradients and moments for them only
    model = copy.deepcopy(tiny_model)
    for name, p in model.named_parameters():
        p.requires_grad = ".mlp." in name
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model(**x).loss.backward()
    opt.step()
    got = state.measure_state(model, opt)
    assert (got.weights, got.adapter_weights, got.gradients, got.optimizer_state) == \
        (4 * (n - trained), 4 * trained, 4 * trained, 8 * trained)


def test_zero_internals_fail_loudly_when_deepspeed_renames_them():
    stage2 = SimpleNamespace(grads_in_partition=None, averaged_gradients={0: [torch.zeros(3)]},
                             single_partition_of_fp32_groups=[torch.zeros(4)],
                             optimizer=torch.optim.SGD([torch.zeros(1)]),
                             ipg_buckets={torch.float32: SimpleNamespace(buffer=[torch.zeros(5)])})
    found = compat.zero_optimizer_buffers(stage2, 2)
    assert [len(found[k]) for k in ("partitions", "gradients", "master", "buckets")] == [0, 1, 1, 1]
    del stage2.single_partition_of_fp32_groups
    with pytest.raises(compat.PrivateAPIMissing, match="single_partition_of_fp32_groups.*0.19.8"):
        compat.zero_optimizer_buffers(stage2, 2)


def test_recommender_replays_the_lan_cluster_decision_tree():
    lan = cards.LAN_CLUSTER
    small = advice.recommend(shapes.QWEN3_06B, lan, lora_r=16, model_name="Qwen3-0.6B")
    assert small.strategy == "ddp" and small.weight_bytes == 2 and small.per_device["fits"].all()
    assert any("YES on every GPU" in line for line in small.reasoning)
    assert any("lock-step" in line for line in small.reasoning)  # heterogeneous GPUs

    # Llama-2-7B + LoRA in bf16 does not fit one GPU; sharded it would, but over a 1 Gbit/s LAN the
    # all-gathers cost minutes per step, and 4-bit weights fit every GPU: the guide's QLoRA + DDP.
    llama = advice.recommend(shapes.LLAMA2_7B, lan, lora_r=16, lora_targets=["q_proj", "v_proj"])
    assert (llama.strategy, llama.weight_bytes) == ("ddp", 0.5)
    text = "\n".join(llama.reasoning)
    assert "NO" in text and "FSDP" in text and "all-gathers the weights twice" in text
    fast = advice.recommend(shapes.LLAMA2_7B, lan, lora_r=16, lora_targets=["q_proj", "v_proj"], link_gbit=None)
    assert fast.strategy in ("fsdp", "zero3") and fast.per_device["fits"].all()

    full = advice.recommend(shapes.QWEN3_06B, lan, lora_r=None)
    assert full.strategy == "zero2"  # weights fit, gradients + fp32 moments do not: shard those
    h100 = advice.recommend(shapes.QWEN25_7B, [{"name": "H100", "memory_gib": 80}] * 8, lora_r=None, link_gbit=400)
    assert h100.strategy == "zero2" and h100.plan.total < 78.5 * GIB  # weights fit an 80 GB GPU whole
    a100 = advice.recommend(shapes.QWEN25_7B, [{"name": "A100", "memory_gib": 40}] * 4, lora_r=None, link_gbit=400)
    assert a100.strategy in ("fsdp", "zero3") and a100.per_device["fits"].all()  # only 1/4 of everything fits
    none = advice.recommend(shapes.QWEN25_7B, lan, lora_r=None)
    assert none.strategy == "none" and "Nothing fits" in none.reasoning[-1]


def test_recommendation_is_a_decision_rendered_as_prose():
    lan = cards.LAN_CLUSTER
    decision = advice.decide(shapes.LLAMA2_7B, lan, lora_r=16, lora_targets=["q_proj", "v_proj"])
    assert decision.outcome == "quantise_for_link" and decision.outcome in advice.OUTCOMES
    assert (decision.chosen.strategy, decision.chosen.weight_bytes) == ("ddp", 0.5)
    assert [o.setup for o in decision.options][:4] == ["ddp, bf16 weights", "zero2, bf16 weights",
                                                       "fsdp, bf16 weights", "zero3, bf16 weights"]
    assert decision.option("fsdp").comm_s > decision.max_comm_s  # why the tree did not stop at sharding
    rec = advice.recommend(shapes.LLAMA2_7B, lan, lora_r=16, lora_targets=["q_proj", "v_proj"])
    assert rec.reasoning == advice.explain(decision) and len(rec.candidates) == len(decision.options)


def test_on_a_fast_link_the_recommender_tries_tensor_parallelism_in_pairs_when_sharding_alone_does_not_fit():
    four = [{"name": "A100", "memory_gib": 40}] * 4
    kwargs = dict(lora_r=None, seq_len=4096, micro_batch=1, activation_checkpointing=False)
    fast = advice.decide(shapes.LLAMA2_7B, four, link_gbit=400, **kwargs)
    assert fast.outcome == "tp_fits" and fast.chosen.strategy == "fsdp_tp" and fast.outcome in advice.OUTCOMES
    assert not fast.option("fsdp").fits_every_gpu and fast.chosen.fits_every_gpu
    assert fast.chosen.plan.activations < fast.option("fsdp").plan.activations, "TP slices heads' and FFN activations"
    assert "keep each pair on one node" in advice.explain(fast)[-1]
    slow = advice.decide(shapes.LLAMA2_7B, four, link_gbit=1, **kwargs)
    assert all(o.strategy != "fsdp_tp" for o in slow.options), "over a LAN, per-layer all-reduces are not offered"
