"""Worker: the gradient of a run's first optimizer step, as the one training loop computes it.

    python -m distlab.lan.gradcheck --out g1.pt --set strategy=single ...            one process
    torchrun --nproc-per-node 2 -m distlab.lan.gradcheck --out g2.pt --set strategy=ddp --set rank_shares=[3,1]

Both go through distlab.train's pieces (StepBatches with rank_shares, Strategy.forward_backward with the
global-token normalisation, DDP's all-reduce); rank 0 saves {name: gradient} of the trained weights.
With dropout off and fp32, the uneven-batch DDP gradient must equal the single-process one
(tests/clusters/test_lan_runs.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from distlab.batching import StepBatches
from distlab.cli import run_main
from distlab.config import load_config, parse_override
from distlab.launch.local import TINY_CONFIG
from distlab.prepare import prepare_run
from distlab.strategies import make_strategy


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--config", default=str(TINY_CONFIG))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, dict(parse_override(s) for s in args.set))
    torch.set_num_threads(1)
    strategy = make_strategy(cfg.strategy)
    strategy.setup(cfg)
    try:
        choice, _, train_data, _, model = prepare_run(cfg, strategy)
        model, _, _ = strategy.prepare(model, choice, cfg)
        accum = cfg.micro_steps(strategy.data_parallel_size)
        batches = StepBatches(len(train_data), cfg.micro_batch_size, accum, strategy.data_parallel_size,
                              strategy.data_parallel_rank, cfg.seed, cfg.rank_shares)
        micro = [train_data.batch(rows) for rows in batches.next_step()]
        tokens = torch.tensor([float(sum(b["n_label_tokens"] for b in micro))], dtype=torch.float64)
        tokens = strategy.all_reduce_sum(tokens)
        strategy.forward_backward(model, micro, choice, int(tokens[0]))
        grads = {n: p.grad.detach().clone() for n, p in strategy.unwrap(model).named_parameters() if p.requires_grad}
        if strategy.is_main:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"grads": grads, "label_tokens": int(tokens[0])}, args.out)
        strategy.barrier()
    finally:
        strategy.teardown()


if __name__ == "__main__":
    run_main(main)
