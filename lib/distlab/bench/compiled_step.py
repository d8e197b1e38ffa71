"""The training step with every decoder block compiled (`TrainConfig(compile=True)`) against the same step eager.

    python -m distlab.bench.compiled_step [--steps 12] [--rounds 3] [--warmup 2] [--full] [--warm-cache]
                                          [--out figures]

What is measured: the default tiny model's LoRA step as distlab trains it (the default TrainConfig: packed
rows, per-document attention, chunked cross entropy, fused AdamW for both lines), on the CPU with one
thread, once with eager blocks and once with each block compiled whole (distlab.strategies.base
.compile_layers, applied by the strategy's `prepare` exactly as a run with compile=true applies it).
`--full` adds the same pair for full fine-tuning (lora=false). Each line's step is the one a run with that
setting takes: the eager blocks draw LoRA's dropout from 16-bit coins (distlab.dropout), a compiled block
takes the stock dropout into its generated kernel.

How: both models are built in this process by distlab.prepare.prepare_run from the same seed, and their
weights and adapters are checked identical; both step on the same pre-collated batches (the collate is the
host's work, the same for both, so it is left out). One step is the loop's own `train_step`: forward,
backward, gradient clipping, fused AdamW and the schedule. Before any timing, each model's loss on the
first batch is taken with dropout off (eval mode, no gradients); they must agree to 1e-4 relative, else
nothing is timed: the benchmark never compares two different computations. Then each model runs its
warm-up steps (the compiled one compiles its training graph there), and the timed rounds alternate
(eager, compiled, eager, compiled, ...) over the same batches, so machine noise hits both alike. Each
line reports the median milliseconds per step over rounds with the min and max (the spread), real
(non-pad) tokens per second at the median, and the compiled line its ratio to eager in tokens/s: the
ratio of the medians, with the range of the per-round ratios. The warm-up and the loss check are timed
apart from the rounds; their extra seconds on the compiled line are what compiling cost (the check
compiles the no-grad graph an evaluation would use, the warm-up the training graph). Each pair compiles
into an empty Inductor cache (unless `--warm-cache`): the seconds are a first compile's, as on a new
machine, not what is left of it after earlier runs cached their graphs. A recompile during the timed
rounds would be counted (`recompiles`), never hidden in the median.

What the result is for: whether compiling the blocks pays on this machine at this size, and what the
compile costs before the first useful step, measured rather than assumed before a longer run turns
compile on. On a CPU, with a 256-wide model and one thread, the matmuls and attention dominate and run
the same kernels compiled or not: compiling may buy little here, or cost, and this run does not predict
a GPU's gain (fused elementwise kernels, fewer launches), which bench/mfu_ladder measures. Ratios are
printed, never asserted in a timed test.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from distlab.cli import run_main
from distlab.config import TrainConfig
from distlab.data import model_inputs
from distlab.device import autocast
from distlab.prepare import prepare_run
from distlab.provenance import save_table, stamp
from distlab.strategies import make_strategy

MODULE = "distlab.bench.compiled_step"  # what `make benchmarks` runs; its table names it in the sidecar
TABLE = "bench_compiled_step.csv"
CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"  # where Inductor keeps compiled graphs and kernels between runs
LOSS_RTOL = 1e-4  # the two models' first-batch losses must agree this closely before anything is timed
COLUMNS = ("training", "blocks", "ms_per_step", "ms_min", "ms_max", "tokens_per_s", "vs_eager", "vs_eager_min",
           "vs_eager_max", "warmup_s", "check_s", "recompiles", "check_loss", "loss_rel_diff")


class LossMismatch(RuntimeError):
    """The eager and compiled models disagree on the first batch: timing them would compare different work."""


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters  # deferred: only a compiled line needs Dynamo's counters

    return int(counters["stats"]["unique_graphs"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Line:
    """One model of a pair, ready to step: its strategy, model, fused AdamW and schedule."""

    def __init__(self, cfg: TrainConfig, compiled: bool):
        self.compiled = compiled
        self.strategy = make_strategy("single")
        self.choice, _, self.data, _, model = prepare_run(cfg, self.strategy)  # seeded: the same weights twice
        run_cfg = cfg.replace(compile=compiled, fused_optimizer=True)
        self.model, self.optimizer, self.scheduler = self.strategy.prepare(model, self.choice, run_cfg)
        if compiled and "compile" not in self.strategy.transforms:
            raise RuntimeError(f"compile=true compiled nothing: the steps taken were {self.strategy.transforms}")
        self.max_grad_norm = cfg.max_grad_norm
        self.ms: list[float] = []

    @torch.no_grad()
    def check_loss(self, batch) -> tuple[float, float]:
        """(mean loss per label token on `batch` with dropout off, seconds it took, a compile included)."""
        t0 = time.perf_counter()
        self.model.eval()
        with autocast(self.choice):
            loss = float(self.model(**model_inputs(batch, self.choice.device))) / batch["n_label_tokens"]
        self.model.train()
        return loss, time.perf_counter() - t0

    def run(self, batches) -> float:
        """Seconds for one training step on each batch, the device waited for at the end only."""
        t0 = time.perf_counter()
        for batch in batches:
            self.strategy.train_step(self.model, [batch], self.choice, batch["n_label_tokens"], self.optimizer,
                                     self.scheduler, self.max_grad_norm)
        _sync(self.choice.device)
        return time.perf_counter() - t0


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def measure_pair(cfg: TrainConfig, steps: int, rounds: int, warmup: int, training: str, echo=print) -> list[dict]:
    """The eager and the compiled line of one configuration: two table rows."""
    eager, compiled = Line(cfg, compiled=False), Line(cfg, compiled=True)
    if not _same_weights(eager.model, compiled.model):
        raise RuntimeError("the eager and compiled models were built with different weights")
    data, mb = eager.data, cfg.micro_batch_size
    batches = [data.batch([(i * mb + j) % len(data) for j in range(mb)]) for i in range(warmup + steps)]
    warm, timed = batches[:warmup], batches[warmup:]
    tokens = sum(b["n_real_tokens"] for b in timed)

    (loss_e, check_e), (loss_c, check_c) = eager.check_loss(batches[0]), compiled.check_loss(batches[0])
    rel = abs(loss_c - loss_e) / abs(loss_e)
    echo(f"{training}: first-batch loss eager {loss_e:.6f}, compiled {loss_c:.6f} (relative difference {rel:.1e})")
    if not rel <= LOSS_RTOL:
        raise LossMismatch(f"{training}: the compiled model's loss on the first batch ({loss_c:.6f}) differs from the "
                           f"eager one's ({loss_e:.6f}) by {rel:.1e} relative (> {LOSS_RTOL:g}): not timed")
    warm_e, warm_c = eager.run(warm), compiled.run(warm)
    echo(f"{training}: warm-up ({warmup} steps) eager {warm_e:.1f} s, compiled {warm_c:.1f} s (compiling there)")
    graphs = _unique_graphs()
    for r in range(rounds):
        for line in (eager, compiled):
            line.ms.append(line.run(timed) / steps * 1e3)
        echo(f"{training} round {r + 1}/{rounds}: eager {eager.ms[-1]:7.1f} ms/step, "
             f"compiled {compiled.ms[-1]:7.1f} ms/step")
    recompiles = _unique_graphs() - graphs

    ratios = [e / c for e, c in zip(eager.ms, compiled.ms)]  # compiled tokens/s over eager tokens/s, per round
    rows = []
    for line, warm_s, check_s, loss in ((eager, warm_e, check_e, loss_e), (compiled, warm_c, check_c, loss_c)):
        med = statistics.median(line.ms)
        vs = (statistics.median(eager.ms) / med, min(ratios), max(ratios)) if line.compiled else (1.0, 1.0, 1.0)
        rows.append({"training": training, "blocks": "compiled" if line.compiled else "eager", "ms_per_step": med,
                     "ms_min": min(line.ms), "ms_max": max(line.ms), "tokens_per_s": tokens / (med * steps / 1e3),
                     "vs_eager": vs[0], "vs_eager_min": vs[1], "vs_eager_max": vs[2], "warmup_s": warm_s,
                     "check_s": check_s, "recompiles": recompiles if line.compiled else 0, "check_loss": loss,
                     "loss_rel_diff": rel})
    return rows


def compare(steps: int = 12, rounds: int = 3, warmup: int = 2, micro_batch_size: int = 4, seq_len: int = 256,
            full: bool = False, cold: bool = True, echo=print) -> pd.DataFrame:
    """Every line pair (LoRA, and full fine-tuning with `full`), one thread, in this process. `cold`: compile
    into an empty Inductor cache (see `cold_compile`), so the compile seconds are a first compile's."""
    if warmup < 1 or steps < 1 or rounds < 1:
        raise ValueError(f"steps, rounds and warmup must be at least 1 (the compile happens in the warm-up): "
                         f"steps={steps}, rounds={rounds}, warmup={warmup}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = TrainConfig(micro_batch_size=micro_batch_size, seq_len=seq_len, max_steps=warmup + rounds * steps,
                      eval_file=None, save_model=False, progress=False)
    pairs = [("lora", cfg)] + ([("full", cfg.replace(lora=False))] if full else [])
    rows = []
    try:
        for training, pair_cfg in pairs:
            with cold_compile() if cold else contextlib.nullcontext():  # each pair's own first compile
                rows += measure_pair(pair_cfg, steps, rounds, warmup, training, echo)
    finally:
        torch.set_num_threads(threads)
    return pd.DataFrame(rows, columns=list(COLUMNS))


@contextlib.contextmanager
def cold_compile():
    """Inductor's on-disk cache in a fresh temporary folder while the block compiles: the compile seconds are then
    those of a first compile on a new machine, not a fraction of it that depends on what this user compiled
    before (a compile whose graphs are all cached took about a tenth of the time here)."""
    saved = os.environ.get(CACHE_VARIABLE)
    with tempfile.TemporaryDirectory(prefix="distlab-compile-") as folder:
        os.environ[CACHE_VARIABLE] = folder
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop(CACHE_VARIABLE, None)
            else:
                os.environ[CACHE_VARIABLE] = saved


def compile_seconds(df: pd.DataFrame, training: str = "lora") -> tuple[float, float]:
    """What compiling cost before the first timed step, (training graph, no-grad graph): the compiled line's
    warm-up and loss-check seconds, each less eager's."""
    pair = df[df.training == training].set_index("blocks")[["warmup_s", "check_s"]]
    extra = pair.loc["compiled"] - pair.loc["eager"]
    return float(extra["warmup_s"]), float(extra["check_s"])


def summary(df: pd.DataFrame, rounds: int, training: str = "lora") -> str:
    row = df[(df.training == training) & (df.blocks == "compiled")].iloc[0]
    what = "compiled blocks" if training == "lora" else f"compiled blocks ({training} fine-tuning)"
    train_s, check_s = compile_seconds(df, training)
    return (f"{what}: {row.vs_eager:.2f}x eager tokens/s (range {row.vs_eager_min:.2f}-{row.vs_eager_max:.2f} "
            f"over {rounds} rounds), compile took {train_s + check_s:.1f} s (the training graph {train_s:.1f} s, "
            f"the loss check's no-grad graph {check_s:.1f} s)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps per round and line")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (eager, compiled, ...)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps of each line (the compile)")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--full", action="store_true", help="also the full fine-tuning pair (lora=false)")
    parser.add_argument("--warm-cache", action="store_true",
                        help="compile with Inductor's usual on-disk cache (default: an empty one, a first compile)")
    parser.add_argument("--out", metavar="DIR", help=f"save the table as DIR/{TABLE} with a provenance sidecar")
    args = parser.parse_args(argv)
    try:
        df = compare(args.steps, args.rounds, args.warmup, args.micro_batch_size, args.seq_len, args.full,
                     cold=not args.warm_cache)
    except LossMismatch as e:
        print(f"{MODULE}: {e}", file=sys.stderr, flush=True)
        return 1
    print(df.to_string(index=False, float_format=lambda v: f"{v:.2f}", formatters={"loss_rel_diff": "{:.1e}".format,
                                                                                  "check_loss": "{:.4f}".format}))
    for training in dict.fromkeys(df.training):
        print(summary(df, args.rounds, training))
    if args.out:
        arguments = {"steps": args.steps, "rounds": args.rounds, "warmup": args.warmup,
                     "micro_batch_size": args.micro_batch_size, "seq_len": args.seq_len, "full": args.full,
                     "warm_cache": args.warm_cache}
        from distlab.publish import freshness  # deferred: only saving the table needs the digest

        run_stamp = {**freshness.benchmark_provenance(MODULE, arguments),
                     **stamp("distlab-tiny", 1, threads_per_rank=1)}
        print(f"wrote {save_table(df.round(6), Path(args.out) / TABLE, run_stamp)}")
    return 0


if __name__ == "__main__":
    run_main(main)
