"""The strategy x world-size matrix, run locally with the same generated torchrun scripts a cluster would run
(the Kubernetes benchmark's run_all_benchmarks).

    python -m distlab matrix --strategies ddp,fsdp --world-sizes 1,2 --steps 20 --runs-dir build/runs/matrix
    python -m distlab report build/runs/matrix/*_ws*      # metrics csv, plots, BENCHMARK_REPORT.md
    python -m distlab scaling build/runs/matrix/ddp_ws*   # the scaling summary of one strategy

Each cell is one launch (distlab.launch.local: <runs-dir>/launch/<run>.sh, own process group, hard timeout)
into <runs-dir>/<strategy>_ws<k>/, with its step logs, console.log holding every rank's result markers, and
monitor.csv/.png: the utilisation of the launch's processes (or GPUs) while it ran. Cells run one after
another; a failed cell is reported at the end (exit 1) and the others still run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from distlab.cli import UsageError
from distlab.config import PIPELINE_STRATEGIES, STRATEGY_NAMES, load_config, parse_override
from distlab.launch.local import TINY_CONFIG, launch_training, max_local_ranks
from distlab.measure.utilisation import UtilizationSampler, plot_utilization
from distlab.paths import RUNS_DIR
from distlab.provenance import stamp


def _names(text: str, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise UsageError(f"--{what} {text!r}: give a comma-separated list")
    return items


def cells(strategies: list[str], world_sizes: list[int]) -> list[tuple[str, int]]:
    """The (strategy, world size) pairs to run; those a strategy cannot run are refused, not skipped."""
    for s in strategies:
        if s not in STRATEGY_NAMES:
            raise UsageError(f"--strategies: unknown strategy {s!r}; available: {', '.join(STRATEGY_NAMES)}")
    out = []
    for s in strategies:
        for k in world_sizes:
            if s == "single" and k != 1:
                raise UsageError(f"strategy single runs on 1 rank only, not {k} (use ddp for a 1-rank baseline)")
            if s in PIPELINE_STRATEGIES and k < 2:
                raise UsageError(f"strategy {s} needs at least 2 ranks (stages), not {k}")
            out.append((s, k))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab matrix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", default="ddp", help="comma-separated, e.g. ddp,fsdp,zero2 (default ddp)")
    parser.add_argument("--world-sizes", default="1,2", help="comma-separated rank counts (default 1,2)")
    parser.add_argument("--config", default=str(TINY_CONFIG), help="TrainConfig YAML (default tiny_lora.yaml)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run (default 20)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    parser.add_argument("--runs-dir", default=str(RUNS_DIR / "matrix"), help="parent of the run folders")
    parser.add_argument("--timeout-s", type=int, default=900, help="hard limit per launch (default 900)")
    parser.add_argument("--no-monitor", action="store_true", help="do not sample utilisation during each run")
    parser.add_argument("--quiet", action="store_true", help="do not echo the ranks' output")
    args = parser.parse_args(argv)
    try:
        world_sizes = [int(k) for k in _names(args.world_sizes, "world-sizes")]
    except ValueError:
        raise UsageError(f"--world-sizes {args.world_sizes!r}: expected integers like 1,2,4") from None
    if min(world_sizes) < 1 or args.steps < 1 or args.timeout_s < 1:
        raise UsageError("--world-sizes, --steps and --timeout-s must be >= 1")
    todo = cells(_names(args.strategies, "strategies"), world_sizes)
    overrides = {**dict(parse_override(s) for s in args.set), "max_steps": args.steps, "progress": False}
    for strategy, _ in todo:  # every field checked before anything is launched
        cfg = load_config(args.config, {**overrides, "strategy": strategy})
        model = cfg.model or "distlab-tiny"
    most, why = max_local_ranks(cfg.device)
    if max(world_sizes) > most:
        raise UsageError(f"--world-sizes {max(world_sizes)}: a local launch holds at most {most} ranks here ({why})")
    failed = []
    for strategy, k in todo:
        name = f"{strategy}_ws{k}"
        run_dir = Path(args.runs_dir) / name
        t0 = time.monotonic()
        sampler = None if args.no_monitor else UtilizationSampler(Path(args.runs_dir) / f".{name}.monitor.csv",
                                                                  pids="children")
        if sampler:
            sampler.start()
        try:
            job = launch_training(name, k, {**overrides, "strategy": strategy}, config=args.config,
                                  runs_dir=Path(args.runs_dir), timeout_s=args.timeout_s, echo=not args.quiet,
                                  check=False, scripts_dir=Path(args.runs_dir) / "launch")
        finally:
            if sampler:
                sampler.stop()
        if sampler:  # into the run folder, which the launch cleared and re-created
            csv = sampler.csv_path.replace(run_dir / "monitor.csv")
            plot_utilization(csv, run_dir / "monitor.png", stamp(model, k, run=name), title=f"{name}: activity")
        status = "ok" if job.result.ok else ("timed out" if job.result.timed_out else
                                             f"failed (exit {job.result.returncode})")
        print(f"[matrix] {name}: {status} in {time.monotonic() - t0:.1f} s -> {run_dir}", flush=True)
        if not job.result.ok:
            failed.append(f"{name} ({status}; log {run_dir / 'console.log'})")
    if failed:
        print(f"{parser.prog}: {len(failed)} of {len(todo)} run(s) failed: " + "; ".join(failed),
              file=sys.stderr)
    return 1 if failed else 0
