"""Step logs -> chapter 02's scaling table and plots (the enterprise seed's parse_logs, as a library).

Every number is a column of distlab.results.schema: steady state after schema.WARMUP_STEPS, the slowest
rank's step time, tokens/s of real tokens, speedup(k) = tokens/s(k) / tokens/s(1) and
scaling_efficiency(k) = speedup(k) / k.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import matplotlib.pyplot as plt
import pandas as pd

from distlab.publish.provenance import save_figure, save_table
from distlab.results import schema

# The scaling table's columns, all from the schema.
SCALING_COLUMNS = ["world_size", "steps_averaged", "step_time_s", "tokens_per_s", "speedup", "scaling_efficiency",
                   "comm_time_s", "compute_time_s", "comm_share", "comm_bytes", "peak_mem_bytes",
                   "peak_mem_bytes_per_rank", "mfu", "final_loss"]


def run_summary(log_path: str | Path) -> dict[str, float]:
    """One run's schema summary from its step logs (rank 0's `train_log.jsonl`; the other ranks' logs
    beside it are read too, for the slowest rank's step time)."""
    return schema.summarise_logs(log_path)


def scaling_summary(runs: Mapping[int, str | Path]) -> pd.DataFrame:
    """One row per world size; `runs` maps world size -> rank-0 step log. Needs world size 1."""
    if 1 not in runs:
        raise ValueError("scaling needs the 1-rank baseline (world size 1) among the runs")
    rows = schema.add_scaling([run_summary(path) for _, path in sorted(runs.items())])
    return pd.DataFrame(rows)[SCALING_COLUMNS]


def save_scaling(df: pd.DataFrame, figures_dir: str | Path, provenance: dict, prefix: str = "scaling") -> list[Path]:
    """figures/<prefix>_summary.csv, _summary.md, _plot.png and, with comm timing, _comm_compute.png."""
    figures_dir = Path(figures_dir)
    out = [save_table(df, figures_dir / f"{prefix}_summary.csv", provenance),
           save_table(df.round(4), figures_dir / f"{prefix}_summary.md", provenance)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    ax1.bar(df["world_size"].astype(str), df["tokens_per_s"], color="C0")
    ax1.set(xlabel="world size (ranks)", ylabel="tokens/s (all ranks)", title="throughput")
    for x, (tps, sp) in enumerate(zip(df["tokens_per_s"], df["speedup"])):
        ax1.text(x, tps, f"{sp:.2f}x", ha="center", va="bottom", fontsize=8)
    ax2.plot(df["world_size"], df["scaling_efficiency"], "o-", color="C1")
    ax2.axhline(1.0, color="0.6", ls="--", lw=1)
    ax2.set_xticks(df["world_size"])
    ax2.set(ylim=(0, 1.15), xlabel="world size (ranks)", ylabel="efficiency = speedup / k", title="scaling efficiency")
    fig.tight_layout()
    out.append(save_figure(fig, figures_dir / f"{prefix}_plot.png", provenance))
    plt.close(fig)
    if df["comm_time_s"].notna().any():
        fig, ax = plt.subplots(figsize=(5.5, 3.2))
        labels = df["world_size"].astype(str)
        ax.bar(labels, df["compute_time_s"] * 1e3, label="compute")
        ax.bar(labels, df["comm_time_s"] * 1e3, bottom=df["compute_time_s"] * 1e3,
               label="gradient all-reduce (incl. waiting for the slower rank)")
        tallest = float(((df["compute_time_s"] + df["comm_time_s"]) * 1e3).max())
        ax.set(xlabel="world size (ranks)", ylabel="ms per optimizer step (slowest rank)",
               title="where a step's time goes (measured)", ylim=(0, tallest * 1.3))  # headroom: legend above bars
        ax.legend(fontsize=7, loc="upper right")
        fig.tight_layout()
        out.append(save_figure(fig, figures_dir / f"{prefix}_comm_compute.png", provenance))
        plt.close(fig)
    return out


def allreduce_cost(trainable_params: float, bytes_per_grad: float, world_size: int, gbit_per_s: float) -> float:
    """Seconds for one ring all-reduce of all gradients: 2(k-1)/k x bytes over the slowest link."""
    nbytes = trainable_params * bytes_per_grad
    return 2 * (world_size - 1) / world_size * nbytes / (gbit_per_s * 1e9 / 8)
