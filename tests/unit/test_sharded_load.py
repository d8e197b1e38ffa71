"""Loading that shards (distlab.sharded_load), in one process: the presets and quantised bases keep the whole-model
path, and a weightless model filled from the files is the whole load bit for bit, every byte of the files read once.
The ranks reading only their share (fsdp, tp) and zero3 loading under deepspeed.zero.Init, on 2 gloo ranks:
tests/launches/test_sharded_load_runs.py.
"""

from __future__ import annotations

import torch

from distlab import sharded_load
from distlab.config import TrainConfig
from distlab.prepare import prepare_run
from distlab.strategies.single import SingleDevice
from helpers import file_tensor_bytes


def test_presets_and_quantised_bases_keep_the_whole_model_path():
    assert sharded_load.whole_model_reason(TrainConfig()) is None
    assert "random preset" in sharded_load.whole_model_reason(TrainConfig(model="distlab-tiny-random"))
    assert "quantised" in sharded_load.whole_model_reason(TrainConfig(quantization="nf4"))
    assert sharded_load.file_key("model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"


class ShardLoadingSingle(SingleDevice):
    """One device that asks prepare_run for the weightless model, then fills it whole (no sharding): the
    loader's reading and its LoRA and rotary values, without a process group."""

    loads_shards = True


def test_a_weightless_model_filled_from_the_files_is_the_whole_load_bit_for_bit():
    cfg = TrainConfig(eval_file=None, seq_len=64)
    *_, whole = prepare_run(cfg, SingleDevice())
    *_, model = prepare_run(cfg, ShardLoadingSingle())
    assert sharded_load.is_pending(model) and all(p.is_meta for p in model.parameters())
    report = sharded_load.fill(model, "cpu")
    ref, got = whole.state_dict(), model.state_dict()
    assert sorted(ref) == sorted(got) and sum("lora_" in k for k in ref) > 0
    assert [k for k in ref if not torch.equal(ref[k], got[k])] == []
    assert dict(whole.named_buffers()).keys() == dict(model.named_buffers()).keys()  # rotary inv_freq recomputed
    lm = model.causal_lm
    assert lm.get_output_embeddings().weight is lm.get_input_embeddings().weight  # still tied
    assert report["bytes_read"] == sum(file_tensor_bytes().values())
