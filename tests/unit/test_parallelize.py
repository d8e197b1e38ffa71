"""distlab.strategies.base.parallelize: the one order in which a model is transformed, every strategy going through
it with only its own steps, and fsdp_tp as tp's step then fsdp's. In one process (a gloo world of one), the real
steps on the tiny model; the equality with one device under several ranks is the slow tests' (test_tensor_parallel,
test_fsdp_zero, test_sharded_load)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from distlab.config import TrainConfig
from distlab.prepare import prepare_run
from distlab.strategies import STRATEGY_NAMES, make_strategy, strategy_class
from distlab.strategies.base import Strategy
from distlab.strategies.split import decoder_layers

HOOKS = ("keep_stage", "split", "shard", "wrap")  # the steps a strategy may supply, in parallelize's order


def supplied(name: str) -> list[str]:
    cls = strategy_class(name)
    return [hook for hook in HOOKS if getattr(cls, hook) is not getattr(Strategy, hook)]


def test_each_strategy_supplies_only_its_own_steps_and_fsdp_tp_is_tp_s_then_fsdp_s():
    assert {name: supplied(name) for name in STRATEGY_NAMES} == {
        "single": [], "ddp": ["wrap"], "fsdp": ["shard"], "zero2": ["wrap"], "zero3": ["wrap"],
        "pipeline": ["keep_stage", "wrap"], "ds_pipeline": ["keep_stage", "wrap"], "tp": ["split"],
        "fsdp_tp": ["split", "shard"]}
    fsdp_tp = strategy_class("fsdp_tp")
    assert not issubclass(fsdp_tp, (strategy_class("tp"), strategy_class("fsdp"))), "composed, not inherited"
    borrowed = [attr for attr in dir(fsdp_tp)
                if getattr(getattr(fsdp_tp, attr), "__qualname__", "").startswith(("TPStrategy.", "FSDPStrategy."))]
    assert borrowed == [], "methods of other strategy classes: it reuses their modules' functions instead"


@pytest.fixture
def world_of_one(tmp_path, monkeypatch):
    """A gloo process group of one rank in this process, as a launcher would leave it."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_every_strategy_of_one_process_takes_its_steps_in_the_one_order(world_of_one):
    expected = {"single": ["place", "optimizer"], "ddp": ["place", "optimizer", "wrap"],
                "fsdp": ["shard", "fill", "optimizer"],  # weightless from prepare_run: nothing to place
                "tp": ["split", "fill", "optimizer"]}
    for name, steps in expected.items():
        cfg = TrainConfig(strategy=name, eval_file=None, seq_len=64)
        strategy = make_strategy(name)
        strategy.setup(cfg)
        choice, *_, model = prepare_run(cfg, strategy)
        model, optimizer, scheduler = strategy.prepare(model, choice, cfg)
        assert strategy.transforms == steps, name
        assert not any(p.is_meta for p in model.parameters()), name
        assert scheduler.optimizer is optimizer, name


def test_fsdp_tp_cuts_lora_s_adapters_with_tp_then_shards_every_slice_with_fsdp(world_of_one):
    cfg = TrainConfig(strategy="fsdp_tp", lora=True, activation_checkpointing=True, compile=True, eval_file=None,
                      seq_len=64)
    strategy = make_strategy("fsdp_tp")
    # its setup refuses a world of one (two tp groups at least): the 1 x 1 mesh it would build, by hand
    strategy.cfg = cfg
    strategy.mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    choice, *_, model = prepare_run(cfg, strategy)
    model, optimizer, _ = strategy.prepare(model, choice, cfg)
    assert strategy.transforms == ["split", "compile", "shard", "fill", "optimizer"]
    layers = decoder_layers(model)
    # checkpointing (set at build) and compile (in place) stay on the layer fully_shard then wrapped
    assert all(isinstance(layer, FSDPModule) and layer.gradient_checkpointing for layer in layers)
    assert all(layer._compiled_call_impl is not None for layer in layers)
    attn = layers[0].self_attn
    # LoRA came first: the plan split q's lora_B with q (columns); TP before FSDP: that slice sharded again along dp
    lora_b, lora_a = attn.q_proj.lora_B["default"].weight, attn.q_proj.lora_A["default"].weight
    assert isinstance(lora_b, DTensor) and lora_b.device_mesh.mesh_dim_names == ("dp", "tp")
    assert lora_b.placements == (Shard(0), Shard(0)) and lora_a.placements == (Shard(0), Replicate())
    assert attn.o_proj.base_layer.weight.placements == (Shard(0), Shard(1))  # row-parallel, then FSDP's dim 0
    assert not any(p.is_meta for p in model.parameters())  # filled after both cuts
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert stepped == {id(p) for p in model.parameters() if p.requires_grad}  # the optimizer over the cut weights
