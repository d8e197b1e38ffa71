"""The memory of loading (distlab.planning.load) against real sharding where it can be done without memory: FSDP2
cuts a Llama-2-7B built on the meta device over 2 gloo ranks, and the bytes each rank's shards would take are
counted from their shapes, nothing allocated. The planner's load paths and verdicts: tests/unit/test_plan_load.py.
"""

from __future__ import annotations

import pytest

from distlab.planning import shapes
from distlab.planning.load import plan_load
from test_sharded_load_runs import torchrun  # the gloo launcher the sharded-load tests use

# Per rank: Llama-2-7B's shape on meta, fully_shard on every decoder layer and the root (as strategies.fsdp
# does), and the bytes of this rank's local shards, counted from their shapes.
META_7B = '''
import json, sys
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM
from distlab.planning.shapes import LLAMA2_7B

dist.init_process_group("gloo")
with torch.device("meta"):
    lm = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in LLAMA2_7B.items() if k != "model_type"}))
lm = lm.to(torch.bfloat16)
for layer in lm.model.layers:
    fully_shard(layer)
fully_shard(lm)
local = sum(p.to_local().numel() * p.element_size() for p in lm.parameters())
assert all(p.is_meta for p in lm.parameters())
json.dump({"bytes": local}, open(f"{sys.argv[1]}.{dist.get_rank()}.json", "w"))
dist.destroy_process_group()
'''


def test_a_7b_sharded_on_meta_holds_what_the_planner_says_each_rank_loads(tmp_path):
    ranks = torchrun(tmp_path, META_7B)
    for rank, rec in enumerate(ranks):
        load = plan_load(shapes.LLAMA2_7B, strategy="fsdp", world_size=2, rank=rank, dtype="bf16")
        assert load.path == "slices" and load.device == pytest.approx(rec["bytes"], rel=1e-3), (rank, rec, load)
    assert sum(r["bytes"] for r in ranks) == pytest.approx(plan_load(shapes.LLAMA2_7B, dtype="bf16").whole, rel=1e-3)
