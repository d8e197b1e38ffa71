"""Log markers -> metrics csv, plots and the benchmark report, in one command
(the Kubernetes benchmark's parse_metrics.py, plot.py and make_report.py).

    python -m distlab report build/runs/matrix/ddp_ws1 build/runs/matrix/ddp_ws2 --out build/report
    python -m distlab report pod-logs/*.log --out build/report     # kubectl logs, torchrun consoles

Each SOURCE is a run folder (its console.log, or torchrun's per-rank logs under torchrun/) or a log file
holding the DISTLAB_RESULT_START/END markers every rank prints (several runs in one log are fine). A
truncated or doubled marker is an error naming the log and line (distlab.results.extract). Writes
<out>/strategy_metrics.csv, the four strategy_*.png plots and BENCHMARK_REPORT.md, and prints the table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from distlab import markdown
from distlab.cli import UsageError
from distlab.jsonio import strict_json
from distlab.paths import BUILD_DIR
from distlab.provenance import stamp
from distlab.results import benchmark_report, extract


def collect_sources(sources: list[str]) -> list[dict[int, dict]]:
    """Runs (rank -> record) from run folders and log files. Records are grouped by run name, so one run's
    ranks may come from several logs (torchrun's per-rank stdout.log files, one kubectl log per pod), and
    one log may hold several runs; a rank of a run found twice is an error."""
    runs: dict[str, dict[int, dict]] = {}
    where: dict[tuple[str, int], str] = {}
    for source in sources:
        path = Path(source)
        if path.is_dir():
            found = extract.collect_run(path)
        elif path.is_file():
            found = extract.extract_results(path)
            if not found:
                raise extract.ResultLogError(f"{source}: no DISTLAB_RESULT markers in this log")
        else:
            raise FileNotFoundError(f"{source}: no such run folder or log file")
        for rank, rec in found.items():
            key = (rec.get("run", "?"), rank)
            if key in where:
                raise UsageError(f"run {key[0]} rank {rank} given twice: in {where[key]} and in {source}")
            where[key] = source
            runs.setdefault(key[0], {})[rank] = rec
    return list(runs.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab report", description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="+", metavar="SOURCE", help="run folder or log file with result markers")
    parser.add_argument("--out", default=str(BUILD_DIR / "report"), help="folder for the csv, plots and report")
    parser.add_argument("--title", default="Strategy benchmark")
    args = parser.parse_args(argv)
    runs = collect_sources(args.sources)
    df = benchmark_report.aggregate(runs)
    models = sorted({r[min(r)].get("model", "?") for r in runs})
    provenance = stamp(", ".join(models), "/".join(str(w) for w in df["world_size"]))
    paths = [benchmark_report.save_metrics(df, args.out, provenance),
             *benchmark_report.save_plots(df, args.out, provenance),
             benchmark_report.write_report(df, args.out, provenance, title=args.title)]
    print(markdown.table(df[["run", "strategy", "mode", "world_size", "tokens_per_s", "step_time_s",
                             "scaling_efficiency", "peak_mem_bytes", "final_loss"]]))
    print(strict_json({"wrote": [str(p) for p in paths]}))
    return 0
