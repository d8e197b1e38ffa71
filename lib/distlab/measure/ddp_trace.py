"""One DDP training step traced with torch.profiler: when each gradient bucket's all-reduce runs,
against the backward pass that produces the gradients (chapter 02).

    torchrun --standalone --nproc-per-node 2 -m distlab.measure.ddp_trace OUT_DIR [--bucket-cap-mb 1]

Every rank fine-tunes all weights of the tiny model (its gradients are big enough to fill several
buckets), runs two untraced steps (DDP rebuilds its buckets in the order gradients became ready during
the first), then traces one step with CPU activities and writes OUT_DIR/rank<r>.json:

* `spans`: the step's phases (forward, backward, optimizer step: record_function markers on the
  training thread), every autograd op of the backward pass, and every gloo all-reduce, each with the
  thread it ran on, in ms from the step's start. torch 2.13 records a bucket's all-reduce twice:
  `c10d::allreduce_` on the training thread, which only hands the bucket to gloo and returns, and
  `gloo:all_reduce` on one of gloo's worker threads, the transfer itself.
* `buckets`: DDP's bucket assignment, as a comm hook saw it on the traced step: bucket index -> the
  parameters in it (DDP fills buckets in reverse order of the parameters, the order backward
  produces their gradients) and its bytes.

No timing hook is installed around the all-reduces (the recording hook only notes which parameters a
bucket holds and hands the bucket to DDP's own asynchronous all-reduce), so the overlap is DDP's.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

from distlab.cli import finite_float, run_main
from distlab.config import TrainConfig
from distlab.jsonio import strict_json
from distlab.measure.chrome_trace import spans as chrome_trace_spans

PHASES = ("forward", "backward", "optimizer step")
BACKWARD_OP = "autograd::engine::evaluate_function: "
GLOO_ALLREDUCE = "gloo:all_reduce"  # the transfer, on one of gloo's worker threads
ALLREDUCE_CALL = "c10d::allreduce_"  # the training thread handing a bucket to gloo (returns at once)


def traced_step(out_dir: Path, bucket_cap_mb: float, rows: int = 2, seq_len: int = 128) -> dict:
    from distlab.models import load_model  # deferred: transformers is slow to import

    rank = dist.get_rank()
    torch.manual_seed(rank)  # each rank its own rows
    model = DDP(load_model(None), bucket_cap_mb=bucket_cap_mb)
    names = {id(p): n for n, p in model.module.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    buckets: dict[int, dict] = {}

    def note_bucket(state, bucket):
        buckets[bucket.index()] = {"params": [names[id(p)] for p in bucket.parameters()],
                                   "bytes": bucket.buffer().numel() * bucket.buffer().element_size()}
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, note_bucket)
    batch = torch.randint(0, model.module.config.vocab_size, (rows, seq_len))

    def step():
        with record_function("forward"):
            loss = model(input_ids=batch, labels=batch).loss
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer step"):
            opt.step()
            opt.zero_grad(set_to_none=True)

    for _ in range(2):  # warm-up; DDP rebuilds its buckets after the first step
        step()
    buckets.clear()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("step"):
            step()
    trace = out_dir / f"rank{rank}.trace.json"
    prof.export_chrome_trace(str(trace))
    result = {"rank": rank, "bucket_cap_mb": bucket_cap_mb, "spans": spans_of(json.loads(trace.read_text())),
              "buckets": [{"index": i, **buckets[i]} for i in sorted(buckets)]}
    trace.unlink()
    (out_dir / f"rank{rank}.json").write_text(strict_json(result))
    return result


def _ddp_event(name: str) -> tuple[str, str] | None:
    if name in PHASES:
        return "phase", name
    if name.startswith(BACKWARD_OP):
        return "backward op", name[len(BACKWARD_OP):]
    return {GLOO_ALLREDUCE: ("all-reduce", name), ALLREDUCE_CALL: ("all-reduce call", name)}.get(name)


def spans_of(chrome_trace: dict) -> list[dict]:
    """The step's phases, backward ops and all-reduces from a chrome trace, in ms from the step's start."""
    return chrome_trace_spans(chrome_trace, "step", _ddp_event)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab.measure.ddp_trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--bucket-cap-mb", type=finite_float, default=1.0)
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TrainConfig.collective_timeout_s))
    try:
        traced_step(args.out_dir, args.bucket_cap_mb)
    finally:
        # only once the traced model is gone: a DDP model freed after its group drops the group's last reference
        # with the GIL held, and can deadlock against a gloo thread finishing an all-reduce
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_main(main)
