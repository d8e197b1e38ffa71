"""Device activity around any command (the enterprise LoRA demo's rocm-smi / nvidia-smi watch).

    python -m distlab monitor --out build/monitor -- bash launch/run_1gpu.sh
    python -m distlab monitor --out build/runs/x -- python -m distlab.train --config ...

Runs the command in its own process group with a hard timeout (distlab.launch.process), samples every
`--interval-s` the utilisation and memory of each GPU (nvidia-smi / rocm-smi) or, without one, of each process
the command started (CPU %, 100 = one core busy, and RSS), and writes <out>/monitor.csv, <out>/monitor.png
and a per-device summary. Exits with the command's status.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from distlab.cli import UsageError, finite_float
from distlab.launch.process import run
from distlab.measure.utilisation import UtilizationSampler, plot_utilization
from distlab.paths import BUILD_DIR
from distlab.provenance import stamp


def summarise(csv_path) -> pd.DataFrame:
    """Per device or process: samples, peak and mean utilisation (%), peak memory (MiB)."""
    df = pd.read_csv(csv_path, dtype={"id": str})
    if df.empty:
        return pd.DataFrame(columns=["label", "samples", "util_pct_max", "util_pct_mean", "mem_mib_max"])
    return (df.groupby(["source", "id"], sort=False)
              .agg(label=("label", "first"), samples=("t_s", "size"), util_pct_max=("util_pct", "max"),
                   util_pct_mean=("util_pct", "mean"), mem_mib_max=("mem_mib", "max"))
              .reset_index(drop=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab monitor", description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s [options] -- CMD [ARG ...]")
    parser.add_argument("--out", default=str(BUILD_DIR / "monitor"), help="folder for monitor.csv/.png")
    parser.add_argument("--interval-s", type=finite_float, default=0.5, help="seconds between samples (default 0.5)")
    parser.add_argument("--source", choices=["auto", "gpu", "process"], default="auto",
                        help="auto: GPUs when nvidia-smi/rocm-smi answers, else the command's processes")
    parser.add_argument("--timeout-s", type=finite_float, default=3600, help="kill the command's group after this")
    parser.add_argument("--quiet", action="store_true", help="do not echo the command's output")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args, cmd = parser.parse_args(argv[:split]), argv[split + 1:]
    if not cmd:
        raise UsageError(f"no command to monitor: put it after `--`, e.g. {parser.prog} -- sleep 1")
    if args.interval_s <= 0 or args.timeout_s <= 0:
        raise UsageError(f"--interval-s {args.interval_s} / --timeout-s {args.timeout_s}: both must be > 0")
    out = Path(args.out)
    csv_path = out / "monitor.csv"
    with UtilizationSampler(csv_path, interval_s=args.interval_s, pids="children", source=args.source) as sampler:
        result = run(cmd, timeout_s=args.timeout_s, log_path=out / "monitor_console.log", echo=not args.quiet,
                     check=False)
    plot_utilization(csv_path, out / "monitor.png", stamp("n/a", "n/a", command=" ".join(cmd)),
                     title=f"{sampler.source} activity: {' '.join(cmd)[:70]}")
    table = summarise(csv_path)
    print(f"[monitor] {sampler.rows} samples ({sampler.source}) -> {csv_path}, {out / 'monitor.png'}")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.1f}"))
    for note in sampler.errors:
        print(f"[monitor] note: {note}", file=sys.stderr)
    if not result.ok:
        print(f"[monitor] the command {'timed out' if result.timed_out else f'exited {result.returncode}'}",
              file=sys.stderr)
    return 124 if result.timed_out else (result.returncode or 0)
