"""Loading that shards (distlab.sharded_load), on 2 gloo ranks: fsdp and tp build the model without weights, shard it,
then each rank reads only its part of the files; zero3 loads under deepspeed.zero.Init.

Deterministic checks, no memory timing: the loader counts the bytes it reads from the safetensors files, and a
rank must read no more than its share of the weights (plus one tensor's worth of rounding); the weights it
gathers back are bitwise the whole-model load's, LoRA adapters included (the same seeded draws), and the tied
embedding stays tied. ZeRO-3's parameters are partitioned right after loading, before deepspeed.initialize, and
its first losses are one device's. The one-process load paths: tests/unit/test_sharded_load.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distlab.launch.local import launch_sweep
from distlab.metrics import read_log
from distlab.strategies.tp import LAYER_PLAN
from helpers import file_tensor_bytes

LOSS_RTOL = 1e-5  # as tests/launches/test_fsdp_zero.py: fp32 on CPU, only the order of additions differs

# Per rank: each strategy's model through prepare_run and prepare (the sharded load), gathered whole and
# compared bitwise with the whole-model load on rank 0; what the rank read goes to <out>.<rank>.json.
SHARDED_CHECK = '''
import sys
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from distlab.config import TrainConfig
from distlab.jsonio import strict_json
from distlab.measure.state import quant_state_tensors
from distlab.models import quant_state_parts
from distlab.prepare import prepare_run
from distlab.strategies import make_strategy


def quantised_layers(lm):
    """{layer name: its packed weight and QuantState tensors}: what a 4-bit layer holds, whole."""
    return {n: [m.weight.full_tensor() if isinstance(m.weight, DTensor) else m.weight.data,
                *quant_state_parts(m.quant_state)] for n, m in lm.named_modules() if hasattr(m, "quant_state")}


out, runs = sys.argv[1], sys.argv[2].split(",")
torch.set_num_threads(1)
result = {}
for run in runs:
    name, mode = run.split(":")
    cfg = TrainConfig(strategy=name, lora=mode != "full", eval_file=None, seq_len=64,
                      quantization="nf4" if mode == "qlora" else "none")
    strategy = make_strategy(name)
    strategy.setup(cfg)
    choice, *_, model = prepare_run(cfg, strategy)
    record = {"weightless": all(p.is_meta for p in model.parameters())}
    model, *_ = strategy.prepare(model, choice, cfg)
    record.update(model.load_report)
    lm = model.causal_lm
    record["tied"] = lm.get_output_embeddings().weight is lm.get_input_embeddings().weight
    if mode == "qlora":  # a 4-bit weight's state stays on its layer, outside the state dict FSDP gathers
        full = {k: (t.full_tensor() if isinstance(t, DTensor) else t).detach() for k, t in model.named_parameters()}
        full.update({f"{n}.packed_and_state.{i}": t
                     for n, ts in quantised_layers(lm).items() for i, t in enumerate(ts)})
    elif name == "fsdp":
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        full = {k: (t.full_tensor() if isinstance(t, DTensor) else t).detach() for k, t in model.state_dict().items()}
    if dist.get_rank() == 0:
        *_, whole = prepare_run(cfg, make_strategy("single"))
        if mode == "qlora":
            ref = {k: t.detach() for k, t in whole.named_parameters()}
            ref.update({f"{n}.packed_and_state.{i}": t
                        for n, ts in quantised_layers(whole.causal_lm).items() for i, t in enumerate(ts)})
            record["quantised_layers"] = len(quantised_layers(whole.causal_lm))
            held = [*whole.parameters(), *whole.buffers(), *{id(t): t for t in quant_state_tensors(whole)}.values()]
            record["whole_held"] = sum(t.numel() * t.element_size() for t in held)
        else:
            ref = whole.state_dict()
        record["same_names"] = sorted(ref) == sorted(full)
        record["lora_tensors"] = sum("lora_" in k for k in ref)
        record["different"] = [k for k in ref if k in full and not torch.equal(ref[k], full[k].cpu())]
    result[run] = record
    dist.barrier()
with open(f"{out}.{dist.get_rank()}.json", "w") as f:
    f.write(strict_json(result))
dist.destroy_process_group()
'''

# Per rank: zero3's load (under deepspeed.zero.Init), read before deepspeed.initialize: how much of each base
# weight this rank holds; full fine-tuning: which weights the optimizer decays (a partitioned weight's tensor is
# empty, its shape is DeepSpeed's); LoRA: the adapters (rank 0 also builds them the one-device way, to compare).
ZERO3_CHECK = '''
import sys
import torch
import torch.distributed as dist
from distlab.config import TrainConfig
from distlab.jsonio import strict_json
from distlab.prepare import prepare_run
from distlab.strategies import make_strategy

out = sys.argv[1]
torch.set_num_threads(1)
result = {}
for mode in ("full", "lora"):
    cfg = TrainConfig(strategy="zero3", lora=mode == "lora", eval_file=None, seq_len=64, output_dir=f"{out}.{mode}")
    strategy = make_strategy("zero3")
    strategy.setup(cfg)
    choice, *_, model = prepare_run(cfg, strategy)
    base = [p for n, p in model.named_parameters() if "lora_" not in n]
    record = {"base": len(base), "partitioned": sum(hasattr(p, "ds_tensor") for p in base),
              "held": [p.ds_tensor.numel() for p in base], "whole": [p.ds_numel for p in base],
              "visible": sum(p.numel() for p in base)}
    if mode == "full":
        decayed = sum(len(p.ds_shape) >= 2 for p in base)
        optimizer = strategy.make_optimizer(model, cfg.lr, cfg.weight_decay)  # as prepare builds it
        record["decay_groups"] = [len(g["params"]) for g in optimizer.param_groups if g["weight_decay"] > 0]
        record["matrices"] = decayed
    else:
        lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
        if dist.get_rank() == 0:
            *_, one = prepare_run(cfg, make_strategy("single"))
            ref = {n: p.detach() for n, p in one.named_parameters() if "lora_" in n}
            record["lora_tensors"] = len(ref)
            record["lora_equal"] = sorted(ref) == sorted(lora) and all(torch.equal(ref[n], lora[n]) for n in ref)
    result[mode] = record
    dist.barrier()
with open(f"{out}.{dist.get_rank()}.json", "w") as f:
    f.write(strict_json(result))
dist.destroy_process_group()
'''


def torchrun(tmp_path: Path, script: str, *args: str, nproc: int = 2, timeout_s: int = 420) -> list[dict]:
    """Run `script` on `nproc` gloo ranks (one thread each); each rank's JSON record, by rank."""
    path = tmp_path / "check.py"
    path.write_text(script)
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           str(path), str(out), *args], env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(nproc)]


def test_fsdp_and_tp_ranks_read_only_their_share_and_gather_the_whole_load(tmp_path):
    sizes = file_tensor_bytes()
    total, largest = sum(sizes.values()), max(sizes.values())
    projections = sum(b for n, b in sizes.items() if any(f".{p}." in n for p in LAYER_PLAN))
    share = {"fsdp": total / 2,  # every tensor cut in two along dim 0
             "tp": projections / 2 + (total - projections)}  # projections cut in two, the rest whole
    runs = ["fsdp:lora", "tp:lora", "fsdp:full"]
    ranks = torchrun(tmp_path, SHARDED_CHECK, ",".join(runs))
    for run in runs:
        strategy = run.split(":")[0]
        for rank, records in enumerate(ranks):
            rec = records[run]
            assert rec["weightless"] and rec["tied"], (run, rank)
            assert rec["bytes_read"] <= share[strategy] + largest, (run, rank)  # never the whole model
            assert rec["bytes_read"] < 0.7 * total, (run, rank)
            assert rec["largest_read"] <= largest
        rank0 = ranks[0][run]
        assert rank0["same_names"] and rank0["different"] == [], run  # bitwise the whole load
        assert (rank0["lora_tensors"] > 0) == run.endswith("lora")
    assert sum(r["fsdp:full"]["bytes_read"] for r in ranks) == total  # each byte read once, by one rank


def test_fsdp_qlora_quantises_weight_by_weight_and_keeps_only_its_share(tmp_path):
    """FSDP + QLoRA without a whole 4-bit replica: each rank reads every quantised weight whole, one at a time,
    packs it as from_pretrained does and keeps its rows of the bytes (the per-block scales stay whole on the
    layer, as after a whole load). Gathered back, the packed bytes, every scale and every other weight are the
    whole 4-bit load's, bit for bit. The losses: tests/launches/test_fsdp_zero.py (one device's, sharded)."""
    sizes = file_tensor_bytes()
    total, largest = sum(sizes.values()), max(sizes.values())
    quantised = sum(b for n, b in sizes.items() if any(f".{p}." in n for p in LAYER_PLAN))  # every projection
    ranks = torchrun(tmp_path, SHARDED_CHECK, "fsdp:qlora")
    whole_held = ranks[0]["fsdp:qlora"]["whole_held"]
    for rank, records in enumerate(ranks):
        rec = records["fsdp:qlora"]
        assert rec["weightless"] and rec["tied"], rank
        assert rec["bytes_read"] <= quantised + (total - quantised) / 2 + largest, rank  # quantised ones whole
        assert rec["largest_read"] <= largest, rank  # one weight at a time
        assert rec["bytes_held"] < 0.6 * whole_held, (rank, rec["bytes_held"], whole_held)  # never the replica
    rank0 = ranks[0]["fsdp:qlora"]
    assert rank0["quantised_layers"] > 0 and rank0["lora_tensors"] > 0
    assert rank0["same_names"] and rank0["different"] == []


def test_zero3_partitions_the_weights_as_it_loads_and_trains_as_one_device(tmp_path):
    for rank, records in enumerate(torchrun(tmp_path, ZERO3_CHECK)):
        for mode, rec in records.items():
            assert rec["partitioned"] == rec["base"] > 0, (rank, mode)
            assert rec["visible"] == 0, "no whole base weight on a rank after loading"
            for held, whole in zip(rec["held"], rec["whole"]):
                assert whole / 2 <= held <= whole / 2 + 1, (rank, held, whole)  # DeepSpeed pads to equal partitions
        assert records["full"]["decay_groups"] == [records["full"]["matrices"]]  # decay on matrices, as one device
        if rank == 0:
            assert records["lora"]["lora_tensors"] > 0 and records["lora"]["lora_equal"]  # the same seeded adapters
    common = {"max_steps": 3, "micro_batch_size": 2, "global_batch_size": 4, "seq_len": 128, "logging_steps": 1,
              "lora_dropout": 0.0, "eval_at_start": False, "save_model": False}
    variants = {"sl_lora": {"lora": True}, "sl_full": {"lora": False}}
    single = launch_sweep("sl_single", 1, {**common, "strategy": "single"}, variants, runs_dir=tmp_path,
                          scripts_dir=tmp_path, echo=False)
    zero3 = launch_sweep("sl_zero3", 2, {**common, "strategy": "zero3"}, variants, runs_dir=tmp_path,
                         scripts_dir=tmp_path, echo=False)
    for name in variants:
        ref = read_log(single[name].log)
        assert len(ref) == 3
        assert [r["loss"] for r in read_log(zero3[name].log)] == pytest.approx([r["loss"] for r in ref], rel=LOSS_RTOL)
        evals = [read_log(job.log, event="eval")[0]["eval_loss"] for job in (single[name], zero3[name])]
        assert evals[1] == pytest.approx(evals[0], rel=LOSS_RTOL), name  # after 3 updates (weight decay included)
