"""Step logs -> the scaling summary (the enterprise LoRA demo's parse_logs), across run folders.

    python -m distlab scaling build/runs/enterprise_7b/run_1gpu build/runs/enterprise_7b/run_4gpu

Each RUN is a run folder (or its rank-0 `train_log.jsonl`) as distlab.train writes it under any launcher:
the generated launch/run_*.sh scripts, distlab.launch.local.launch_training, Slurm. Writes <out>/scaling_summary.csv,
scaling_summary.md, scaling_plot.png (and scaling_comm_compute.png when the runs timed communication)
and prints the table. The columns are distlab.results.schema's: steady state after the warm-up steps,
the slowest rank's step time, speedup and efficiency against the 1-rank run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from distlab import markdown
from distlab.cli import UsageError
from distlab.jsonio import strict_json
from distlab.metrics import read_log
from distlab.paths import BUILD_DIR
from distlab.provenance import stamp
from distlab.results import scaling_table, schema


def model_of(run: str | Path) -> str:
    """The model a run trained, from its start record ('distlab-tiny' for the default)."""
    log = Path(run) / "train_log.jsonl" if Path(run).is_dir() else Path(run)
    start = read_log(log, event="start")
    return (start[-1].get("config", {}).get("model") if start else None) or "distlab-tiny"


def runs_table(runs: list[str]) -> pd.DataFrame:
    """One row per run, sorted by world size, with a `run` column; speedup needs a 1-rank run (else NaN)."""
    rows = []
    for run in runs:
        row = scaling_table.run_summary(run)
        rows.append({"run": str(run), **row})
    sizes = [r["world_size"] for r in rows]
    if len(set(sizes)) != len(sizes):
        dup = sorted({s for s in sizes if sizes.count(s) > 1})
        raise UsageError(f"several runs with world size {', '.join(map(str, dup))}: give one run per world size")
    rows = schema.add_scaling(sorted(rows, key=lambda r: r["world_size"]))
    return pd.DataFrame(rows)[["run"] + scaling_table.SCALING_COLUMNS]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab scaling", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run folder (or its train_log.jsonl)")
    parser.add_argument("--out", default=str(BUILD_DIR / "artifacts"), help="folder for the summary files")
    args = parser.parse_args(argv)
    for run in args.runs:
        if not Path(run).exists():
            raise FileNotFoundError(f"{run}: no such run folder or step log")
    df = runs_table(args.runs)
    models = sorted({model_of(r) for r in args.runs})
    provenance = stamp(", ".join(models), "/".join(str(w) for w in df["world_size"]))
    paths = scaling_table.save_scaling(df.drop(columns="run"), args.out, provenance)
    shown = df.assign(run=[Path(r).name if Path(r).is_dir() else r for r in df["run"]])
    print(markdown.table(shown[["run", "world_size", "steps_averaged", "step_time_s", "tokens_per_s", "speedup",
                 "scaling_efficiency", "peak_mem_bytes"]]))
    print(strict_json({"wrote": [str(p) for p in paths]}))
    return 0
