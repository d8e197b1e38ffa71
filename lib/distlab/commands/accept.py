"""The enterprise assistant's acceptance checks, over run folders (exit 1 naming each failed check).

    python -m distlab accept build/runs/matrix/ddp_ws1 build/runs/matrix/ddp_ws2 --answers build/infer

  log fields   rank 0's step log has world_size, step_time_s and tokens_per_s (finite, > 0) every N steps
               (N: --every, else the run's own logging_steps) and at the last step, and a finite loss at
               every logged step and at the end (a NaN or infinite loss fails the run, naming the step)
  activity     non-zero device activity during training: the run's monitor.csv (distlab.commands.matrix writes it;
               or run the launch under `python -m distlab monitor --out RUN -- ...`, or give --monitor CSV)
               shows utilisation > 0 on the GPUs, or on every training rank on CPU
  answers      with --answers DIR (python -m distlab infer's --out): every answer differs before/after and,
               when the prompts carry facts, key-fact accuracy rose (--min-changed: a share instead of all)
  throughput   with two or more world sizes: tokens/s rises with world size (distlab.results.schema's
               steady-state tokens/s)

A check that has nothing to look at is SKIPped and says why; `--skip NAME` skips one on purpose.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pandas as pd

from distlab.cli import UsageError, finite_float
from distlab.metrics import read_log
from distlab.results import schema

CHECKS = ("log fields", "activity", "answers", "throughput")
REQUIRED_FIELDS = ("world_size", "step_time_s", "tokens_per_s")


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value) -> bool:
    return _finite(value) and value > 0


def check_log_fields(run: Path, every: int | None) -> tuple[bool, str]:
    log = run / "train_log.jsonl"
    if not log.is_file():
        return False, f"{log}: no step log"
    steps = read_log(log)
    if not steps:
        return False, f"{log}: no step records"
    start = read_log(log, event="start")
    n = every or (start[-1].get("config", {}).get("logging_steps") if start else None) or 5
    last = max(int(s["step"]) for s in steps)
    by_step = {int(s["step"]): s for s in steps}
    problems = []
    for step in sorted({*range(n, last + 1, n), last}):
        rec = by_step.get(step)
        if rec is None:
            problems.append(f"step {step}: not logged")
            continue
        bad = [f for f in REQUIRED_FIELDS if not _positive(rec.get(f))]
        if bad:
            problems.append(f"step {step}: {', '.join(f'{f}={rec.get(f)!r}' for f in bad)}")
    # the loss at every logged step, not every N: a run that diverged between two samples still wrote NaN
    diverged = [f"step {s['step']}: loss={s.get('loss')!r} is not finite" for s in steps if not _finite(s.get("loss"))]
    end = read_log(log, event="end")
    if end and "final_loss" in end[-1] and not _finite(end[-1]["final_loss"]):
        diverged.append(f"end: final_loss={end[-1]['final_loss']!r} is not finite")
    problems = diverged + problems  # the worst news first
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        return False, (f"{log}: every {n} steps needs {', '.join(REQUIRED_FIELDS)} > 0, every step a finite loss; "
                       + "; ".join(problems[:3]) + more)
    return True, f"{', '.join(REQUIRED_FIELDS)} at every {n} steps up to step {last}"


def check_activity(run: Path, monitor: Path | None) -> tuple[bool | None, str]:
    csv = monitor or run / "monitor.csv"
    if not csv.is_file():
        return False, (f"{csv}: no utilisation samples (launch with python -m distlab matrix, or under "
                       f"python -m distlab monitor --out {run} -- ...)")
    df = pd.read_csv(csv, dtype={"id": str})
    gpus = df[df["source"] == "gpu"]
    if not gpus.empty:
        busy = gpus.groupby("label")["util_pct"].max()
    else:
        ranks = df[df["label"].str.startswith("rank ")]
        busy = (ranks if not ranks.empty else df).groupby("label")["util_pct"].max()
    if busy.empty:
        return False, f"{csv}: no samples"
    idle = busy[~(busy > 0)]
    shown = ", ".join(f"{label} {util:.0f}%" for label, util in busy.items())
    if not idle.empty:
        return False, f"{csv}: no activity on {', '.join(idle.index)} (peak: {shown})"
    return True, f"peak utilisation {shown}"


def check_answers(answers: Path, min_changed: float = 1.0) -> tuple[bool, str]:
    summary_file = answers / "summary.json"
    if not summary_file.is_file():
        raise FileNotFoundError(f"--answers {answers}: no summary.json (the --out folder of python -m distlab infer)")
    s = json.loads(summary_file.read_text())
    if "after" not in s:
        return False, f"{summary_file}: inference ran without --adapter: nothing to compare"
    problems = []
    if s["changed"] < min_changed * s["answers"]:
        problems.append(f"only {s['changed']} of {s['answers']} answers differ before/after (need {min_changed:.0%})")
    before, after = s["before"]["accuracy"], s["after"]["accuracy"]
    if before is not None and not after > before:
        problems.append(f"key-fact accuracy did not rise ({before:.1%} -> {after:.1%})")
    facts = f"; key-fact accuracy {before:.1%} -> {after:.1%}" if before is not None else "; no facts to score"
    if problems:
        return False, f"{summary_file}: " + "; ".join(problems)
    return True, f"{s['changed']} of {s['answers']} answers differ{facts}"


def check_throughput(runs: list[Path]) -> tuple[bool | None, str]:
    rows = sorted((schema.summarise_logs(run) for run in runs), key=lambda r: r["world_size"])
    sizes = [r["world_size"] for r in rows]
    if len(set(sizes)) < 2:
        return None, f"one world size only ({sizes[0]}): nothing to compare"
    shown = ", ".join(f"{r['world_size']} rank(s) {r['tokens_per_s']:.0f} tok/s" for r in rows)
    rising = all(b["tokens_per_s"] > a["tokens_per_s"] and b["world_size"] > a["world_size"]
                 for a, b in zip(rows, rows[1:]))
    return rising, shown if rising else f"tokens/s does not rise with world size: {shown}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab accept", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run folder (train_log.jsonl, monitor.csv)")
    parser.add_argument("--every", type=int, help="log fields every N steps (default: the run's logging_steps)")
    parser.add_argument("--monitor", help="utilisation CSV for every run (default: RUN/monitor.csv)")
    parser.add_argument("--answers", help="python -m distlab infer's --out folder (before/after answers)")
    parser.add_argument("--min-changed", type=finite_float, default=1.0,
                        help="share of answers that must differ before/after (default 1: all)")
    parser.add_argument("--skip", action="append", default=[], choices=CHECKS, help="skip a check (repeatable)")
    args = parser.parse_args(argv)
    runs = [Path(r) for r in args.runs]
    for run in runs:
        if not run.is_dir():
            raise FileNotFoundError(f"{run}: no such run folder")
    if not 0 < args.min_changed <= 1:
        raise UsageError(f"--min-changed {args.min_changed}: expected a share in (0, 1]")
    if args.every is not None and args.every < 1:
        raise UsageError(f"--every {args.every}: expected an integer >= 1")
    results: list[tuple[str, str, bool | None, str]] = []  # check, subject, passed (None: skipped), detail
    for run in runs:
        if "log fields" not in args.skip:
            results.append(("log fields", run.name, *check_log_fields(run, args.every)))
        if "activity" not in args.skip:
            results.append(("activity", run.name, *check_activity(run, Path(args.monitor) if args.monitor else None)))
    if "answers" not in args.skip:
        judged = check_answers(Path(args.answers), args.min_changed) if args.answers else (None, "no --answers DIR")
        results.append(("answers", "before/after", *judged))
    if "throughput" not in args.skip:
        logs_ok = all(ok for check, _, ok, _ in results if check == "log fields")
        results.append(("throughput", "world sizes", *(check_throughput(runs) if logs_ok else
                                                       (None, "needs every run's step log to pass first"))))
    for check, subject, ok, detail in results:
        print(f"{'SKIP' if ok is None else 'PASS' if ok else 'FAIL'}  {check:<10}  {subject}: {detail}", flush=True)
    failed = [f"{check} ({subject})" for check, subject, ok, _ in results if ok is False]
    if failed:
        print(f"{parser.prog}: {len(failed)} check(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"all {sum(ok is True for *_, ok, _ in results)} checks passed "
          f"({sum(ok is None for *_, ok, _ in results)} skipped)")
    return 0
