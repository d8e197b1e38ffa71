"""Step logs -> chapter 02's scaling table and plots (the enterprise LoRA demo's parse_logs, as a library).

Every number is a column of distlab.results.schema: steady state after schema.WARMUP_STEPS, the slowest
rank's step time, tokens/s of real tokens, speedup(k) = tokens/s(k) / tokens/s(1) and
scaling_efficiency(k) = speedup(k) / k.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Mapping, Sequence

import matplotlib.pyplot as plt
import pandas as pd

from distlab.metrics import read_log
from distlab.provenance import save_figure, save_table
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


def scaling_over_rounds(runs: Mapping[int, Sequence[str | Path]]) -> pd.DataFrame:
    """One row per world size from several rounds of each (`runs`: world size -> rank-0 step logs, one per
    round): the round with the median tokens/s stands for the world size (its step and communication
    times too), `tokens_per_s_min`/`_max` give the spread, and speedup and efficiency compare medians."""
    if 1 not in runs:
        raise ValueError("scaling needs the 1-rank baseline (world size 1) among the runs")
    rows = []
    for k, logs in sorted(runs.items()):
        summaries = sorted((run_summary(log) for log in logs), key=lambda row: row["tokens_per_s"])
        middle = dict(summaries[(len(summaries) - 1) // 2])  # the lower median: a round that really ran
        middle["tokens_per_s"] = statistics.median(row["tokens_per_s"] for row in summaries)
        middle.update(rounds=len(summaries), tokens_per_s_min=summaries[0]["tokens_per_s"],
                      tokens_per_s_max=summaries[-1]["tokens_per_s"])
        rows.append(middle)
    rows = schema.add_scaling(rows)
    one = rows[0]
    for row in rows:  # the efficiency each pairing of rounds could give: the spread of the ratio
        k = int(row["world_size"])
        row["scaling_efficiency_min"] = row["tokens_per_s_min"] / (k * one["tokens_per_s_max"])
        row["scaling_efficiency_max"] = row["tokens_per_s_max"] / (k * one["tokens_per_s_min"])
    extra = ["rounds", "tokens_per_s_min", "tokens_per_s_max", "scaling_efficiency_min", "scaling_efficiency_max"]
    return pd.DataFrame(rows)[SCALING_COLUMNS[:4] + extra[:3] + SCALING_COLUMNS[4:6] + extra[3:] + SCALING_COLUMNS[6:]]


def scaling_lines(table: pd.DataFrame, name_of=lambda k: f"world_size {k}") -> list[str]:
    """What a scaling benchmark prints from `scaling_over_rounds`: each world size's median tokens/s with the
    spread over rounds, then the 2-rank speedup and efficiency with the spread over pairings of rounds."""
    lines = [f"{name_of(int(row['world_size']))}: median tokens_per_s {row['tokens_per_s']:.0f} "
             f"(rounds {row['tokens_per_s_min']:.0f}-{row['tokens_per_s_max']:.0f})"
             for row in table.to_dict("records")]
    two = table.set_index("world_size").loc[2]
    lines.append(f"speedup {two['speedup']:.2f}, scaling_efficiency {two['scaling_efficiency']:.2f} "
                 f"(pairings of rounds: {two['scaling_efficiency_min']:.2f}-{two['scaling_efficiency_max']:.2f}; "
                 f"warm-up: first {schema.WARMUP_STEPS} steps left out)")
    return lines


def comm_split(log_path: str | Path) -> dict[str, float]:
    """What a run's DDP comm hook measured per step (mean over ranks and steady steps): all-reduce calls,
    bytes, the wait for the slowest rank and the transfer itself (distlab.measure.comm.CommTimer)."""
    logs = schema.rank_log_paths(log_path)
    keys = ("comm_calls", "comm_bytes", "comm_wait_s", "comm_transfer_s", "comm_time_s")
    values: dict[str, list[float]] = {k: [] for k in keys}
    for path in logs:
        for step in schema.steady(read_log(path)):
            if "comm_wait_s" not in step:
                raise ValueError(f"{path}: step {step['step']} has no comm_wait_s (run with measure_comm on DDP)")
            for k in keys:
                values[k].append(float(step[k]))
    return {k: sum(v) / len(v) for k, v in values.items()}


def allreduce_model(calls: float, nbytes: float, world_size: int, latency_s: float, busbw_bytes_per_s: float
                    ) -> dict[str, float]:
    """Latency-bandwidth model of one step's gradient all-reduces: every call pays a fixed latency
    (chapter 00's small-message all-reduce), and the bytes move at the bus bandwidth (its large-message
    one): calls x latency + 2(k-1)/k x bytes / busbw. Returns both terms and their sum, in seconds."""
    latency = calls * latency_s
    bandwidth = 2 * (world_size - 1) / world_size * nbytes / busbw_bytes_per_s
    return {"latency_term_s": latency, "bandwidth_term_s": bandwidth, "predicted_s": latency + bandwidth}


def save_scaling(df: pd.DataFrame, figures_dir: str | Path, provenance: dict, prefix: str = "scaling") -> list[Path]:
    """figures/<prefix>_summary.csv, _summary.md, _plot.png and, with comm timing, _comm_compute.png."""
    figures_dir = Path(figures_dir)
    out = [save_table(df, figures_dir / f"{prefix}_summary.csv", provenance),
           save_table(df.round(4), figures_dir / f"{prefix}_summary.md", provenance)]
    spread = "tokens_per_s_min" in df
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    yerr = ([df["tokens_per_s"] - df["tokens_per_s_min"], df["tokens_per_s_max"] - df["tokens_per_s"]]
            if spread else None)
    ax1.bar(df["world_size"].astype(str), df["tokens_per_s"], color="C0", yerr=yerr, capsize=4)
    top = df["tokens_per_s_max"] if spread else df["tokens_per_s"]
    ax1.set(xlabel="world size (ranks)", ylabel="tokens/s (all ranks)", ylim=(0, float(top.max()) * 1.18),
            title="throughput" + (f" (median of {int(df['rounds'].min())} rounds, min-max)" if spread else ""))
    for x, (tps, sp) in enumerate(zip(top, df["speedup"])):  # above the error bar's cap, not on it
        ax1.text(x, tps + 0.03 * float(top.max()), f"{sp:.2f}x", ha="center", va="bottom", fontsize=8)
    eff_err = ([df["scaling_efficiency"] - df["scaling_efficiency_min"],
                df["scaling_efficiency_max"] - df["scaling_efficiency"]] if spread else None)
    ax2.errorbar(df["world_size"], df["scaling_efficiency"], yerr=eff_err, fmt="o-", color="C1", capsize=4)
    ax2.axhline(1.0, color="0.6", ls="--", lw=1)
    ax2.set_xticks(df["world_size"])
    eff_top = max(1.25, float(df["scaling_efficiency_max"].max()) * 1.08) if spread else 1.25  # no bar clipped
    ax2.set(ylim=(0, eff_top), xlabel="world size (ranks)", ylabel="efficiency = speedup / k",
            title="scaling efficiency")
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

