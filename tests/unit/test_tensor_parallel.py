"""Tensor parallelism (chapter 07) in one process: the `tp` strategy's registration, refusals and plan, the
collective counter, the notebook's by-hand split on one rank and its vocabulary-parallel loss, the step formulas,
and the 2-D `fsdp_tp` layout that chapter 08 runs (its planner, its refusals, its sequence-parallel plan). The runs
under torchrun against one device: tests/launches/test_tensor_parallel_runs.py."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab import paths
from distlab.chapters import ch07
from distlab.config import ConfigError, TrainConfig, from_dict
from distlab.launch import local
from distlab.launch.spec import LaunchSpec
from distlab.measure.collectives import CollectiveCounter
from distlab.models import load_model
from distlab.planning import plan, shapes
from distlab.strategies import make_strategy
from distlab.strategies.tp import LAYER_PLAN, TPStrategy, check_tp_degree
from helpers import notebook_scripts

NOTEBOOK = paths.NOTEBOOKS_DIR / "07_tensor_parallel.ipynb"
STAMP = {"device": "test", "model": "tiny", "world_size": 2, "commit": "x", "date": "today"}


def test_tp_is_registered_and_trains_on_one_data_parallel_replica():
    strategy = make_strategy("tp")
    assert isinstance(strategy, TPStrategy)
    assert strategy.data_parallel_size == 1 and strategy.data_parallel_rank == 0
    assert strategy.all_reduce_sum(torch.ones(2)).tolist() == [1.0, 1.0], "every rank already holds the sums"


def test_under_lora_the_plan_splits_the_base_layer_and_the_factor_on_the_split_side():
    from distlab.prepare import apply_lora
    from distlab.strategies.tp import layer_plan

    cfg = TrainConfig(lora=True, lora_targets=["q_proj", "o_proj", "down_proj"])
    layer = apply_lora(load_model(None), cfg).base_model.model.model.layers[0]
    styles = {name: type(style).__name__ for name, style in layer_plan(layer).items()}
    assert styles["self_attn.q_proj.base_layer"] == styles["self_attn.q_proj.lora_B.default"] == "ColwiseParallel"
    assert styles["self_attn.o_proj.base_layer"] == styles["self_attn.o_proj.lora_A.default"] == "RowwiseParallel"
    assert styles["mlp.down_proj.lora_A.default"] == "RowwiseParallel"
    assert styles["self_attn.k_proj"] == "ColwiseParallel", "a projection LoRA leaves alone is split as before"
    # q's lora_A stays whole but reads the block input, a DTensor: a replicated DTensor; o's lora_B a plain Linear
    assert styles["self_attn.q_proj.lora_A.default"] == "ReplicateParallel"
    assert not any(k.endswith("o_proj.lora_B.default") for k in styles), "kept whole, a plain module"
    names = [f"model.layers.0.{n}.weight" for n in ("self_attn.q_proj.lora_A", "self_attn.q_proj.lora_B",
                                                     "mlp.down_proj.lora_A", "mlp.down_proj.lora_B", "input_layernorm")]
    assert [n for n in names if plan.tp_sliced(n)] == [names[1], names[2]]


def test_the_tp_degree_must_divide_heads_key_value_heads_and_ffn():
    tiny = load_model(None).config
    check_tp_degree(tiny, 2)
    with pytest.raises(ValueError, match="key/value heads \\(2\\)"):
        check_tp_degree(tiny, 4)
    qwen05 = SimpleNamespace(num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864)
    with pytest.raises(ValueError):
        check_tp_degree(qwen05, 4)


def test_the_plan_names_every_projection_of_a_qwen2_layer():
    layer = load_model(None).model.layers[0]
    names = dict(layer.named_modules())
    assert all(isinstance(names[n], torch.nn.Linear) for n in LAYER_PLAN)
    assert [n for n, style in LAYER_PLAN.items() if style.__name__ == "RowwiseParallel"] == \
        ["self_attn.o_proj", "mlp.down_proj"]


def test_a_tp_launch_has_data_parallel_size_one():
    spec = LaunchSpec(nproc_per_node=2, strategy="tp", micro_batch_size=4, global_batch_size=4)
    assert spec.data_parallel_size == 1  # 4 rows per step on two TP ranks: no split of the batch to check


def test_the_planner_slices_the_projections_only():
    single = plan.plan_memory(shapes.LLAMA2_7B, strategy="single")
    tp = plan.plan_memory(shapes.LLAMA2_7B, strategy="tp", world_size=2)
    assert single.weights / 2 < tp.weights < single.weights * 0.55, "embedding and head stay whole"
    assert tp.gradients == tp.weights, "full fine-tuning: a gradient for every weight a rank holds"


def test_fsdp_tp_refuses_checkpoints_and_a_tp_size_that_leaves_one_group():
    from distlab.launch.spec import LaunchSpecError
    from distlab.strategies.fsdp_tp import FSDPxTPStrategy

    with pytest.raises(ValueError, match="checkpoint_steps=0"):
        FSDPxTPStrategy().setup(TrainConfig(strategy="fsdp_tp", checkpoint_steps=5))
    assert not dist.is_initialized()
    with pytest.raises(LaunchSpecError, match="at least two tp groups"):
        LaunchSpec(nproc_per_node=2, strategy="fsdp_tp")
    with pytest.raises(LaunchSpecError, match="only for the tensor-parallel strategies"):
        LaunchSpec(nproc_per_node=2, strategy="ddp", tp_size=2)
    with pytest.raises(LaunchSpecError, match="needs fsdp_tp"):
        LaunchSpec(nproc_per_node=4, strategy="tp", tp_size=2)
    two_d = LaunchSpec(nproc_per_node=4, strategy="fsdp_tp", micro_batch_size=2, global_batch_size=4)
    assert two_d.data_parallel_size == 2, "the two tp groups take different rows"


def test_the_2d_planner_cuts_projections_four_ways_and_the_rest_two_ways():
    config = load_model(None).config
    single = plan.plan_memory(config, strategy="single", dtype="fp32")
    fsdp = plan.plan_memory(config, strategy="fsdp", world_size=2, dtype="fp32")
    two_d = plan.plan_memory(config, strategy="fsdp_tp", world_size=4, dtype="fp32")
    projections = sum(p.numel() for n, p in load_model(None).named_parameters() if any(
        f".{k}." in f".{n}." for k in plan.TP_SPLIT)) * 4
    expected = (single.weights - projections) / 2 + projections / 4
    assert abs(two_d.weights - expected) / expected < 0.01
    assert single.weights / 4 < two_d.weights < fsdp.weights
    with pytest.raises(ValueError, match="not a multiple of tp_size"):
        plan.plan_memory(config, strategy="fsdp_tp", world_size=3, dtype="fp32")


def test_the_split_mlp_in_one_process_equals_the_whole_one():
    mlp = load_model(None).model.layers[0].mlp
    x = torch.randn(2, 8, mlp.gate_proj.in_features)
    with torch.no_grad():
        parts = [F.silu(x @ g.T) * (x @ u.T) @ d.T for g, u, d in zip(
            mlp.gate_proj.weight.chunk(2, 0), mlp.up_proj.weight.chunk(2, 0), mlp.down_proj.weight.chunk(2, 1))]
        assert (sum(parts) - mlp(x)).abs().max() < 1e-5


def test_the_by_hand_blocks_on_one_rank_and_the_counter(tmp_path, monkeypatch):
    """With one rank the split holds everything: the blocks must equal the whole ones, and the counter
    sees one all-reduce of b x s x h per block forward and one backward."""
    monkeypatch.syspath_prepend(str(tmp_path))
    notebook_scripts(NOTEBOOK, tmp_path)
    import tp_by_hand

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = load_model(None)
        layer = model.model.layers[0]
        x = torch.randn(1, 8, model.config.hidden_size, requires_grad=True)
        with CollectiveCounter() as forward:
            out, slices = tp_by_hand.mlp_by_hand(layer.mlp, x)
        with CollectiveCounter() as backward:
            out.sum().backward()
        assert (out - layer.mlp(x)).abs().max() < 1e-6 and set(slices) == {"gate_proj", "up_proj", "down_proj"}
        assert forward.calls == [("all_reduce", x.numel() * 4)] == backward.calls
    finally:
        dist.destroy_process_group()
        sys.modules.pop("tp_by_hand", None)


def test_layer_bytes_table_sets_the_formula_beside_both_counts():
    one = 2 * 64 * 256 * 4
    by_hand = {b: {"forward_calls": 1, "backward_calls": 1, "forward_bytes": one, "backward_bytes": one}
               for b in ("attention", "mlp")}
    dtensor = {"forward": [["all_reduce", one]] * 2, "backward": [["all_reduce", one]] * 5}
    table = ch07.layer_bytes(by_hand, dtensor, batch=2, seq=64, hidden=256)
    assert table.loc["per layer", "formula: bytes"] == 4 * one == table.loc["per layer", "by hand: bytes"]
    assert table.loc["backward", "DTensor: all-reduces"] == 5 and "DTensor + block input: bytes" not in table
    block_input = {"forward": [["all_reduce", one]] * 2, "backward": [["all_reduce", one]] * 2}
    table = ch07.layer_bytes(by_hand, {**dtensor, "block_input": block_input}, batch=2, seq=64, hidden=256)
    assert table.loc["backward", "DTensor + block input: all-reduces"] == 2
    assert table.loc["per layer", "DTensor + block input: bytes"] == 4 * one


def test_the_idea_is_drawn(tmp_path):
    assert ch07.draw_tensor_parallel(tmp_path / "tp.png", STAMP, load_model(None).config).exists()


def test_the_benchmark_refuses_runs_shorter_than_the_warm_up():
    from distlab.bench import tensor_parallel

    with pytest.raises(ValueError, match="warm-up"):
        tensor_parallel.measure(steps=2, rounds=1)
    assert tensor_parallel.RUNS == {1: "single", 2: "tp"} and not tensor_parallel.SETUP["measure_comm"]


def test_tp_refuses_periodic_checkpoints_it_cannot_write_yet():
    with pytest.raises(ValueError, match="checkpoint_steps=0"):
        TPStrategy().setup(TrainConfig(strategy="tp", lora=False, checkpoint_steps=5))
    assert not dist.is_initialized()


def test_the_torchrun_writer_takes_a_tp_size_for_two_nodes_of_tp_groups(tmp_path):
    import subprocess

    from distlab.launch import torchrun

    spec = LaunchSpec(module="distlab.train", nproc_per_node=2, nnodes=2, rendezvous="static",
                      master_addr="192.168.1.100", strategy="fsdp_tp", tp_size=2, micro_batch_size=2,
                      global_batch_size=4, args=["--set", "strategy=fsdp_tp", "--set", "tp_size=2"],
                      description="FSDP across 2 nodes, TP inside each")
    assert spec.data_parallel_size == 2  # one tp group per node: the nodes take different rows
    scripts = [p for p in torchrun.write_scripts(spec, tmp_path, "fsdp_tp_2x2") if p.suffix == ".sh"]
    assert len(scripts) == 2
    for path in scripts:
        assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
        assert "tp_size=2" in path.read_text()


def test_vocab_parallel_is_a_setting_of_tp_alone():
    with pytest.raises(ConfigError, match="vocab_parallel=true needs strategy=tp, not 'fsdp_tp'"):
        TrainConfig(strategy="fsdp_tp", vocab_parallel=True)
    with pytest.raises(ValueError, match="vocab_parallel is a setting of strategy tp"):
        plan.plan_memory(load_model(None).config, strategy="ddp", world_size=2, vocab_parallel=True)


def test_sequence_parallel_is_a_tensor_parallel_setting():
    assert from_dict({"strategy": "tp", "lora": False, "sequence_parallel": "true"}).sequence_parallel is True
    with pytest.raises(ConfigError, match="sequence_parallel=true needs strategy tp or fsdp_tp, not 'ddp'"):
        TrainConfig(strategy="ddp", sequence_parallel=True)
    from distlab.launch.spec import LaunchSpecError

    with pytest.raises(LaunchSpecError, match="only for the tensor-parallel strategies"):
        LaunchSpec(nproc_per_node=2, strategy="fsdp", sequence_parallel=True)
    assert local.training_spec("t", 2, {"strategy": "tp", "sequence_parallel": True}, local.TINY_CONFIG, 0, None, 60,
                               paths.RUNS_DIR).sequence_parallel


def test_under_lora_and_sequence_parallelism_the_factors_that_meet_dtensors_are_replicated():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from distlab.prepare import apply_lora
    from distlab.strategies.tp import ReplicateParallel, layer_plan

    layer = apply_lora(load_model(None), TrainConfig(lora=True)).base_model.model.model.layers[0]
    plan = layer_plan(layer, sequence_parallel=True)
    q, o = "self_attn.q_proj", "self_attn.o_proj"
    assert isinstance(plan[f"{q}.lora_B.default"], ColwiseParallel) and isinstance(plan[f"{q}.lora_A.default"],
                                                                                   ReplicateParallel)
    # the row-parallel side: base and lora_A reduce-scatter to token slices, lora_B whole maps them, a plain tensor out
    assert plan[f"{o}.base_layer"].output_layouts == plan[f"{o}.lora_A.default"].output_layouts == (Shard(1),)
    assert isinstance(plan[f"{o}.lora_A.default"], RowwiseParallel) and plan[f"{o}.lora_B.default"].local_output
    assert o not in plan, "the wrapper itself is not a Linear: its base layer and factors are split"


def test_the_sequence_parallel_plan_shards_the_norms_and_regathers_before_each_block():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel, SequenceParallel

    from distlab.strategies.tp import layer_plan

    layer = load_model(None).model.layers[0]
    plain, sp = layer_plan(layer), layer_plan(layer, sequence_parallel=True)
    assert set(plain) < set(sp) and "input_layernorm" not in plain
    assert all(isinstance(sp[n], SequenceParallel) for n in ("input_layernorm", "post_attention_layernorm"))
    assert all(isinstance(sp[n], PrepareModuleInput) for n in ("self_attn", "mlp"))
    # without sequence parallelism the block input arrives whole and is made one DTensor all the same (one
    # all-reduce of its gradient per block, not one per column-parallel projection)
    assert plain["mlp"].input_layouts == plain["mlp"].desired_input_layouts == (Replicate(),)
    assert sp["mlp"].input_layouts == (Shard(1),) and sp["mlp"].desired_input_layouts == (Replicate(),)
    assert all(isinstance(sp[n], RowwiseParallel) and sp[n].output_layouts == (Shard(1),)
               for n in ("self_attn.o_proj", "mlp.down_proj")), "the block output reduce-scattered along the sequence"


def test_the_step_formulas_follow_the_layout():
    from distlab.planning.wire_bytes import step_bytes_sent

    config = load_model(None).config
    params = sum(p.numel() for p in load_model(None).parameters())
    layers, act = config.num_hidden_layers, 4 * 256 * config.hidden_size * 4  # 4 rows of 256 tokens, fp32
    assert step_bytes_sent(config, "ddp", 2, rows=4, seq_len=256) == {"gradients (all-reduce)": params * 4.0}
    tp = step_bytes_sent(config, "tp", 2, rows=4, seq_len=256)
    sp = step_bytes_sent(config, "tp", 2, rows=4, seq_len=256, sequence_parallel=True)
    assert tp["activations (all-reduce)"] == 4 * layers * act, "2 forward + 2 backward all-reduces a layer"
    assert sp["activations (all-gather, reduce-scatter)"] == (4 * layers + 1) * act, "Megatron's 4 a layer, +2 passes"
    vocab = step_bytes_sent(config, "tp", 2, rows=4, seq_len=256, vocab_parallel=True, label_tokens=100)
    assert vocab["embedding output (all-reduce)"] == act and vocab["loss statistics (all-reduce)"] == 3 * 100 * 4
    assert vocab["LM head input gradient (all-reduce)"] == 100 * config.hidden_size * 4
    with pytest.raises(ValueError, match="label_tokens"):
        step_bytes_sent(config, "tp", 2, rows=4, seq_len=256, vocab_parallel=True)
    with pytest.raises(ValueError, match="knows ddp, fsdp and tp"):
        step_bytes_sent(config, "zero3", 2, rows=4, seq_len=256)
