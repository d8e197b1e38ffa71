"""2-rank DDP efficiency against the 1-rank baseline, measured side by side.

    python -m distlab.bench.ddp_scaling [--steps 40] [--rounds 3]

Both runs use one thread per rank (the 1-rank baseline too: two threads on a 2-core machine
would make it a different program), the same global batch (so 1 rank accumulates twice as many
micro-batches), the same data and seed. Rounds alternate 1 and 2 ranks so that machine noise
hits both alike; the median of each one's tokens_per_s is compared, and the spread over the rounds is
printed with it. Chapter 02 calls the same `measure`, so the two agree by construction. Every number is a column of
distlab.results.schema (steady state after schema.WARMUP_STEPS, the slowest rank's step time):
scaling_efficiency = tokens_per_s(2) / (2 x tokens_per_s(1)).

Throughput is measured with the timing hook OFF (`measure_comm` False): the hook
(distlab.measure.comm.CommTimer) waits for every bucket's all-reduce, which removes the overlap of
communication with backward that DDP's speed relies on. Where a step's time goes (compute, waiting for
the slower rank, the transfer) is measured by `breakdown`, in separate runs with the hook on.

`ceiling` measures what the machine itself allows two ranks: two independent one-rank runs at once
against one alone. Efficiency below 1 that the ceiling already shows is the machine's (two cores sharing
memory bandwidth and caches), not DDP's; the rest is what DDP costs.
"""

from __future__ import annotations

import argparse
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd

from distlab.cli import run_main
from distlab.launch.local import alternating_rounds, launch_training
from distlab.results import scaling_table, schema

# What both chapter 02 and this benchmark run: the chapter adds its model/device parameters on top.
# No timing hook in a throughput run (see the module docstring).
SETUP = {"strategy": "ddp", "micro_batch_size": 2, "global_batch_size": 8, "logging_steps": 1,
         "eval_at_start": False, "eval_at_end": False, "save_model": False, "lora_dropout": 0.0,
         "measure_comm": False}


def measure(steps: int = 40, rounds: int = 3, world_sizes=(1, 2), overrides: dict | None = None,
            runs_dir: Path | None = None, timeout_s: int = 900, progress=print):
    """(scaling table, {world size: jobs}): `rounds` alternating rounds at each world size, the median
    round per world size, its spread (distlab.results.scaling_table.scaling_over_rounds)."""
    if steps <= schema.WARMUP_STEPS:
        raise ValueError(f"--steps {steps}: the first {schema.WARMUP_STEPS} steps are warm-up; run more")
    setup = {**SETUP, **(overrides or {}), "max_steps": steps}
    if setup["measure_comm"]:
        raise ValueError("throughput is measured with the timing hook off (measure_comm False); "
                         "use breakdown() for the compute / communication split")
    if runs_dir is None:
        runs_dir = Path(tempfile.mkdtemp(prefix="ddp_scaling_"))
    jobs = alternating_rounds("ddp_scaling", list(world_sizes), setup, rounds, runs_dir=runs_dir,
                              timeout_s=timeout_s, progress=progress)
    table = scaling_table.scaling_over_rounds({k: [job.log for job in js] for k, js in jobs.items()})
    return table, jobs


def breakdown(steps: int = 40, world_sizes=(1, 2), overrides: dict | None = None, runs_dir: Path | None = None,
              timeout_s: int = 900, progress=print):
    """{world size: job}: one run per world size with the timing hook on (compute, wait, transfer per step:
    distlab.results.scaling_table.comm_split). Separate from `measure`: the hook serialises communication."""
    setup = {**SETUP, **(overrides or {}), "max_steps": steps, "measure_comm": True}
    if runs_dir is None:
        runs_dir = Path(tempfile.mkdtemp(prefix="ddp_breakdown_"))
    jobs = alternating_rounds("ddp_breakdown", list(world_sizes), setup, 1, runs_dir=runs_dir,
                              timeout_s=timeout_s, progress=progress)
    return {k: js[0] for k, js in jobs.items()}


def ceiling(steps: int = 40, rounds: int = 3, overrides: dict | None = None, runs_dir: Path | None = None,
            timeout_s: int = 900, progress=print) -> pd.DataFrame:
    """What this machine allows two ranks before any communication: `rounds` alternating rounds of a
    one-rank run alone and of two independent one-rank runs at once (two torchruns, no process group
    between them, nothing exchanged). Per round, `ceiling` = the pair's mean tokens/s / the lone run's:
    the scaling efficiency two DDP ranks would reach if communication and waiting cost nothing. It is
    below 1 where the two cores share what one run had alone (memory bandwidth, caches, a hypervisor)."""
    setup = {**SETUP, **(overrides or {}), "max_steps": steps, "measure_comm": False}
    if runs_dir is None:
        runs_dir = Path(tempfile.mkdtemp(prefix="ddp_ceiling_"))

    def tokens_per_s(name: str) -> float:
        job = launch_training(name, 1, setup, timeout_s=timeout_s, runs_dir=runs_dir, echo=False)
        return scaling_table.run_summary(job.log)["tokens_per_s"]

    rows = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        for r in range(1, rounds + 1):
            alone = tokens_per_s(f"ceiling_alone_r{r}")
            pair = list(pool.map(tokens_per_s, (f"ceiling_pair_a_r{r}", f"ceiling_pair_b_r{r}")))
            rows.append({"round": r, "alone_tokens_per_s": alone, "together_tokens_per_s": sum(pair) / 2,
                         "ceiling": sum(pair) / 2 / alone})
            if progress:
                progress(f"round {r}/{rounds}: one run alone, then two at once: ceiling {rows[-1]['ceiling']:.2f}")
    return pd.DataFrame(rows).set_index("round")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab.bench.ddp_scaling", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        table, _ = measure(args.steps, args.rounds, runs_dir=Path(tmp))
        bound = ceiling(args.steps, args.rounds, runs_dir=Path(tmp) / "ceiling")["ceiling"]
    print("\n".join(scaling_table.scaling_lines(table)))
    two = table.set_index("world_size").loc[2]
    print("target scaling_efficiency >= 0.90; timing hooks off")
    print(f"ceiling {bound.median():.2f} (rounds {bound.min():.2f}-{bound.max():.2f}): two independent 1-rank runs at "
          f"once against one alone, the efficiency 2 ranks reach with no communication on this machine; DDP "
          f"reaches {two['scaling_efficiency'] / bound.median():.2f} of it")
    return 0


if __name__ == "__main__":
    run_main(main, sigterm_exits=True)  # a SIGTERM kills the launched process groups too
