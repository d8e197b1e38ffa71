"""A few FSDP2 training steps traced with torch.profiler on rank 0: when each all-gather and
reduce-scatter runs, against the compute that needs (or produces) its tensors (chapter 03).

    torchrun --standalone --nproc-per-node 2 -m distlab.measure.fsdp_trace OUT_DIR [--steps 2]

Every rank fully fine-tunes the tiny model with `fully_shard` on each decoder layer and on the root
(FSDP2's default: prefetch the next layer's all-gather, reshard after forward), runs two untraced
steps, then rank 0 traces `--steps` steps with CPU activities and writes OUT_DIR/rank0.json: the
steps' spans in ms from the first traced step's start, each with its thread:

* `compute`: the matrix products and attention of forward and backward (aten::mm, addmm, bmm,
  scaled-dot-product attention) on the training thread: the work FSDP wants to hide its
  communication behind;
* `all-gather` and `reduce-scatter`: gloo's transfers, which run on gloo's worker threads while the
  training thread goes on (FSDP2 issues them asynchronously: the next layer's all-gather before
  this layer's forward, a layer's reduce-scatter as soon as its gradients exist);
* `step`: each traced step.

How much of the communication overlaps compute is `overlap_share` in distlab.chapters.ch03: the
part of the collectives' time during which the training thread was computing. No timing hook is
installed; the profiler's own cost (a few microseconds per recorded op) is in every span alike.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.profiler import ProfilerActivity, profile, record_function

from distlab.cli import run_main
from distlab.config import TrainConfig
from distlab.jsonio import strict_json
from distlab.measure.chrome_trace import spans as chrome_trace_spans

COMPUTE_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
               "aten::_scaled_dot_product_flash_attention_for_cpu_backward")
# gloo has no reduce-scatter of its own: the profiler records each of FSDP2's c10d::_reduce_scatter_base_ calls
# as a gloo all-reduce (of which the rank keeps its slice), the only all-reduce in these steps
COLLECTIVES = {"gloo:all_gather": "all-gather", "gloo:all_reduce": "reduce-scatter"}


def traced_steps(out_dir: Path, steps: int, rows: int = 2, seq_len: int = 256) -> dict:
    from distlab.models import load_model  # deferred: transformers is slow to import

    rank = dist.get_rank()
    torch.manual_seed(rank)  # each rank its own rows
    model = load_model(None)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, model.config.vocab_size, (rows, seq_len))

    def step():
        with record_function("step"):
            model(input_ids=batch, labels=batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    for _ in range(2):  # warm-up
        step()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    result = {}
    if rank == 0:
        trace = out_dir / "rank0.trace.json"
        prof.export_chrome_trace(str(trace))
        result = {"rank": 0, "steps": steps, "rows": rows, "seq_len": seq_len,
                  "spans": spans_of(json.loads(trace.read_text()))}
        trace.unlink()
        (out_dir / "rank0.json").write_text(strict_json(result))
    dist.barrier()
    return result


def _fsdp_event(name: str) -> tuple[str, str] | None:
    if name == "step":
        return "step", name
    if name in COMPUTE_OPS:
        return "compute", name
    return (COLLECTIVES[name], name) if name in COLLECTIVES else None


def spans_of(chrome_trace: dict) -> list[dict]:
    """The traced steps, compute ops and collectives from a chrome trace, in ms from the first step's start."""
    return chrome_trace_spans(chrome_trace, "step", _fsdp_event)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab.measure.fsdp_trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TrainConfig.collective_timeout_s))
    try:
        traced_steps(args.out_dir, args.steps)
    finally:
        # only once the traced model is gone, as in ddp_trace: a model that outlives its group can deadlock
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_main(main)
