"""The memory of loading (distlab.planning.load) and the verdicts that use it: the load path of each strategy (as
prepare_run loads it), a sharded 4-bit base loading a whole replica first, ZeRO-3 holding one whole tensor beside
its partition. Against real sharding (a Llama-2-7B on the meta device cut by FSDP2 over 2 gloo ranks):
tests/launches/test_plan_load_runs.py; host memory at load: the scale rehearsal
(tests/launches/test_scale_rehearsal.py, python -m distlab.bench.scale_rehearsal).
"""

from __future__ import annotations

import pytest

from distlab import sharded_load
from distlab.config import PIPELINE_STRATEGIES, QUANTISED_STRATEGIES, STRATEGY_NAMES, TrainConfig
from distlab.planning import advice, cards, plan, shapes
from distlab.planning.load import load_path, peak_bytes, plan_load
from distlab.strategies import make_strategy

GIB = 2**30


def test_load_paths_follow_how_each_strategy_loads():
    assert [load_path(s) for s in ("single", "ddp", "zero2", "fsdp", "tp", "fsdp_tp", "zero3", "pipeline")] == \
        ["whole", "whole", "whole", "slices", "slices", "slices", "partitioned", "stage"]
    assert load_path("fsdp", quantised=True) == "whole" and load_path("fsdp", safetensors=False) == "whole"
    assert load_path("zero3", quantised=True) == "whole"


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_the_planner_loads_each_strategy_as_prepare_run_does(strategy):
    """Two places hold the rule: the planner's load_path and what prepare_run asks of a strategy
    (loads_shards, unless sharded_load.whole_model_reason; ZeRO-3's partitioned load_context)."""
    made = make_strategy(strategy)
    runs = {"slices": made.loads_shards and sharded_load.whole_model_reason(TrainConfig()) is None,
            "partitioned": getattr(made, "stage", 0) == 3, "stage": strategy in PIPELINE_STRATEGIES}
    expected = next((path for path, taken in runs.items() if taken), "whole")
    assert load_path(strategy) == expected
    if strategy in QUANTISED_STRATEGIES:  # a quantised base: bitsandbytes quantises inside from_pretrained
        assert sharded_load.whole_model_reason(TrainConfig(quantization="nf4")) and \
            load_path(strategy, quantised=True) == "whole"


def test_a_sharded_4bit_base_loads_a_whole_replica_first():
    q_v = dict(lora_r=16, lora_targets=["q_proj", "v_proj"], micro_batch=1, seq_len=2048,
               activation_checkpointing=True, activation_bytes=2)
    load = plan_load(shapes.LLAMA2_13B, strategy="fsdp", world_size=3, weight_bytes=0.5, **q_v)
    step = plan.plan_memory(shapes.LLAMA2_13B, strategy="fsdp", world_size=3, weight_bytes=0.5, **q_v)
    assert load.path == "whole" and load.device > load.whole > step.total
    assert peak_bytes(shapes.LLAMA2_13B, strategy="fsdp", world_size=3, weight_bytes=0.5, **q_v) == load.device
    # bf16 weights read slice by slice: the load is the shard, and the step (buffers, activations) is the peak
    bf16 = plan_load(shapes.LLAMA2_13B, strategy="fsdp", world_size=3, weight_bytes=2, **q_v)
    assert bf16.path == "slices" and bf16.device == pytest.approx(bf16.whole / 3, rel=0.01)
    # every verdict takes the larger: the recommender finds nothing for Scenario 3, and says why
    rec = advice.recommend(shapes.LLAMA2_13B, cards.LAN_CLUSTER, lora_r=16, lora_targets=["q_proj", "v_proj"],
                           optimizer="adamw8bit")
    assert rec.label == "nothing fits" and "while the model loads" in rec.reasoning[-1]
    assert not rec.decision.option("fsdp", 0.5).fits_every_gpu


def test_zero3_holds_one_whole_tensor_beside_its_partition_while_loading():
    load = plan_load(shapes.LLAMA2_7B, strategy="zero3", world_size=3, dtype="bf16", lora_r=16)
    largest = 32000 * 4096 * 2  # the embedding (and the untied LM head), gathered whole to be filled
    assert load.device - load.kept == largest
    assert load.host == shapes.parameter_count(shapes.LLAMA2_7B) * 2  # rank 0 maps the whole bf16 file
    assert plan_load(shapes.LLAMA2_7B, strategy="zero3", world_size=3, rank=1, dtype="bf16", lora_r=16).host == 0
