"""Forward+backward time of every part of the model on each host (chapter 05's pipeline split).

    torchrun ... -m distlab.workers.layer_times --out times.json --rows 2 --set model=DIR [--set seq_len=128]

Each rank times, on its own CPU share (an emulated slow host is slow here too: the slowdown hooks each
part), the embedding, every decoder layer and the head with the loss, as the stage modules of the
`pipeline` strategy run them; the median of `--iters` passes after one warm-up pass. Rank 0 writes
{"rows", "seq_len", "layers", "hosts": [per-rank {part: seconds}]}. distlab.bench.lan_pipeline turns
these into layers per stage.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distlab import faults
from distlab.cli import run_main
from distlab.config import load_config, parse_override
from distlab.data import model_inputs
from distlab.launch.local import TINY_CONFIG
from distlab.prepare import prepare_run
from distlab.strategies.single import SingleDevice
from distlab.strategies.split import StageModule
from distlab.workers import write_result


def time_part(part, make_input, iters: int) -> float:
    """Median seconds of forward+backward of one stage part (`make_input` gives its fresh arguments)."""
    samples = []
    for i in range(iters + 1):
        args, kwargs = make_input()
        t0 = time.perf_counter()
        out = part(*args, **kwargs)
        grad = None if out.dim() == 0 else torch.ones_like(out)
        if out.requires_grad:
            out.backward(grad)
        if i:  # the first pass pays allocations and first-call overheads
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def model_parts(model, batch) -> dict:
    """{name: (stage module, a function giving its fresh inputs)}: embedding, each layer, head with the loss."""
    causal = model.causal_lm
    ids = batch["input_ids"]
    pos = batch.get("position_ids", torch.arange(ids.shape[1]).expand(ids.shape[0], -1))
    hidden = causal.get_input_embeddings()(ids).detach()

    def fresh_hidden():
        return (hidden.clone().requires_grad_(True),), {"position_ids": pos}

    parts = {"embed": (StageModule(causal, range(0), True, False), lambda: ((ids,), {"position_ids": pos}))}
    for i in range(causal.config.num_hidden_layers):
        parts[f"layer{i}"] = (StageModule(causal, range(i, i + 1), False, False), fresh_hidden)
    parts["head"] = (StageModule(causal, range(0), False, True),
                     lambda: ((hidden.clone().requires_grad_(True),), {"position_ids": pos, "labels": batch["labels"]}))
    return parts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="JSON written by rank 0")
    ap.add_argument("--rows", type=int, default=2, help="rows per micro-batch")
    ap.add_argument("--iters", type=int, default=2, help="timed passes per part (after one warm-up pass)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="TrainConfig overrides")
    args = ap.parse_args(argv)

    cfg = load_config(str(TINY_CONFIG), dict(parse_override(s) for s in args.set))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.collective_timeout_s))
    try:
        torch.set_num_threads(1)
        choice, _, train_data, _, model = prepare_run(cfg, SingleDevice())
        model.train()
        batch = model_inputs(train_data.batch(list(range(args.rows))), choice.device)
        mine = {}
        for name, (module, make) in model_parts(model, batch).items():
            faults.install_slowdown(module)  # the emulated slow host is slow here too
            mine[name] = time_part(module, make, args.iters)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if dist.get_rank() == 0:
            write_result(args.out, {"rows": args.rows, "seq_len": int(batch["input_ids"].shape[1]),
                                    "layers": model.causal_lm.config.num_hidden_layers, "hosts": gathered})
        dist.barrier()  # nobody exits (and tears down the store) before rank 0 is done
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
