"""DDP on the emulated LAN: step time against the link rate for LoRA and full fine-tuning, and gradient
compression (DDP communication hooks) on a slow link.

    python -m distlab.bench.lan_ddp [--rates 100mbit,1gbit,10gbit] [--steps 5] [--compression-rate 100mbit]

Two hosts (network namespaces), one gloo rank each, the tiny model, measure_comm on: every bucket's
all-reduce is waited for (chapter 02's CommTimer), so a step splits exactly into compute and exposed
communication. `link_sweep`: LoRA and full fine-tuning at each tbf rate; the gradient bytes per step are
measured (what the buckets carried) and predicted by the planner (trained parameters x 4 bytes of an fp32
gradient). `compression`: full fine-tuning (where the bytes matter) with each comm hook (none, fp16, bf16,
powersgd), same seed, so the loss curves differ by the compression alone. Each is ONE torchrun launch
whose runs (`--variant`s in the same ranks) get their link rate as they start (`run_on_links`);
`sweep_and_compression`, what the command and chapter 05 run, is both in one launch. Without namespaces
(localhost fallback) nothing is shaped: each sweep runs at the one unshaped "rate", loopback (hosts.LOOPBACK),
so no row carries a link rate it never had.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from distlab.cli import run_main
from distlab.jsonio import strict_json
from distlab.lan import host_runs
from distlab.lan.hosts import link_bits, link_bytes_per_s, rate_bits
from distlab.metrics import read_log
from distlab.paths import BUILD_DIR, MODEL_CACHE, RUNS_DIR
from distlab.planning.shapes import parameter_layout
from distlab.planning.wire_bytes import communication_bytes
from distlab.results import schema

SMALL = {"strategy": "ddp", "eval_file": None, "save_model": False, "logging_steps": 1, "seq_len": 128,
         "micro_batch_size": 4, "grad_accum": 1, "lora_dropout": 0.0, "eval_at_start": False,
         "eval_at_end": False, "measure_comm": True, "warmup_steps": 1, "seed": 42}
# The tiny base takes a far larger LoRA step than a whole-model one (AdamW on every weight at 1e-2 diverges).
MODES = {"lora": {"lora": True, "lr": 1e-2}, "full": {"lora": False, "lr": 1e-3}}
HOOKS = ("none", "fp16", "bf16", "powersgd")
GRAD_BYTES = 4  # DDP's buckets hold fp32 gradients on CPU (they follow the trained weights' dtype)
RUNS = RUNS_DIR / "lan"
BASE_CONFIG = MODEL_CACHE / "distlab-tiny-base" / "config.json"  # distlab.tiny_base.build_default_model's folder


def predicted_grad_bytes(mode: str, world_size: int = 2, lora_r: int = 16) -> dict[str, float]:
    """The planner's gradient volume per step for the tiny model: the bytes of the trained weights'
    gradients (what DDP's buckets hold) and what each rank sends of them in a ring all-reduce."""
    # The base's saved config as a dict (the planner reads either): called after the runs, which built or
    # checked the base, so no transformers import and no recipe hashing here (2 s of a 20 s cell).
    config = json.loads(BASE_CONFIG.read_text())
    r = lora_r if MODES[mode]["lora"] else None
    trained = sum(p.numel for p in parameter_layout(config, r) if p.trainable)
    return {"trained_parameters": trained, "predicted_grad_bytes": trained * GRAD_BYTES,
            "predicted_wire_bytes": communication_bytes(config, "ddp", world_size, lora_r=r, grad_bytes=GRAD_BYTES)}


@dataclass
class LinkRun:
    """One run of a launch, on its own link rate."""

    name: str
    rate: str
    overrides: dict[str, Any]


def run_on_links(placement: host_runs.Placement, name: str, runs: Sequence[LinkRun], steps: int, echo=False,
                 timeout_s: int = 600) -> dict[str, dict[str, Any]]:
    """ONE launch of `runs` back to back in the same ranks ({run name: measurements}), each on its own rate:
    a watcher reshapes the links when a run's log says it started and back to the fastest rate when it
    ended, so DDP's initial weight broadcast of the next run never crawls over a slow link. A launch costs
    seconds of start-up (interpreters, imports, rendezvous); a reshape costs milliseconds."""
    fastest = max((r.rate for r in runs), key=link_bits)
    shaped_at: dict[str, float] = {}
    done = threading.Event()
    before = [h.rate for h in placement.cluster.hosts] if placement.cluster else []

    def follow() -> None:
        for run in runs:
            log = RUNS / run.name / "train_log.jsonl"
            if not _wait_for_event(log, "start", done):
                return
            _shape(placement, run.rate)
            shaped_at[run.name] = time.time()
            if not _wait_for_event(log, "end", done):
                return
            _shape(placement, fastest)

    _shape(placement, fastest)
    watcher = threading.Thread(target=follow, daemon=True)
    try:
        job = host_runs.run_training(placement, name, {**SMALL, "max_steps": steps},
                                variants={r.name: r.overrides for r in runs}, echo=echo, timeout_s=timeout_s,
                                runs_dir=RUNS, on_start=watcher.start)
    finally:
        done.set()
        if watcher.ident is not None:
            watcher.join(timeout=10)
        for i, rate in enumerate(before):  # later cells expect their LAN as it was
            placement.cluster.shape(i, rate)
    if not job.ok:
        raise RuntimeError(f"{name} failed:\n{job.failure()}")
    unshaped = [r.name for r in runs if r.name not in shaped_at]
    if placement.cluster and unshaped:
        raise RuntimeError(f"{name}: the links were never shaped for {', '.join(unshaped)} (the watcher's error "
                           "is above): their timings are not at their rates")
    return {r.name: measured(RUNS / r.name / "train_log.jsonl", shaped_at.get(r.name)) for r in runs}


def _shape(placement: host_runs.Placement, rate: str) -> None:
    if placement.cluster:  # the localhost fallback has no links to shape
        placement.cluster.shape_all(rate)


def _wait_for_event(log: Path, event: str, done: threading.Event) -> bool:
    """Until rank 0's log holds a record of `event`; False when the launch ended first."""
    marker = f'"event": "{event}"'
    while not done.is_set():
        with contextlib.suppress(OSError):
            if marker in log.read_text():
                return True
        done.wait(0.02)
    return False


def measured(log: Path, shaped_at: float | None = None) -> dict[str, Any]:
    """The schema's steady-state summary of one run, its trained parameter count and per-step losses.
    `shaped_at`: when its link got its rate; a steady step that began earlier would mix two rates."""
    row = schema.summarise_logs(log)
    start = read_log(log, event="start")
    steps = read_log(log)
    first = min((s for s in steps if s["step"] > schema.WARMUP_STEPS), key=lambda s: s["step"])
    if shaped_at is not None and first["time"] - first["step_time_s"] < shaped_at:
        raise RuntimeError(f"{log}: the link was reshaped after step {first['step']} began: its timing mixes two "
                           f"link rates (the machine is too slow for the watcher; run fewer variants per launch)")
    return {"step_time_s": row["step_time_s"], "comm_time_s": row["comm_time_s"],
            "compute_time_s": row["compute_time_s"], "comm_share": row["comm_share"], "comm_bytes": row["comm_bytes"],
            "trainable_parameters_run": start[0]["trainable_parameters"] if start else None,
            "final_loss": row["final_loss"], "steps": [s["step"] for s in steps], "losses": [s["loss"] for s in steps]}


def _sweep_runs(name: str, rates: Sequence[str]) -> list[LinkRun]:
    """Fastest link first: the slow runs then come last, next to the comm-hook runs on the slow link."""
    ordered = sorted(rates, key=link_bits, reverse=True)
    return [LinkRun(f"{name}_{rate}_{mode}", rate, dict(extra)) for rate in ordered for mode, extra in MODES.items()]


def _hook_runs(name: str, rate: str, hooks: Sequence[str]) -> list[LinkRun]:
    return [LinkRun(f"{name}_{hook}", rate, {**MODES["full"], "ddp_comm_hook": None if hook == "none" else hook})
            for hook in hooks]


def _sweep_rows(placement, runs: Sequence[LinkRun], results: dict[str, dict]) -> list[dict[str, Any]]:
    plan = {mode: predicted_grad_bytes(mode, placement.nodes) for mode in MODES}
    rows = []
    for run in runs:
        mode = "lora" if run.overrides["lora"] else "full"
        m = results[run.name]
        rows.append({"rate": run.rate, "rate_bytes_per_s": link_bytes_per_s(run.rate), "mode": mode, **m, **plan[mode],
                     "bytes_vs_planner": m["comm_bytes"] / plan[mode]["predicted_grad_bytes"],
                     # what a link that never bursts needs for the planner's bytes (tbf lets one bucket through at once)
                     "predicted_comm_s": plan[mode]["predicted_wire_bytes"] / link_bytes_per_s(run.rate),
                     "placement": placement.kind, "run": run.name})
    return sorted(rows, key=lambda r: (link_bits(r["rate"]), r["mode"] != "lora"))


def _hook_rows(placement, rate: str, hooks: Sequence[str], results: dict[str, dict]) -> list[dict[str, Any]]:
    base = results.get("none")
    rows = []
    for hook in hooks:
        m = results[hook]
        rows.append({"hook": hook, "rate": rate, "mode": "full", **m,
                     "bytes_vs_none": m["comm_bytes"] / base["comm_bytes"] if base else float("nan"),
                     "step_time_vs_none": m["step_time_s"] / base["step_time_s"] if base else float("nan"),
                     "placement": placement.kind})
    return rows


def link_sweep(placement: host_runs.Placement, rates: Sequence[str], steps: int = 4, *, name: str = "ddp_link",
               echo=False, timeout_s: int = 600) -> list[dict[str, Any]]:
    """LoRA and full fine-tuning at every link rate, one launch: one row per (rate, mode)."""
    runs = _sweep_runs(name, placement.link_rates(rates))
    return _sweep_rows(placement, runs, run_on_links(placement, name, runs, steps, echo, timeout_s))


def compression(placement: host_runs.Placement, rate: str = "100mbit", steps: int = 5, *, hooks: Sequence[str] = HOOKS,
                name: str = "ddp_hooks", echo=False, timeout_s: int = 600) -> list[dict[str, Any]]:
    """Full fine-tuning with each comm hook at `rate`, one launch: one row per hook (losses per step)."""
    rate = placement.link_rates([rate])[0]
    runs = _hook_runs(name, rate, hooks)
    results = run_on_links(placement, name, runs, steps, echo, timeout_s)
    return _hook_rows(placement, rate, hooks, {h: results[r.name] for h, r in zip(hooks, runs)})


def sweep_and_compression(placement: host_runs.Placement, rates: Sequence[str], steps: int = 4, *,
                          rate: str = "100mbit", hooks: Sequence[str] = HOOKS, name: str = "ddp_lan", echo=False,
                          timeout_s: int = 600) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """link_sweep and compression in ONE launch (one start-up instead of two); the sweep's full
    fine-tuning run at `rate` is the comm-hook comparison's "none" (the same config). On localhost both run
    on loopback, once: the rates would never be applied."""
    rates, rate = placement.link_rates(rates), placement.link_rates([rate])[0]
    sweep = _sweep_runs(f"{name}_link", rates)
    same = {r.rate: r for r in sweep if not r.overrides["lora"]}
    hook_runs = {h: r for h, r in zip(hooks, _hook_runs(f"{name}_hooks", rate, hooks))}
    if "none" in hook_runs and rate in same:
        hook_runs["none"] = same[rate]
    runs = sweep + [r for h, r in hook_runs.items() if r not in sweep]
    results = run_on_links(placement, name, runs, steps, echo, timeout_s)
    return (_sweep_rows(placement, sweep, results),
            _hook_rows(placement, rate, hooks, {h: results[r.name] for h, r in hook_runs.items()}))


def report(sweep: list[dict], hooks: list[dict]) -> str:
    lines = [f"{'rate':>8} {'mode':>5} {'step(s)':>8} {'comm(s)':>8} {'share':>6} {'bytes/step':>11} "
             f"{'planner':>11}"]
    lines += [f"{r['rate']:>8} {r['mode']:>5} {r['step_time_s']:>8.3f} {r['comm_time_s']:>8.3f} "
              f"{r['comm_share']:>6.2f} {r['comm_bytes']:>11.0f} {r['predicted_grad_bytes']:>11.0f}" for r in sweep]
    if hooks:
        lines.append(f"{'hook':>8} {'step(s)':>8} {'comm(s)':>8} {'bytes/step':>11} {'x none':>7} {'final loss':>10}")
        lines += [f"{r['hook']:>8} {r['step_time_s']:>8.3f} {r['comm_time_s']:>8.3f} {r['comm_bytes']:>11.0f} "
                  f"{r['bytes_vs_none']:>7.3f} {r['final_loss']:>10.4f}" for r in hooks]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m distlab.bench.lan_ddp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="100mbit,1gbit,10gbit", help="tbf link rates of the LoRA/full sweep")
    ap.add_argument("--steps", type=int, default=5, help=f"optimizer steps per run (> {schema.WARMUP_STEPS})")
    ap.add_argument("--compression-rate", default="100mbit", help="link rate of the comm-hook comparison")
    ap.add_argument("--hooks", default=",".join(HOOKS), help="comm hooks to compare (none: fp32 all-reduce)")
    ap.add_argument("--out", type=Path, default=BUILD_DIR / "lan" / "lan_ddp.json")
    args = ap.parse_args(argv)
    prog = "python -m distlab.bench.lan_ddp: error:"
    rates = [r for r in args.rates.split(",") if r]
    hooks = [h for h in args.hooks.split(",") if h]
    try:
        for r in [*rates, args.compression_rate]:
            rate_bits(r)
    except ValueError as e:
        print(f"{prog} {e}", file=sys.stderr)
        return 2
    if not set(hooks) <= set(HOOKS) or not (rates or hooks):
        print(f"{prog} --hooks {args.hooks!r}: each one of {', '.join(HOOKS)} (and --rates or --hooks non-empty)",
              file=sys.stderr)
        return 2
    if args.steps <= schema.WARMUP_STEPS:
        print(f"{prog} --steps must exceed {schema.WARMUP_STEPS}", file=sys.stderr)
        return 2
    placement = host_runs.place(2, args.compression_rate)
    with placement.running():
        print(placement.describe(), flush=True)
        sweep, hook_rows = sweep_and_compression(placement, rates, args.steps, rate=args.compression_rate,
                                                 hooks=hooks)
    print(report(sweep, hook_rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(strict_json({"link_sweep": sweep, "compression": hook_rows}, indent=1))
    return 0


if __name__ == "__main__":
    run_main(main, sigterm_exits=True)  # a SIGTERM kills the launched process groups too
