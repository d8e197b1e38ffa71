"""Loading that shards (distlab.sharded_load), in one process: the presets and quantised bases keep the whole-model
path, and a weightless model filled from the files is the whole load bit for bit, every byte of the files read once.
The ranks reading only their share (fsdp, tp) and zero3 loading under deepspeed.zero.Init, on 2 gloo ranks:
tests/launches/test_sharded_load_runs.py.
"""

from __future__ import annotations

import pytest
import torch

from distlab import sharded_load
from distlab.config import TrainConfig
from distlab.measure.state import quant_state_tensors
from distlab.models import count_parameters
from distlab.prepare import prepare_run
from distlab.strategies.single import SingleDevice
from helpers import file_tensor_bytes


def test_presets_and_int8_bases_keep_the_whole_model_path():
    assert sharded_load.whole_model_reason(TrainConfig()) is None
    assert "random preset" in sharded_load.whole_model_reason(TrainConfig(model="distlab-tiny-random"))
    assert "int8" in sharded_load.whole_model_reason(TrainConfig(quantization="int8"))
    assert sharded_load.whole_model_reason(TrainConfig(quantization="nf4")) is None  # quantised weight by weight
    assert sharded_load.whole_model_reason(TrainConfig(model="distlab-tiny-random", quantization="nf4")) is None
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


@pytest.mark.parametrize(("double_quant", "dtype"), [(True, "fp32"), (False, "fp32"), (True, "bf16")])
def test_a_weightless_4bit_model_filled_from_the_files_is_the_whole_4bit_load_bit_for_bit(double_quant, dtype):
    """FSDP + QLoRA's load, without the cut: every weight bitsandbytes quantises is read whole, packed by the same
    call from_pretrained makes, and kept with its QuantState; the layers it leaves are fp32 as k-bit preparation
    leaves them (bf16: read as bf16 first, as from_pretrained reads them). The state dict carries the packed bytes
    and every scale (Linear4bit saves its QuantState)."""
    cfg = TrainConfig(eval_file=None, seq_len=64, quantization="nf4", double_quant=double_quant, dtype=dtype)
    *_, whole = prepare_run(cfg, SingleDevice())
    *_, model = prepare_run(cfg, ShardLoadingSingle())
    assert sharded_load.is_pending(model) and all(p.is_meta for p in model.parameters())
    assert count_parameters(model) == count_parameters(whole)
    report = sharded_load.fill(model, "cpu")
    ref, got = whole.state_dict(), model.state_dict()
    assert sorted(ref) == sorted(got) and sum("absmax" in k for k in ref) > 0 and sum("lora_" in k for k in ref) > 0
    assert [k for k in ref if not torch.equal(ref[k], got[k])] == []
    assert {k: v.dtype for k, v in ref.items()} == {k: v.dtype for k, v in got.items()}
    flags = ("is_quantized", "quantization_method", "is_loaded_in_4bit")  # what PEFT and k-bit preparation read
    base, ref_base = model.causal_lm, whole.causal_lm
    assert [getattr(base, k) for k in flags] == [getattr(ref_base, k) for k in flags] == [True, "bitsandbytes", True]
    assert base.config.quantization_config.to_dict() == ref_base.config.quantization_config.to_dict()
    held = sum(t.numel() * t.element_size() for t in [*whole.parameters(), *whole.buffers(),
                                                       *{id(t): t for t in quant_state_tensors(whole)}.values()])
    assert report["bytes_held"] == held
    assert report["bytes_read"] == sum(file_tensor_bytes().values())


def test_a_block_read_from_the_file_is_that_block_of_the_tensor(tmp_path):
    """read_part reads any block (one slice per dimension) with plain reads: rows, columns, a corner, a whole
    tensor, a 0-d one; in every dtype a checkpoint holds. A file cut short or a block of steps is refused."""
    from safetensors.torch import save_file  # deferred: only this test writes a file

    g = torch.Generator().manual_seed(0)
    tensors = {"rows": torch.randn(7, 5, generator=g).bfloat16(), "cube": torch.randn(4, 3, 6, generator=g),
               "vector": torch.randn(9, generator=g).half(), "scalar": torch.tensor(3.5, dtype=torch.float64)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    header = sharded_load.read_header(path)
    blocks = {"rows": [(slice(2, 5), slice(0, 5)), (slice(0, 7), slice(1, 3)), (slice(6, 7), slice(4, 5))],
              "cube": [(slice(1, 3), slice(0, 3), slice(0, 6)), (slice(0, 4), slice(1, 2), slice(2, 6)),
                       (slice(3, 4), slice(2, 3), slice(0, 1))],
              "vector": [(slice(0, 9),), (slice(4, 5),)], "scalar": [()]}
    for key, indexes in blocks.items():
        assert torch.equal(sharded_load.read_whole(path, key), tensors[key])
        for index in indexes:
            part = sharded_load.read_part(path, header, key, index)
            assert part.dtype == tensors[key].dtype and torch.equal(part, tensors[key][index]), (key, index)
    with pytest.raises(ValueError, match="one slice per dimension"):
        sharded_load.read_part(path, header, "rows", (slice(0, 7, 2), slice(0, 5)))
    path.write_bytes(path.read_bytes()[:-8])  # the last tensor's bytes run past the end of the file
    last = max(header[1], key=lambda k: header[1][k].get("data_offsets", [0])[0] if k != "__metadata__" else -1)
    with pytest.raises(ValueError, match="cut short"):
        sharded_load.read_whole(path, last)
