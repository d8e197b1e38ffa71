"""Uneven devices balanced: DDP with per-rank batch shares from a calibration against the naive equal split.

    python -m distlab.bench.lan_balance [--quotas 1,0.5] [--steps 8] [--rounds 2] [--three-node]

Each emulated host (network namespace, 1 Gbit link) gets a CPU quota; one with 0.5 of a core is about 2x
slower. A short calibration (distlab.lan.calibrate) measures each rank's rows/s; the shares go to
TrainConfig.rank_shares. Then ONE torchrun launch runs naive, balanced, naive, balanced... (`--variant`
runs in the same ranks), so machine noise hits both alike; the median steady-state step time of each is
compared (the slowest rank's, as schema.summarise takes it). Theory (distlab.batching.ideal_step_ratio):
balanced / naive = world x slowest speed / sum of speeds, 2/3 for quotas 1 / 0.5. `--three-node`: the LAN
cluster guide's three hosts as well, 100/50/50% (one host twice as fast as the other two: theory 0.75),
with the speedup over the fast host alone. Each setup prints its measured ratio against its theory.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from distlab.batching import (
    ideal_speedups,
    ideal_step_ratio,
    predicted_step_ratio,
    rows_per_rank,
    shares_from_throughput,
    step_ratio_with_fixed,
)
from distlab.cli import finite_float, run_main
from distlab.config import load_config
from distlab.jsonio import strict_json
from distlab.lan import host_runs
from distlab.lan.cgroups import HostLimits
from distlab.lan.cgroups import supported as cgroups_supported
from distlab.launch.local import TINY_CONFIG
from distlab.paths import BUILD_DIR, RUNS_DIR
from distlab.results import schema
from distlab.train import train

SMALL = {"strategy": "ddp", "eval_file": None, "save_model": False, "logging_steps": 1, "seq_len": 128,
         "grad_accum": 1, "lora_dropout": 0.0, "eval_at_start": False, "eval_at_end": False}


def calibrate(placement: host_runs.Placement, limits, overrides: dict[str, Any], rows: int, global_rows: int,
              echo=False) -> dict:
    out = BUILD_DIR / "lan" / "calibration.json"
    out.unlink(missing_ok=True)
    sets = [a for k, v in overrides.items() if k in ("seq_len", "model") for a in ("--set", f"{k}={v}")]
    job = host_runs.run_module(placement, "calibrate", "distlab.lan.calibrate",
                          ["--out", str(out), "--rows", str(rows), "--iters", "3", "--global-rows", str(global_rows),
                           *sets], limits=limits, echo=echo, timeout_s=240)
    if not job.ok:
        raise RuntimeError(f"calibration failed:\n{job.failure()}")
    return json.loads(out.read_text())


def compare(placement: host_runs.Placement, quotas: list[float], *, micro: int = 4, steps: int = 8, rounds: int = 2,
            name: str = "balance", echo=False, timeout_s: int = 600, cpu_mode: str = "quota",
            rows_per_s: list[float] | None = None, overrides: dict[str, Any] | None = None) -> dict:
    """Calibrate (unless `rows_per_s` gives the hosts' measured speeds already), then naive vs balanced in one
    launch. Returns the numbers the chapter prints. `overrides`: TrainConfig fields on top of SMALL."""
    world = len(quotas)
    limits = [HostLimits(cpu=q, cpu_mode=cpu_mode) for q in quotas]
    global_rows = micro * world
    small = {**SMALL, **(overrides or {})}
    if rows_per_s is None:
        rows_per_s = calibrate(placement, limits, small, rows=micro, global_rows=global_rows, echo=echo)["rows_per_s"]
    rows_per_s = list(rows_per_s[:world])
    shares = shares_from_throughput(rows_per_s)
    runs_dir = RUNS_DIR / "lan"
    variants, kinds = {}, {}
    for r in range(rounds):
        for kind, extra in (("naive", {"rank_shares": None}), ("balanced", {"rank_shares": shares})):
            variants[f"{name}_{kind}{r}"] = {**extra, "seed": 42}
            kinds[f"{name}_{kind}{r}"] = kind
    job = host_runs.run_training(placement, name, {**small, "micro_batch_size": micro, "max_steps": steps},
                            limits=limits, variants=variants, echo=echo, timeout_s=timeout_s, runs_dir=runs_dir)
    if not job.ok:
        raise RuntimeError(f"{name} failed:\n{job.failure()}")
    times: dict[str, list[float]] = {"naive": [], "balanced": []}
    tps: dict[str, list[float]] = {"naive": [], "balanced": []}
    taken: dict[str, list[int]] = {}  # the rows each rank's loop says it took per step, from its own log
    curves: dict[str, dict[str, list[float]]] = {}  # the first round's loss and gradient norm per step
    for run_name, kind in kinds.items():
        row = schema.summarise_logs(runs_dir / run_name / "train_log.jsonl")
        times[kind].append(row["step_time_s"])
        tps[kind].append(row["tokens_per_s"])
        taken[kind] = [schema.read_log(p, event="start")[0]["rows_per_step"]
                       for p in schema.rank_log_paths(runs_dir / run_name)]
        if kind not in curves:
            records = schema.read_log(runs_dir / run_name / "train_log.jsonl")
            curves[kind] = {"loss": [r["loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records]}
    naive, balanced = statistics.median(times["naive"]), statistics.median(times["balanced"])
    split = rows_per_rank(global_rows, shares, world, minimum=1)
    with_fixed, fixed_s = step_ratio_with_fixed(rows_per_s, split, [micro] * world, naive)
    return {"placement": placement.kind, "quotas": quotas, "cgroups": cgroups_supported()[0], "cpu_mode": cpu_mode,
            "rows_per_s": rows_per_s, "shares": shares, "global_rows": global_rows,
            "naive_split": [micro] * world, "balanced_split": split,
            "naive_rows_taken": taken["naive"], "balanced_rows_taken": taken["balanced"],
            "predicted_ratio": predicted_step_ratio(rows_per_s, split, [micro] * world),
            "predicted_ratio_with_fixed": with_fixed, "fixed_s": fixed_s,
            "theory_ratio": ideal_step_ratio(quotas), "ideal_speedups": ideal_speedups(quotas),
            "naive_curves": curves["naive"], "balanced_curves": curves["balanced"],
            "naive_step_s": naive, "balanced_step_s": balanced, "ratio": balanced / naive,
            "naive_tokens_per_s": statistics.median(tps["naive"]),
            "balanced_tokens_per_s": statistics.median(tps["balanced"]),
            "naive_step_s_rounds": times["naive"], "balanced_step_s_rounds": times["balanced"]}


def one_host(rows: int, *, steps: int = 4, name: str = "balance_one", overrides: dict[str, Any] | None = None) -> dict:
    """The same training loop on one process with one thread, as host 0 has (full speed, no all-reduce), `rows`
    per step: the speedups' baseline. It runs in this process: no launch to pay for."""
    out = RUNS_DIR / "lan" / name
    shutil.rmtree(out, ignore_errors=True)  # a fresh run, never a resumed one
    cfg = load_config(TINY_CONFIG, {**SMALL, **(overrides or {}), "strategy": "single", "num_threads": 1,
                                    "progress": False, "micro_batch_size": rows, "max_steps": steps,
                                    "output_dir": str(out)})
    previous_threads = torch.get_num_threads()
    try:
        train(cfg)
    finally:
        torch.set_num_threads(previous_threads)
    row = schema.summarise_logs(out / "train_log.jsonl")
    return {"rows": rows, "step_time_s": row["step_time_s"], "tokens_per_s": row["tokens_per_s"]}


def speedups(r: dict, alone: dict) -> dict[str, float]:
    """Measured throughput of the cluster (naive and balanced) over the first host's alone."""
    return {"even": r["naive_tokens_per_s"] / alone["tokens_per_s"],
            "balanced": r["balanced_tokens_per_s"] / alone["tokens_per_s"]}


def against_theory(r: dict) -> str:
    return (f"balanced/naive step time {r['ratio']:.3f} against theory {r['theory_ratio']:.3f} "
            f"(world x slowest speed / sum of speeds, quotas {r['quotas']}); "
            f"measured/theory {r['ratio'] / r['theory_ratio']:.2f}")


def report(r: dict) -> str:
    return (f"{r['placement']} cluster, CPU quotas {r['quotas']} ({r['cpu_mode']}; cgroups: {r['cgroups']}): rows/s "
            f"{[round(x, 2) for x in r['rows_per_s']]} -> shares {r['shares']}; global batch {r['global_rows']} "
            f"rows split naive {r['naive_split']} vs balanced {r['balanced_split']}\n"
            f"  step time naive {r['naive_step_s']:.3f} s, balanced {r['balanced_step_s']:.3f} s: ratio "
            f"{r['ratio']:.3f} (compute-only prediction {r['predicted_ratio']:.3f}; with the naive step's "
            f"{r['fixed_s']:.3f} s of fixed costs {r['predicted_ratio_with_fixed']:.3f}); tokens/s naive "
            f"{r['naive_tokens_per_s']:.0f}, balanced {r['balanced_tokens_per_s']:.0f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m distlab.bench.lan_balance", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quotas", default="1,0.5", help="CPU cores per host, e.g. 1,0.5")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--micro", type=int, default=6, help="naive rows per rank per step")
    ap.add_argument("--three-node", action="store_true",
                    help="also the LAN cluster guide's three hosts, 100/50/50%% (and the fast host alone)")
    ap.add_argument("--cpu-mode", choices=["quota", "duty", "sleep"], default="quota",
                    help="quota: cgroup cfs quota; duty: SIGSTOP/SIGCONT duty cycle; "
                         "sleep: (1/quota - 1) x compute after each step (relative: robust on a loaded machine)")
    ap.add_argument("--out", type=Path, default=BUILD_DIR / "lan" / "lan_balance.json")
    args = ap.parse_args(argv)
    try:
        quotas = [finite_float(q) for q in args.quotas.split(",")]
    except ValueError:
        print(f"python -m distlab.bench.lan_balance: error: --quotas {args.quotas!r}: comma-separated numbers",
              file=sys.stderr)
        return 2
    if args.steps <= schema.WARMUP_STEPS:
        print(f"python -m distlab.bench.lan_balance: error: --steps must exceed {schema.WARMUP_STEPS}", file=sys.stderr)
        return 2
    results = {}
    setups = [("two", quotas)] + ([("three", [1.0, 0.5, 0.5])] if args.three_node else [])
    for label, q in setups:
        placement = host_runs.place(len(q))
        with placement.running():
            print(placement.describe(), flush=True)
            results[label] = compare(placement, q, micro=args.micro, steps=args.steps, rounds=args.rounds,
                                     name=f"balance_{label}", cpu_mode=args.cpu_mode)
            if label == "three":
                alone = one_host(args.micro * len(q), steps=args.steps, name="balance_one")
                results[label]["one_host"] = alone
                results[label]["speedups"] = speedups(results[label], alone)
        print(report(results[label]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(strict_json(results, indent=1))
    for label, r in results.items():
        print(f"{label} hosts: {against_theory(r)}")
        if "speedups" in r:
            print(f"{label} hosts: speedup over the fast host alone, even {r['speedups']['even']:.2f} (theory "
                  f"{r['ideal_speedups']['even']:.2f}), balanced {r['speedups']['balanced']:.2f} (ideal, the sum of "
                  f"the speeds: {r['ideal_speedups']['balanced']:.2f})")
    return 0


if __name__ == "__main__":
    run_main(main, sigterm_exits=True)  # a SIGTERM kills the launched process groups too
