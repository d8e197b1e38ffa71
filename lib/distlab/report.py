"""Step logs -> scaling tables and plots (the enterprise seed's parse_logs, as a library).

Steady state: the first `skip_steps` optimizer steps of every run (compilation of kernels, allocator
growth, first all-reduces setting up buffers) are left out of every average.
speedup(k) = tokens/s(k) / tokens/s(1); efficiency(k) = speedup(k) / k.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import pandas as pd

from .metrics import read_log
from .provenance import save_figure, save_table


def steps_frame(log_path: str | Path) -> pd.DataFrame:
    df = pd.DataFrame(read_log(log_path))
    if df.empty:
        raise ValueError(f"{log_path}: no step records (did the run log any step?)")
    return df


def steady_state(df: pd.DataFrame, skip_steps: int) -> pd.DataFrame:
    steady = df[df["step"] > skip_steps]
    if steady.empty:
        raise ValueError(f"no steps after the first {skip_steps}: run longer or skip fewer")
    return steady


def run_summary(log_path: str | Path, skip_steps: int = 5) -> dict[str, float]:
    df = steady_state(steps_frame(log_path), skip_steps)
    row = {
        "world_size": int(df["world_size"].iloc[0]),
        "steps_averaged": len(df),
        "avg_step_time_s": df["step_time_s"].mean(),
        "avg_tokens_per_s": df["tokens"].sum() / df["step_time_s"].sum(),
        "avg_samples_per_s": df["samples_per_s"].mean(),
        "peak_mem_mib": df["peak_mem_bytes"].max() / 2**20,
        "final_loss": df["loss"].iloc[-1],
        "mfu": df["mfu"].mean(),
    }
    if "comm_time_s" in df:
        row["comm_time_s"] = df["comm_time_s"].mean()
        row["compute_time_s"] = row["avg_step_time_s"] - row["comm_time_s"]
        row["comm_share"] = row["comm_time_s"] / row["avg_step_time_s"]
        row["comm_mib_per_step"] = df["comm_bytes"].mean() / 2**20
    return row


def scaling_summary(runs: Mapping[int, str | Path], skip_steps: int = 5) -> pd.DataFrame:
    """One row per world size; `runs` maps world size -> rank-0 step log. Needs world size 1."""
    if 1 not in runs:
        raise ValueError("scaling needs the 1-rank baseline (world size 1) among the runs")
    df = pd.DataFrame([run_summary(path, skip_steps) for _, path in sorted(runs.items())])
    base = float(df.loc[df.world_size == 1, "avg_tokens_per_s"].iloc[0])
    df["speedup"] = df["avg_tokens_per_s"] / base
    df["efficiency"] = df["speedup"] / df["world_size"]
    return df


def save_scaling(df: pd.DataFrame, figures_dir: str | Path, provenance: dict, prefix: str = "scaling") -> list[Path]:
    """figures/<prefix>_summary.csv, _summary.md, _plot.png and, with comm timing, _comm_compute.png."""
    import matplotlib.pyplot as plt

    figures_dir = Path(figures_dir)
    out = [save_table(df, figures_dir / f"{prefix}_summary.csv", provenance),
           save_table(df.round(4), figures_dir / f"{prefix}_summary.md", provenance)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    ax1.bar(df["world_size"].astype(str), df["avg_tokens_per_s"], color="C0")
    ax1.set_xlabel("world size (ranks)"); ax1.set_ylabel("tokens/s (all ranks)"); ax1.set_title("throughput")
    for x, (tps, sp) in enumerate(zip(df["avg_tokens_per_s"], df["speedup"])):
        ax1.text(x, tps, f"{sp:.2f}x", ha="center", va="bottom", fontsize=8)
    ax2.plot(df["world_size"], df["efficiency"], "o-", color="C1")
    ax2.axhline(1.0, color="0.6", ls="--", lw=1)
    ax2.set_ylim(0, 1.15); ax2.set_xticks(df["world_size"])
    ax2.set_xlabel("world size (ranks)"); ax2.set_ylabel("efficiency = speedup / k"); ax2.set_title("scaling efficiency")
    fig.tight_layout()
    out.append(save_figure(fig, figures_dir / f"{prefix}_plot.png", provenance))
    plt.close(fig)
    if "comm_time_s" in df:
        fig, ax = plt.subplots(figsize=(5.5, 3.2))
        labels = df["world_size"].astype(str)
        ax.bar(labels, df["compute_time_s"] * 1e3, label="compute")
        ax.bar(labels, df["comm_time_s"] * 1e3, bottom=df["compute_time_s"] * 1e3,
               label="gradient all-reduce (incl. waiting for the slower rank)")
        ax.set_xlabel("world size (ranks)"); ax.set_ylabel("ms per optimizer step")
        ax.set_title("where a step's time goes (measured)"); ax.legend(fontsize=7)
        fig.tight_layout()
        out.append(save_figure(fig, figures_dir / f"{prefix}_comm_compute.png", provenance))
        plt.close(fig)
    return out


def allreduce_cost(trainable_params: float, bytes_per_grad: float, world_size: int, gbit_per_s: float) -> float:
    """Seconds for one ring all-reduce of all gradients: 2(k-1)/k x bytes over the slowest link."""
    nbytes = trainable_params * bytes_per_grad
    return 2 * (world_size - 1) / world_size * nbytes / (gbit_per_s * 1e9 / 8)
