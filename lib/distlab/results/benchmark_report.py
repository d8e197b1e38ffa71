"""Result records of several runs -> the strategy benchmark: one row per run (`aggregate`, saved as
figures/strategy_metrics.csv), the four plots of the Kubernetes benchmark drawn (`save_plots`: tokens/s,
the slowest rank's step time, peak memory per rank, scaling efficiency against the 1-rank run), the loss curves
compared (`loss_agreement`), and `write_report`'s BENCHMARK_REPORT.md with the tables and their
provenance (the benchmark framework's parse_metrics, plot and make_report, as a library).

Every column is one of distlab.results.schema's, computed by schema.summarise from the per-step lists
the records carry (the same function chapter 02 runs on step logs): steady state after
schema.WARMUP_STEPS, the slowest rank's step time, efficiency and communication share as fractions,
peak memory in bytes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable, Mapping

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from distlab import markdown
from distlab.provenance import save_figure, save_table, stamp_text, write_sidecar
from distlab.results import schema

METRICS = ["run", "strategy", "mode", "world_size", "global_batch_size", "steps_averaged", "tokens_per_s",
           "step_time_s", "speedup", "scaling_efficiency", "comm_time_s", "comm_share", "peak_mem_bytes",
           "peak_mem_bytes_per_rank", "mean_loss", "final_loss"]


def _rank_steps(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A rank record's per-step lists as the step records schema.summarise reads."""
    n = len(record["steps"])
    comm = record.get("comm_time_s") or [None] * n
    nbytes = record.get("comm_bytes") or [None] * n
    return [{"step": step, "loss": loss, "tokens": tokens, "step_time_s": seconds, "comm_time_s": c, "comm_bytes": b,
             "peak_mem_bytes": record["peak_mem_bytes"]}
            for step, loss, tokens, seconds, c, b in zip(record["steps"], record["loss"], record["tokens"],
                                                         record["step_time_s"], comm, nbytes)]


def run_metrics(results: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """One run's row from its ranks' records (all ranks must be of the same run): schema.summarise over
    the steps every rank logged. speedup and scaling_efficiency need the other runs (aggregate)."""
    if not results:
        raise ValueError("no results to summarise")
    ranks = sorted(results)
    first = results[ranks[0]]
    for r in ranks:
        rec = results[r]
        for key in ("run", "strategy", "world_size", "mode"):
            if rec.get(key) != first.get(key):
                raise ValueError(f"rank {r} belongs to another run ({key}={rec.get(key)!r}, rank {ranks[0]} has "
                                 f"{first.get(key)!r})")
    world = int(first["world_size"])
    if ranks != list(range(world)):
        raise ValueError(f"run {first.get('run')}: results of ranks {ranks}, expected 0..{world - 1}")
    summary = schema.summarise({r: _rank_steps(results[r]) for r in ranks}, source=f"run {first.get('run')}")
    return {"run": first.get("run"), "strategy": first["strategy"], "mode": first["mode"],
            "global_batch_size": first.get("global_batch_size"), **summary}


def aggregate(runs: Iterable[Mapping[int, Mapping[str, Any]]]):
    """A DataFrame with one row per run (METRICS columns). scaling_efficiency compares each run with the
    1-rank run of the same mode (LoRA or full) when there is one, else it is NaN."""

    rows = schema.add_scaling([run_metrics(r) for r in runs], same_setup=("mode",))
    return pd.DataFrame(rows, columns=METRICS)


def losses_by_run(runs: Iterable[Mapping[int, Mapping[str, Any]]]):
    """A DataFrame of the training loss per step (rows) and run (columns), from rank 0's records."""

    cols = {}
    for results in runs:
        rec = results[min(results)]
        cols[rec["run"]] = pd.Series(rec["loss"], index=rec["steps"])
    return pd.DataFrame(cols).rename_axis("step")


def save_metrics(df, figures_dir: str | Path, provenance: dict, name: str = "strategy_metrics.csv") -> Path:
    return save_table(df, Path(figures_dir) / name, provenance)


# file names kept from the Kubernetes benchmark's framework
PLOTS = {"tokens_per_s": "strategy_tokens_per_sec.png", "step_time_s": "strategy_step_time.png",
         "peak_mem_bytes_per_rank": "strategy_peak_memory.png", "scaling_efficiency": "strategy_scaling_efficiency.png"}


def _label(row) -> str:
    return f"{row['strategy']}\nx{row['world_size']}"


def save_plots(df, figures_dir: str | Path, provenance: dict, memory_label: str = "peak memory per rank (MiB)"
               ) -> list[Path]:
    """Throughput, step time, peak memory per rank and scaling efficiency, one bar per run, grouped by mode
    (LoRA / full). `memory_label` says what the memory is (the process's peak RSS on CPU, the allocator's
    peak on a GPU). Efficiency is n/a for a mode without a 1-rank run to compare with."""

    figures_dir = Path(figures_dir)
    modes = list(dict.fromkeys(df["mode"]))
    out = []
    specs = [("tokens_per_s", "tokens/s (all ranks)", "throughput"),
             ("step_time_s", "step time (s, slowest rank)", "step time"),
             ("peak_mem_bytes_per_rank", memory_label, "peak memory per rank"),
             ("scaling_efficiency", "speedup / world size", "scaling efficiency")]
    for key, ylabel, title in specs:
        fig, axes = plt.subplots(1, len(modes), figsize=(4.2 * len(modes), 3.3), squeeze=False)
        for ax, mode in zip(axes[0], modes):
            sub = df[df["mode"] == mode].reset_index(drop=True)
            x = np.arange(len(sub))
            if key == "peak_mem_bytes_per_rank":
                per_rank = [[b / 2**20 for b in schema.parse_per_rank(s)] for s in sub[key]]
                width = 0.8 / max(len(p) for p in per_rank)
                for r in range(max(len(p) for p in per_rank)):
                    ax.bar(x + (r - 0.5) * width, [p[r] if r < len(p) else 0 for p in per_rank], width,
                           label=f"rank {r}")
                ax.legend(fontsize=7)
            else:
                vals = sub[key].astype(float)
                ax.bar(x, vals.fillna(0), color=[f"C{i}" for i in range(len(sub))])
                for xi, v in zip(x, vals):
                    text = "n/a" if np.isnan(v) else (f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}")
                    ax.text(xi, 0 if np.isnan(v) else v, text, ha="center", va="bottom", fontsize=7)
                if key == "scaling_efficiency":  # perfect scaling, the line every bar is read against
                    ax.axhline(1.0, color="grey", ls="--", lw=0.8)
                    ax.set_ylim(0, max(1.2, float(vals.max(skipna=True) or 0) * 1.15))
            ax.set_xticks(x, [_label(r) for _, r in sub.iterrows()], fontsize=7)
            ax.set_title(f"{title}: {mode}", fontsize=9)
            ax.set_ylabel(ylabel, fontsize=8)
        fig.tight_layout()
        out.append(save_figure(fig, figures_dir / PLOTS[key], provenance))
        plt.close(fig)
    return out


REPORT_COLUMNS = ["strategy", "world_size", "tokens_per_s", "step_time_s", "scaling_efficiency", "comm_share",
                  "peak_mem_bytes", "mean_loss"]


def write_report(df, figures_dir: str | Path, provenance: dict, *, title: str = "Strategy benchmark",
                 sections: Mapping[str, Any] | None = None, notes: Iterable[str] = (),
                 name: str = "BENCHMARK_REPORT.md") -> Path:
    """figures/BENCHMARK_REPORT.md: the metrics per mode, peak memory per rank, extra `sections`
    (title -> DataFrame or Markdown text), the plots' file names, the columns' definitions (from the
    schema) and the provenance. Headings are level 4 so that the report nests under the book's results
    page, which includes it."""
    figures_dir = Path(figures_dir)
    lines = [f"**{markdown.cell(title)}**", "", f"_Provenance: {stamp_text(provenance)}_", "",
             "Generated by `distlab.results.benchmark_report.write_report` from the result JSON every rank printed "
             "between `DISTLAB_RESULT_START`/`END` markers in its log.", ""]
    for mode in dict.fromkeys(df["mode"]):
        sub = df[df["mode"] == mode]
        lines += [f"#### {'LoRA' if mode == 'lora' else 'Full fine-tuning'}: metrics", "",
                  markdown.table(sub[REPORT_COLUMNS]), ""]
    lines += ["#### Peak memory per rank (bytes)", "", markdown.table(df[["run", "peak_mem_bytes_per_rank"]]), ""]
    for heading, content in (sections or {}).items():
        text = content if isinstance(content, str) else markdown.table(content)
        lines += [f"#### {heading}", "", text, ""]
    lines += ["#### Plots", "", ", ".join(f"`{p}`" for p in PLOTS.values()) + " (next to this report).", ""]
    lines += ["#### Definitions", "", f"Steady state: every step after the first {schema.WARMUP_STEPS} "
              "(warm-up) steps of each run.", ""]
    lines += [f"- {col}: {schema.COLUMNS[col]}." for col in REPORT_COLUMNS[2:] + ["peak_mem_bytes_per_rank"]]
    lines += [""] + [f"- {note}" for note in notes]
    path = figures_dir / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines).rstrip() + "\n")
    write_sidecar(path, provenance)
    return path


def loss_agreement(runs: Iterable[Mapping[int, Mapping[str, Any]]], reference: str = "ddp"):
    """Per run: the largest relative difference of its loss curve from the reference strategy's run
    of the same mode (rank 0's records; the loss is all-reduced, the same on every rank)."""

    recs = [r[min(r)] for r in runs]
    refs = {rec["mode"]: rec for rec in recs if rec["strategy"] == reference}
    rows = []
    for rec in recs:
        ref = refs.get(rec["mode"])
        if ref is None:
            raise ValueError(f"no {reference} run of mode {rec['mode']} to compare {rec['run']} with")
        if rec["steps"] != ref["steps"]:
            raise ValueError(f"{rec['run']} logged steps {rec['steps']}, {ref['run']} logged {ref['steps']}")
        diffs = [abs(a - b) / abs(b) for a, b in zip(rec["loss"], ref["loss"])]
        # max() keeps or drops a NaN depending on where it stands: a diverged step must show as NaN
        diff = math.nan if any(math.isnan(d) for d in diffs) else max(diffs)
        rows.append({"run": rec["run"], "strategy": rec["strategy"], "mode": rec["mode"],
                     "world_size": rec["world_size"], "steps": len(rec["steps"]), "final_loss": rec["loss"][-1],
                     f"max rel. diff vs {reference}": diff})
    return pd.DataFrame(rows)
