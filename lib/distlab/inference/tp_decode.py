"""Tensor-parallel decoding (chapter 08): every rank holds a slice of each decoder layer (strategies.tp's plan)
and all ranks decode the same prompts together, token by token, with one all-reduce per block. Against
chapter 06's pipeline, where each token passes through the stages one after the other, TP shortens each
token; the pipeline keeps every stage busy with other micro-batches instead.

    torchrun --nproc-per-node 2 -m distlab.inference.tp_decode --out-dir DIR [--model M] [--num-prompts 8]
        [--batch-size 1,8] [--max-new-tokens 16] [--threads 1]

One rank (python -m distlab.inference.tp_decode ...) is the one-device run of the same code. Greedy, with
transformers' `generate` and its KV cache (each rank caches its own heads). Rank 0 writes, per batch size,
<out-dir>/b<size>/summary.json (tokens/s, mean time to first token and per-token latency) and
completions.jsonl (the tokens of every prompt, to compare runs token for token).
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distlab.cli import run_main
from distlab.generate import write_jsonl
from distlab.inference.batches import micro_batches, read_prompts
from distlab.inference.run import repeat_prompts
from distlab.jsonio import strict_json
from distlab.lm_loss import CausalLMWithLoss
from distlab.models import load_model, load_tokenizer
from distlab.paths import DEMO_PROMPTS


class StepClock:
    """A logits processor that only notes the time: `generate` calls it once per new token."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def decode(causal, tokenizer, prompts: list, batch_size: int, max_new_tokens: int) -> tuple[list[dict], float]:
    """Greedy completions of every prompt in batches of `batch_size`, with their token times; the wall time.
    Every prompt is there at the start, as in chapter 06: a row's time to first token counts from then."""
    from transformers import LogitsProcessorList  # deferred: transformers is slow to import

    rows, start = [], time.perf_counter()
    for mb in micro_batches(tokenizer, prompts, batch_size):
        clock = StepClock()
        with torch.no_grad():
            out = causal.generate(input_ids=mb.input_ids, attention_mask=mb.attention_mask, do_sample=False,
                                  max_new_tokens=max_new_tokens, logits_processor=LogitsProcessorList([clock]),
                                  pad_token_id=tokenizer.pad_token_id)
        for r, pid in enumerate(mb.ids):
            tokens = out[r, mb.input_ids.shape[1]:].tolist()
            if tokenizer.eos_token_id in tokens:  # the row ended there; later columns are padding
                tokens = tokens[:tokens.index(tokenizer.eos_token_id) + 1]
            n = len(tokens)
            rows.append({"id": pid, "tokens": tokens, "new_tokens": n, "ttft_s": clock.times[0] - start,
                         "per_token_s": (clock.times[n - 1] - clock.times[0]) / (n - 1) if n > 1 else None})
    return rows, time.perf_counter() - start


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m distlab.inference.tp_decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--model", default=None, help="local model folder or preset (default: the default model)")
    ap.add_argument("--prompts", default=str(DEMO_PROMPTS))
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--batch-size", default="1", help="rows decoded together; several: 1,8")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--comm-timeout-s", type=int, default=300)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    causal = load_model(args.model)
    causal.config.use_cache = True
    if world > 1:
        # deferred: DTensor's plan loads only where there are ranks to split over
        from torch.distributed.device_mesh import init_device_mesh

        from distlab.strategies.tp import apply_tp_plan  # deferred: the strategy imports DTensor

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.comm_timeout_s))
        apply_tp_plan(CausalLMWithLoss(causal), init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    causal.eval()
    tokenizer = load_tokenizer(args.model)
    prompts = repeat_prompts(read_prompts(args.prompts), args.num_prompts)
    for batch_size in [int(b) for b in args.batch_size.split(",")]:
        rows, wall = decode(causal, tokenizer, prompts, batch_size, args.max_new_tokens)
        if int(os.environ.get("RANK", "0")) == 0:
            out = Path(args.out_dir) / f"b{batch_size}"
            out.mkdir(parents=True, exist_ok=True)
            write_jsonl(rows, out / "completions.jsonl")
            new = sum(r["new_tokens"] for r in rows)
            latencies = [r["per_token_s"] for r in rows if r["per_token_s"] is not None]
            (out / "summary.json").write_text(strict_json({
                "ranks": world, "batch_size": batch_size, "prompts": len(prompts), "new_tokens": new, "wall_s": wall,
                "tokens_per_s": new / wall, "ttft_s": sum(r["ttft_s"] for r in rows) / len(rows),
                "per_token_s": sum(latencies) / len(latencies) if latencies else None}, indent=1))
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_main(main, sigterm_exits=True)
