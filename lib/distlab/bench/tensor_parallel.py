"""2-rank tensor parallelism (`tp`) against one device, measured side by side.

    python -m distlab.bench.tensor_parallel [--steps 12] [--rounds 3] [--model wide|tiny|<folder>]

The same full fine-tuning (the same rows, every weight trained) runs on one process
(`single`) and on two tensor-parallel ranks (`tp`), one thread per rank, in alternating rounds so that
machine noise hits both alike. Both see every row of every step, so their tokens/s (steady state after
distlab.results.schema.WARMUP_STEPS, the slower rank's step time) compare directly: speedup =
tokens_per_s(tp) / tokens_per_s(single); "scaling_efficiency" is that over 2. It prints the medians, the
spread over rounds and the ratios, then what one step sends under ddp, tp and tp with sequence parallelism
(planning.wire_bytes.step_bytes_sent, which chapter 07 checks against counted collectives). It asserts nothing:
a speedup below 1 on a CPU is an honest result (every block's all-reduce through gloo against small
matmuls), not a failure. DDP's bytes grow with the parameters, TP's with the tokens: on the wide model TP
sends less than DDP would, on the tiny one more.

The model: "wide" (default) is the tiny model's shape with an 8192-wide FFN (distlab.models.balanced_bench_model,
random weights), where the split matmuls are ~90% of a step's work and the all-reduces of b x s x h
activations are small beside them (their bytes grow with the hidden size, 256, not with the FFN width);
"tiny" is the chapters' model (FFN 688), where they are not. What a rank cannot split stays whole on both
ranks: the embedding, the norms, the LM head and the loss (Amdahl's serial part).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from distlab.cli import run_main
from distlab.config import TrainConfig
from distlab.launch.local import launch_training
from distlab.models import balanced_bench_model, resolve_model
from distlab.planning.wire_bytes import step_bytes_sent
from distlab.results import scaling_table, schema

SETUP = {"lora": False, "micro_batch_size": 4, "grad_accum": 1, "lr": 1e-3, "logging_steps": 1,
         "eval_at_start": False, "eval_at_end": False, "save_model": False, "measure_comm": False}
RUNS = {1: "single", 2: "tp"}  # world size -> strategy
WIDE_FFN = 8192  # the FFN width of the "wide" model: each rank's half of it still dominates its step


def measure(steps: int = 12, rounds: int = 3, overrides: dict | None = None, runs_dir: Path | None = None,
            timeout_s: int = 900, progress=print):
    """The scaling table (world size 1: single, 2: tp) over `rounds` alternating rounds, median and spread."""
    if steps <= schema.WARMUP_STEPS:
        raise ValueError(f"--steps {steps}: the first {schema.WARMUP_STEPS} steps are warm-up; run more")
    runs_dir = runs_dir or Path(tempfile.mkdtemp(prefix="tensor_parallel_"))
    logs: dict[int, list[Path]] = {k: [] for k in RUNS}
    for r in range(rounds):
        for k, strategy in RUNS.items():
            job = launch_training(f"tp_bench_{strategy}_r{r + 1}", k,
                                  {**SETUP, **(overrides or {}), "strategy": strategy, "max_steps": steps},
                                  timeout_s=timeout_s, runs_dir=runs_dir, echo=False)
            logs[k].append(job.log)
            if progress:
                progress(f"round {r + 1}/{rounds}, {strategy}: {job.result.elapsed_s:.0f}s")
    return scaling_table.scaling_over_rounds(logs)


def bytes_lines(model: str | None, rows: int, seq_len: int) -> list[str]:
    """MiB one rank sends per step on 2 ranks, by strategy, for this model and batch (fp32)."""
    from transformers import AutoConfig  # deferred: transformers is slow to import

    config = AutoConfig.from_pretrained(resolve_model(model))
    ways = {"ddp": ("ddp", False), "tp": ("tp", False), "tp + sequence parallel": ("tp", True)}
    sent = {way: sum(step_bytes_sent(config, strategy, 2, rows=rows, seq_len=seq_len, sequence_parallel=sp).values())
            for way, (strategy, sp) in ways.items()}
    return [f"bytes one rank sends per step ({rows} rows x {seq_len} tokens, fp32): "
            + ", ".join(f"{way} {b / 2**20:.1f} MiB" for way, b in sent.items())]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab.bench.tensor_parallel",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="wide", help="wide (FFN 8192, compute-bound), tiny, or a model folder")
    args = parser.parse_args(argv)
    model = {"wide": balanced_bench_model(WIDE_FFN, 4), "tiny": None}.get(args.model, args.model)
    with tempfile.TemporaryDirectory() as tmp:
        table = measure(args.steps, args.rounds, overrides={"model": model}, runs_dir=Path(tmp))
    print(f"model: {args.model} ({model or 'the tiny Qwen2'})")
    print("\n".join(scaling_table.scaling_lines(table, lambda k: f"{RUNS[k]} ({k} rank(s))")))
    print("tp against single; one thread per rank")
    print("\n".join(bytes_lines(model, SETUP["micro_batch_size"], TrainConfig().seq_len)))
    return 0


if __name__ == "__main__":
    run_main(main, sigterm_exits=True)  # a SIGTERM kills the launched process groups too
