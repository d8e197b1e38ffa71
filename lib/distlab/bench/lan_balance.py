"""Uneven devices balanced: DDP with per-rank batch shares from a calibration against the naive equal split.

    python -m distlab.bench.lan_balance [--quotas 1,0.5] [--steps 8] [--rounds 2] [--three-node]

Each emulated host (network namespace, 1 Gbit link) gets a CPU quota; one with 0.5 of a core is about 2x
slower. A short calibration (distlab.lan.calibrate) measures each rank's rows/s; the shares go to
TrainConfig.rank_shares. Then ONE torchrun launch runs naive, balanced, naive, balanced... (`--variant`
runs in the same ranks), so machine noise hits both alike; the median steady-state step time of each is
compared (the slowest rank's, as schema.summarise takes it). Theory for quotas 1 / 0.5: balanced / naive =
0.667 of the compute (goal <= 0.72 measured). `--three-node`: seed 001's 100/50/50% cluster as well.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from distlab.batching import predicted_step_ratio, rows_per_rank
from distlab.cli import finite_float, run_main
from distlab.lan import host_runs
from distlab.lan.cgroups import HostLimits
from distlab.lan.cgroups import supported as cgroups_supported
from distlab.paths import BUILD_DIR, RUNS_DIR
from distlab.results import schema

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
            name: str = "balance", echo=False, timeout_s: int = 600, cpu_mode: str = "quota") -> dict:
    """Calibrate, then naive vs balanced in one launch. Returns the numbers the chapter prints."""
    world = len(quotas)
    limits = [HostLimits(cpu=q, cpu_mode=cpu_mode) for q in quotas]
    global_rows = micro * world
    calib = calibrate(placement, limits, SMALL, rows=micro, global_rows=global_rows, echo=echo)
    shares = calib["shares"]
    runs_dir = RUNS_DIR / "lan"
    variants, kinds = {}, {}
    for r in range(rounds):
        for kind, extra in (("naive", {"rank_shares": None}), ("balanced", {"rank_shares": shares})):
            variants[f"{name}_{kind}{r}"] = {**extra, "seed": 42}
            kinds[f"{name}_{kind}{r}"] = kind
    job = host_runs.run_training(placement, name, {**SMALL, "micro_batch_size": micro, "max_steps": steps},
                            limits=limits, variants=variants, echo=echo, timeout_s=timeout_s, runs_dir=runs_dir)
    if not job.ok:
        raise RuntimeError(f"{name} failed:\n{job.failure()}")
    times: dict[str, list[float]] = {"naive": [], "balanced": []}
    tps: dict[str, list[float]] = {"naive": [], "balanced": []}
    taken: dict[str, list[int]] = {}  # the rows each rank's loop says it took per step, from its own log
    for run_name, kind in kinds.items():
        row = schema.summarise_logs(runs_dir / run_name / "train_log.jsonl")
        times[kind].append(row["step_time_s"])
        tps[kind].append(row["tokens_per_s"])
        taken[kind] = [schema.read_log(p, event="start")[0]["rows_per_step"]
                       for p in schema.rank_log_paths(runs_dir / run_name)]
    naive, balanced = statistics.median(times["naive"]), statistics.median(times["balanced"])
    split = rows_per_rank(global_rows, shares, world, minimum=1)
    return {"placement": placement.kind, "quotas": quotas, "cgroups": cgroups_supported()[0], "cpu_mode": cpu_mode,
            "rows_per_s": calib["rows_per_s"], "shares": shares, "global_rows": global_rows,
            "naive_split": [micro] * world, "balanced_split": split,
            "naive_rows_taken": taken["naive"], "balanced_rows_taken": taken["balanced"],
            "predicted_ratio": predicted_step_ratio(calib["rows_per_s"], split, [micro] * world),
            "naive_step_s": naive, "balanced_step_s": balanced, "ratio": balanced / naive,
            "naive_tokens_per_s": statistics.median(tps["naive"]),
            "balanced_tokens_per_s": statistics.median(tps["balanced"]),
            "naive_step_s_rounds": times["naive"], "balanced_step_s_rounds": times["balanced"]}


def report(r: dict) -> str:
    return (f"{r['placement']} cluster, CPU quotas {r['quotas']} ({r['cpu_mode']}; cgroups: {r['cgroups']}): rows/s "
            f"{[round(x, 2) for x in r['rows_per_s']]} -> shares {r['shares']}; global batch {r['global_rows']} "
            f"rows split naive {r['naive_split']} vs balanced {r['balanced_split']}\n"
            f"  step time naive {r['naive_step_s']:.3f} s, balanced {r['balanced_step_s']:.3f} s: ratio "
            f"{r['ratio']:.3f} (compute-only prediction {r['predicted_ratio']:.3f}); tokens/s naive "
            f"{r['naive_tokens_per_s']:.0f}, balanced {r['balanced_tokens_per_s']:.0f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m distlab.bench.lan_balance", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quotas", default="1,0.5", help="CPU cores per host, e.g. 1,0.5")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--micro", type=int, default=6, help="naive rows per rank per step")
    ap.add_argument("--three-node", action="store_true", help="also seed 001's 100/50/50%% cluster")
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
        print(report(results[label]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    two = results["two"]
    verdict = "meets" if two["ratio"] <= 0.72 else "MISSES"
    print(f"balanced/naive step time {two['ratio']:.3f} {verdict} the goal <= 0.72 (theory 0.667)")
    return 0


if __name__ == "__main__":
    run_main(main, sigterm_exits=True)  # a SIGTERM kills the launched process groups too
