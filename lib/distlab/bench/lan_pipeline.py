"""Pipeline stages sized to uneven hosts: layers per stage from measured per-layer times, against the equal split.

    python -m distlab.bench.lan_pipeline [--slow 0.5] [--steps 6] [--rounds 1] [--budget-mib N]

Two emulated hosts run the two stages of the `pipeline` strategy; host 1 (the last stage: norm, LM head
and loss too) is slowed to `--slow` of host 0's speed. First each host times forward+backward of every
part of the model on its own CPU share (the embedding, each decoder layer, the head with the loss; the
distlab.workers.layer_times), and the planner (distlab.planning, `plan_pipeline`) gives each candidate
stage's bytes. The split chosen minimises the slower stage's time, among those whose stage fits its host's
budget (`--budget-mib`, planned bytes): `plan_split`. Then ONE launch (`race`) runs equal, measured... so
machine noise hits both alike; each one's median steady-state step time is reported with their ratio
and the ratio the measured layer times predict (a pipeline step takes about (m + p - 1) x the slowest
stage's time per micro-batch, so the prediction is the ratio of the slowest stages).

The slowdown: "sleep" (DISTLAB_SLOWDOWN, relative to the rank's own compute; distlab.faults.install_slowdown hooks
the stage module on a pipeline rank) by default, robust on a loaded machine; "quota" is the cgroup CPU
quota, exact on an idle one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from distlab.cli import finite_float, run_main
from distlab.jsonio import strict_json
from distlab.lan import host_runs
from distlab.lan.cgroups import HostLimits
from distlab.paths import BUILD_DIR, RUNS_DIR
from distlab.results import schema
from distlab.results.schema import WARMUP_STEPS

LAYERS = 8
MODEL_SHAPE = dict(intermediate_size=688, layers=LAYERS)  # the tiny Qwen2, 8 layers deep (random init)
SMALL = {"strategy": "pipeline", "eval_file": None, "save_model": False, "logging_steps": 1, "seq_len": 128,
         "micro_batch_size": 2, "grad_accum": 4, "lora_dropout": 0.0, "eval_at_start": False, "eval_at_end": False,
         "pipeline_schedule": "1f1b"}


def bench_model() -> str:
    from distlab.models import balanced_bench_model  # deferred: distlab.models pulls in torch

    return balanced_bench_model(**MODEL_SHAPE)


# ---------------------------------------------------------------------- the split

def stage_seconds(times: list[dict], counts: list[int]) -> list[float]:
    """Each stage's forward+backward time per micro-batch on its own host, for layers `counts` per stage."""
    out, start = [], 0
    for s, c in enumerate(counts):
        t = times[s]
        total = sum(t[f"layer{i}"] for i in range(start, start + c))
        total += t["embed"] if s == 0 else 0.0
        total += t["head"] if s == len(counts) - 1 else 0.0
        out.append(total)
        start += c
    return out


def candidate_splits(layers: int) -> list[list[int]]:
    return [[k, layers - k] for k in range(1, layers)]


def planned_stage_bytes(model_dir: str, counts: list[int], overrides: dict[str, Any]) -> list[int]:
    from transformers import AutoConfig  # deferred: transformers is slow to import

    from distlab.planning.plan import plan_memory  # deferred: the planner pulls in pandas

    config = AutoConfig.from_pretrained(model_dir)
    return [int(plan_memory(config, strategy="pipeline", world_size=len(counts), dtype="fp32", lora_r=16,
                            micro_batch=overrides["micro_batch_size"], seq_len=overrides["seq_len"],
                            grad_accum=overrides["grad_accum"], stage_layers=counts, rank=s).total)
            for s in range(len(counts))]


def choose_split(times: list[dict], layers: int, fits=lambda counts: True) -> tuple[list[int], list[dict]]:
    """The split whose slower stage is fastest, among those that fit; every candidate as rows."""
    rows = []
    for counts in candidate_splits(layers):
        secs = stage_seconds(times, counts)
        rows.append({"stage_layers": counts, "stage_s": secs, "bottleneck_s": max(secs), "fits": fits(counts)})
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        raise ValueError("no split of the layers fits every host's memory budget")
    return min(fitting, key=lambda r: r["bottleneck_s"])["stage_layers"], rows


def equal_split(layers: int, stages: int = 2) -> list[int]:
    from distlab.layer_split import split_layers  # deferred: pulls in torch

    return [len(r) for r in split_layers(layers, stages)]


# ---------------------------------------------------------------------- the comparison

def measure_layer_times(placement, limits, model_dir: str, overrides: dict[str, Any], echo=False) -> dict:
    out = BUILD_DIR / "lan" / "pipeline_layer_times.json"
    out.unlink(missing_ok=True)
    sets = ["--set", f"seq_len={overrides['seq_len']}", "--set", "eval_file=null"]
    job = host_runs.run_module(placement, "layer_times", "distlab.workers.layer_times",
                          ["--out", str(out), "--rows", str(overrides["micro_batch_size"]),
                           "--set", f"model={model_dir}", *sets], limits=limits, echo=echo, timeout_s=240)
    if not job.ok:
        raise RuntimeError(f"per-layer timing failed:\n{job.failure()}")
    return {**json.loads(out.read_text()), "launch_s": job.elapsed_s}


def plan_split(placement, slow: float = 0.5, *, budget_mib: float | None = None, cpu_mode: str = "sleep",
               micro: int = 2, echo=False) -> dict:
    """Per-layer times on each host and the planner's bytes per stage: the measured split against the equal one."""
    limits = [HostLimits(), HostLimits(cpu=slow, cpu_mode=cpu_mode)]
    model_dir = bench_model()
    overrides = {**SMALL, "model": model_dir, "micro_batch_size": micro}
    timed = measure_layer_times(placement, limits, model_dir, overrides, echo=echo)
    planned = {tuple(c): planned_stage_bytes(model_dir, c, overrides) for c in candidate_splits(timed["layers"])}

    def fits(counts: list[int]) -> bool:
        return budget_mib is None or planned[tuple(counts)][1] <= budget_mib * 2**20

    measured, rows = choose_split(timed["hosts"], timed["layers"], fits)
    equal = equal_split(timed["layers"])
    for r in rows:
        r["planned_bytes"] = planned[tuple(r["stage_layers"])]
    predicted = max(stage_seconds(timed["hosts"], measured)) / max(stage_seconds(timed["hosts"], equal))
    return {"placement": placement.kind, "slow": slow, "cpu_mode": cpu_mode, "model": model_dir, "limits": limits,
            "overrides": overrides, "layers": timed["layers"], "layer_times": timed["hosts"], "candidates": rows,
            "budget_mib": budget_mib, "equal_split": equal, "measured_split": measured, "predicted_ratio": predicted,
            "timing_launch_s": timed["launch_s"]}


def race(placement, plan: dict, *, steps: int = 6, rounds: int = 1, name: str = "pipe_split", echo=False,
         timeout_s: int = 400) -> dict:
    """Equal vs measured split in one launch (alternating, `rounds` of each); the plan with the step times."""
    variants, kinds = {}, {}
    for i in range(rounds):
        for kind in ("equal", "measured"):
            variants[f"{name}_{kind}{i}"] = {"stage_layers": plan[f"{kind}_split"], "seed": 42}
            kinds[f"{name}_{kind}{i}"] = kind
    job = host_runs.run_training(placement, name, {**plan["overrides"], "max_steps": steps}, limits=plan["limits"],
                            variants=variants, echo=echo, timeout_s=timeout_s)
    if not job.ok:
        raise RuntimeError(f"{name} failed:\n{job.failure()}")
    times: dict[str, list[float]] = {"equal": [], "measured": []}
    for run_name, kind in kinds.items():
        times[kind].append(schema.summarise_logs(RUNS_DIR / "lan" / run_name / "train_log.jsonl")["step_time_s"])
    eq, me = statistics.median(times["equal"]), statistics.median(times["measured"])
    return {**plan, "equal_step_s": eq, "measured_step_s": me, "ratio": me / eq, "equal_step_s_rounds": times["equal"],
            "measured_step_s_rounds": times["measured"], "training_launch_s": job.elapsed_s}


def compare(placement, slow: float = 0.5, *, steps: int = 6, rounds: int = 1, budget_mib: float | None = None,
            cpu_mode: str = "sleep", micro: int = 2, name: str = "pipe_split", echo=False,
            timeout_s: int = 400) -> dict:
    """Per-layer times on each host, the split they give, then equal vs measured in one launch."""
    plan = plan_split(placement, slow, budget_mib=budget_mib, cpu_mode=cpu_mode, micro=micro, echo=echo)
    return race(placement, plan, steps=steps, rounds=rounds, name=name, echo=echo, timeout_s=timeout_s)


def report_plan(r: dict) -> str:
    """The measured layer times and the split they give (before any training)."""
    per_layer = [statistics.fmean(h[f"layer{i}"] for i in range(r["layers"])) * 1e3 for h in r["layer_times"]]
    heads = [h["head"] * 1e3 for h in r["layer_times"]]
    slowest = {k: max(stage_seconds(r["layer_times"], r[f"{k}_split"])) * 1e3 for k in ("equal", "measured")}
    return (f"{r['placement']} cluster, host 1 at {r['slow']:g} of a core ({r['cpu_mode']}): forward+backward per "
            f"layer {per_layer[0]:.1f} ms on host 0, {per_layer[1]:.1f} ms on host 1 (head + loss {heads[0]:.1f} / "
            f"{heads[1]:.1f} ms)\n"
            f"  {r['layers']} layers: equal split {r['equal_split']}, slower stage {slowest['equal']:.1f} ms per "
            f"micro-batch; measured split {r['measured_split']}, {slowest['measured']:.1f} ms: predicted step time "
            f"ratio {r['predicted_ratio']:.3f}")


def report(r: dict) -> str:
    return (f"{report_plan(r)}\n  step time equal {r['equal_step_s']:.3f} s vs measured {r['measured_step_s']:.3f} s: "
            f"ratio {r['ratio']:.3f} (predicted {r['predicted_ratio']:.3f})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m distlab.bench.lan_pipeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--slow", type=finite_float, default=0.5,
                    help="host 1's speed as a fraction of a core (0 < s <= 1)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=1, help="equal/measured pairs in the one launch")
    ap.add_argument("--budget-mib", type=finite_float, default=None, help="host 1's stage budget in planned MiB")
    ap.add_argument("--cpu-mode", choices=["sleep", "quota", "duty"], default="sleep")
    ap.add_argument("--out", type=Path, default=BUILD_DIR / "lan" / "lan_pipeline.json")
    args = ap.parse_args(argv)
    if not 0 < args.slow <= 1:
        print(f"python -m distlab.bench.lan_pipeline: error: --slow {args.slow}: a fraction in (0, 1]", file=sys.stderr)
        return 2
    if args.steps <= WARMUP_STEPS:
        print(f"python -m distlab.bench.lan_pipeline: error: --steps must exceed {WARMUP_STEPS} (warm-up steps are "
              "left out of the step time)", file=sys.stderr)
        return 2
    placement = host_runs.place(2)
    with placement.running():
        print(placement.describe(), flush=True)
        r = compare(placement, args.slow, steps=args.steps, rounds=args.rounds, budget_mib=args.budget_mib,
                    cpu_mode=args.cpu_mode)
    print(report(r), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(strict_json({k: v for k, v in r.items() if k != "limits"}, indent=1))
    return 0


if __name__ == "__main__":
    run_main(main, sigterm_exits=True)  # a SIGTERM kills the launched process groups too
