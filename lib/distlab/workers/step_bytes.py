"""The bytes one rank sends in one optimizer step of the same full fine-tuning run as ddp, fsdp, tp, tp with
sequence parallelism and tp with the vocabulary split (chapter 07), each counted by an instrument that sees its
collectives, with the step's loss.

    torchrun --nproc-per-node 2 -m distlab.workers.step_bytes --out bytes.json --rows 4 --set seq_len=256

`--set lora=true` counts LoRA instead of full fine-tuning (chapter 08's link sweep trains LoRA). The five run one
after the other in the same ranks, each from the same initial weights on the same global
batch (the first `--rows` rows of the training data): ddp and fsdp give each rank rows / k of them, tp every
rank all of them. ddp's and fsdp's collectives are counted by the training loop's meter (`measure_comm`: DDP's
comm hook, and FSDP2's all-gathers and reduce-scatters through torch.distributed), DTensor's by a dispatch
mode (distlab.measure.collectives), which sees the functional collectives torch.distributed never issues.
Counting is its own run: nothing here is timed. Rank 0 writes {"world_size", "rows", "seq_len", "label_tokens",
"runs": {name: {"loss", "sent_bytes", "counted_by", "calls"}}}.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from distlab.cli import run_main
from distlab.config import load_config, parse_override
from distlab.data import build_sft_data
from distlab.device import choose_device
from distlab.launch.local import TINY_CONFIG
from distlab.lm_loss import CausalLMWithLoss
from distlab.measure.collectives import CollectiveCounter, sent_per_rank
from distlab.measure.meter import Meter
from distlab.models import load_model, load_tokenizer
from distlab.prepare import apply_lora, seed_everything
from distlab.strategies import make_strategy
from distlab.workers import write_result

RUNS = {"ddp": {"strategy": "ddp"}, "fsdp": {"strategy": "fsdp"}, "tp": {"strategy": "tp"},
        "tp + sequence parallel": {"strategy": "tp", "sequence_parallel": True},
        "tp + vocabulary parallel": {"strategy": "tp", "vocab_parallel": True}}  # {name: TrainConfig fields}
RING = {"ddp": 2, "fsdp": 1}  # the meter's buffers: DDP's all-reduced buckets (2 passes), FSDP's gathers and scatters


def one_step(cfg, rows: list[int], train_data) -> dict:
    """One optimizer step of `cfg.strategy` on the global batch `rows`, its collectives counted."""
    strategy = make_strategy(cfg.strategy)
    strategy.meter = Meter.for_config(cfg)  # ddp and fsdp: the loop's own instruments
    strategy.setup(cfg)
    try:
        choice = choose_device(cfg.device, cfg.dtype, strategy.local_rank)
        seed_everything(cfg.seed)
        model = load_model(cfg.model, dtype=choice.dtype, attn_implementation=cfg.attn_implementation)
        model = CausalLMWithLoss(apply_lora(model, cfg) if cfg.lora else model)  # `--set lora=true`: the adapters'
        model, optimizer, scheduler = strategy.prepare(model, choice, cfg)
        k, dp = strategy.world_size, strategy.data_parallel_size
        share = len(rows) // dp  # this rank's rows: a slice of the batch (ddp, fsdp) or all of it (tp)
        mine = rows[strategy.data_parallel_rank * share:(strategy.data_parallel_rank + 1) * share]
        total_tokens = train_data.batch(rows)["n_label_tokens"]
        strategy.meter.take_step()  # anything set-up sent is not the step's
        counting = CollectiveCounter() if cfg.strategy == "tp" else contextlib.nullcontext()
        with counting as counter:
            loss, _ = strategy.train_step(model, [train_data.batch(mine)], choice, total_tokens, optimizer, scheduler,
                                          cfg.max_grad_norm)
        if counter is not None:
            calls, sent, by = counter.calls, sent_per_rank(counter.calls, k), "dispatch mode (DTensor's collectives)"
        else:
            buffers = strategy.meter.take_step()["comm_bytes"]
            calls, sent, by = [], RING[cfg.strategy] * (k - 1) / k * buffers, "training loop's meter (measure_comm)"
        strategy.meter.close()
        total = torch.tensor([loss], dtype=torch.float64)
        if dp > 1:
            dist.all_reduce(total)  # each data-parallel rank holds its rows' share of the step loss
        return {"loss": float(total), "sent_bytes": sent, "counted_by": by,
                "calls": sorted([op, n, count] for (op, n), count in Counter(map(tuple, calls)).items())}
    finally:
        strategy.teardown(keep_group=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="JSON written by rank 0")
    ap.add_argument("--rows", type=int, default=4, help="rows per optimizer step, all ranks together")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="TrainConfig overrides")
    args = ap.parse_args(argv)

    base = {"lora": False, "eval_file": None, **dict(parse_override(s) for s in args.set)}
    cfg = load_config(str(TINY_CONFIG), base)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.collective_timeout_s))
    try:
        torch.set_num_threads(1)
        train_data = build_sft_data(cfg.train_file, load_tokenizer(cfg.model), cfg.seq_len, cfg.packing, cfg.overlong,
                                    cfg.labels)
        rows = list(range(args.rows))
        runs = {}
        for name, settings in RUNS.items():
            run_cfg = cfg.replace(**settings, measure_comm=settings["strategy"] != "tp")
            runs[name] = one_step(run_cfg, rows, train_data)
        if dist.get_rank() == 0:
            write_result(args.out, {"world_size": dist.get_world_size(), "rows": args.rows, "seq_len": cfg.seq_len,
                                    "label_tokens": train_data.batch(rows)["n_label_tokens"], "runs": runs})
        dist.barrier()  # nobody exits (and tears down the store) before rank 0 is done
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
