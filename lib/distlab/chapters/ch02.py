"""Chapter 02 (DDP): the data-parallel idea drawn, the all-reduce's limits the cost model needs, a traced DDP
step (buckets and their overlap with backward), where a step's time goes, and the fault demo's timeline. The
notebook runs its scripts under torchrun with distlab.launch.scripts, as every chapter does."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Mapping, Sequence

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.patches import FancyArrowPatch, Rectangle

from distlab.config import LORA_TARGETS
from distlab.generate import adapter_keyfact_accuracy
from distlab.launch.scripts import torchrun_module_or_script
from distlab.measure import limits, utilisation
from distlab.metrics import read_log
from distlab.planning.shapes import LLAMA2_7B, lora_parameter_count, parameter_count
from distlab.provenance import save_figure
from distlab.results import scaling_table
from distlab.workers.launcher import run_allreduce_bench

# ---------------------------------------------------------------- the idea, drawn


def draw_data_parallel(path: str | Path, provenance: dict, layers: int = 4, buckets: int = 2) -> Path:
    """Two replicas, the global batch split between them, and backward producing gradients from the last
    layer to the first while each full bucket is all-reduced (summed, then divided by 2) at once."""
    fig, (ax_who, ax_when) = plt.subplots(1, 2, figsize=(10.5, 3.8), gridspec_kw={"width_ratios": [1, 1.5]})
    ax_who.set(xlim=(0, 10), ylim=(0, 10), title="who holds what")
    ax_who.add_patch(Rectangle((0.5, 8.2), 9, 1.1, fc="0.9", ec="k"))
    for i in range(8):
        ax_who.add_patch(Rectangle((0.7 + i * 1.1, 8.35), 0.9, 0.8, fc="C0" if i < 4 else "C1", ec="k", lw=0.5))
    ax_who.text(5, 9.6, "global batch: 8 rows per optimizer step", ha="center", fontsize=8)
    for r, x in enumerate((0.5, 5.5)):
        color = f"C{r}"
        ax_who.add_patch(Rectangle((x, 1.0), 4, 5.6, fc="white", ec=color, lw=2))
        ax_who.text(x + 2, 6.1, f"rank {r}", ha="center", weight="bold", color=color)
        ax_who.text(x + 2, 5.2, "full model copy\n(same weights)", ha="center", va="top", fontsize=8)
        ax_who.text(x + 2, 3.4, f"rows {4 * r}-{4 * r + 3}\nforward, backward", ha="center", va="top", fontsize=8)
        ax_who.text(x + 2, 1.7, "same optimizer step", ha="center", fontsize=8)
        ax_who.add_patch(FancyArrowPatch((2.9 + 4.4 * r, 8.2), (x + 2, 6.7), arrowstyle="->", mutation_scale=10))
    ax_who.add_patch(FancyArrowPatch((4.5, 2.6), (5.5, 2.6), arrowstyle="<->", mutation_scale=12, color="C3"))
    ax_who.text(5, 0.3, "all-reduce: sum gradients, / 2", ha="center", fontsize=8, color="C3")
    ax_who.axis("off")

    per_bucket = layers // buckets
    ax_when.set(xlim=(0, layers + 2.2), ylim=(-0.3, 4.4), title="when: backward, bucket by bucket")
    for r, y in enumerate((3.2, 0.6)):
        ax_when.text(-0.05, y + 0.35, f"rank {r}", ha="right", va="center", color=f"C{r}", weight="bold")
        for i in range(layers):  # backward visits the last layer first
            ax_when.add_patch(Rectangle((i, y), 0.95, 0.7, fc=f"C{r}", alpha=0.35, ec="k"))
            ax_when.text(i + 0.47, y + 0.35, f"grad\nlayer {layers - i}", ha="center", va="center", fontsize=7)
    for b in range(buckets):
        start = (b + 1) * per_bucket  # the bucket is full when its last layer's gradient exists
        ax_when.add_patch(Rectangle((start, 1.75), 1.15, 0.9, fc="C3", alpha=0.25, ec="C3"))
        ax_when.text(start + 0.57, 2.2, f"all-reduce\nbucket {b}\n(layers {layers - b * per_bucket}-"
                     f"{layers - (b + 1) * per_bucket + 1})", ha="center", va="center", fontsize=7)
    ax_when.annotate("", (per_bucket + 0.05, 1.35), (per_bucket + 0.05, 3.2),
                     arrowprops=dict(arrowstyle="<->", color="C3"))
    ax_when.text((layers + 2.2) / 2, -0.05, "bucket 0 is all-reduced while layers "
                 f"{layers - per_bucket}-1 still compute", ha="center", fontsize=8)
    ax_when.set_xlabel("time during backward")
    ax_when.set_yticks([])
    ax_when.set_xticks([])
    fig.tight_layout()
    out = save_figure(fig, path, provenance)
    plt.close(fig)
    return out


# ---------------------------------------------------------------- the all-reduce's limits


def allreduce_limits(figures_dir: str | Path, nproc: int, device: str, timeout_s: float) -> pd.DataFrame:
    """The all-reduce latency and bus bandwidth the cost model needs: chapter 00's measurement of this machine
    when it was run (its device_limits.csv in `figures_dir`), otherwise measured now at chapter 00's two extreme
    sizes (a latency-bound 4 KiB and a bandwidth-bound 16 MiB message), said so."""
    if limits.limits_path(figures_dir).exists():
        return limits.load_device_limits(figures_dir)
    print(f"{limits.limits_path(figures_dir)} is missing (chapter 00 not run here): measuring the all-reduce now")
    sweep = run_allreduce_bench(nproc=nproc, sizes_kib=[4, 16384], timeout_s=timeout_s, device=device, echo=False)
    return pd.DataFrame(limits.allreduce_rows(sweep), columns=limits.COLUMNS)


# ---------------------------------------------------------------- one DDP step, traced


def trace_ddp_step(out_dir: str | Path, bucket_cap_mb: float = 1.0, nproc: int = 2, timeout_s: int = 300) -> list[dict]:
    """Run distlab.measure.ddp_trace on `nproc` ranks; one dict per rank (spans, buckets)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torchrun_module_or_script("distlab.measure.ddp_trace", nproc, [str(out_dir), "--bucket-cap-mb", str(bucket_cap_mb)],
                              timeout_s=timeout_s, module=True)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def backward_compute_end(trace: dict) -> float:
    """When the last gradient was computed (ms): the end of the backward pass's last autograd op, before
    DDP's end-of-backward wait for the outstanding all-reduces."""
    return max(s["end_ms"] for s in trace["spans"] if s["kind"] == "backward op")


def overlap_table(traces: Sequence[dict]) -> pd.DataFrame:
    """Per rank: backward's span, the all-reduces, and how many of them started before the last gradient
    was computed (those overlapped backward)."""
    rows = []
    for t in traces:
        spans = t["spans"]
        back = next(s for s in spans if s["kind"] == "phase" and s["name"] == "backward")
        reduces = [s for s in spans if s["kind"] == "all-reduce"]
        done = backward_compute_end(t)
        rows.append({"rank": t["rank"], "backward_start_ms": back["start_ms"], "last_gradient_ms": done,
                     "backward_end_ms": back["end_ms"], "all_reduces": len(reduces),
                     "first_all_reduce_ms": min(s["start_ms"] for s in reduces),
                     "started_before_last_gradient": sum(s["start_ms"] < done for s in reduces),
                     "all_reduce_threads": len({s["thread"] for s in reduces})})
    return pd.DataFrame(rows).set_index("rank")


def bucket_table(trace: dict) -> pd.DataFrame:
    """DDP's buckets in the order they were all-reduced: their size and first/last parameter."""
    rows = [{"bucket": b["index"], "parameters": len(b["params"]), "MiB": b["bytes"] / 2**20,
             "first parameter": b["params"][0], "last parameter": b["params"][-1]} for b in trace["buckets"]]
    return pd.DataFrame(rows).set_index("bucket")


def plot_ddp_trace(traces: Sequence[dict], path: str | Path, provenance: dict) -> Path:
    """Per rank, one lane of backward ops on the training thread and one of gloo all-reduces on gloo's
    thread, with the forward / backward / optimizer phases shaded: all-reduces drawn over backward overlap."""
    fig, ax = plt.subplots(figsize=(9, 1.2 + 1.3 * len(traces)))
    phase_colors = {"forward": "0.85", "backward": "C0", "optimizer step": "C2"}
    yticks, ylabels = [], []
    end = max(s["end_ms"] for t in traces for s in t["spans"])
    for i, t in enumerate(traces):
        base = (len(traces) - 1 - i) * 3.0
        bucket = 0
        for s in t["spans"]:
            width = s["end_ms"] - s["start_ms"]
            if s["kind"] == "phase":
                ax.add_patch(Rectangle((s["start_ms"], base - 0.2), width, 2.3, fc=phase_colors[s["name"]],
                                       alpha=0.18, ec="none"))
            elif s["kind"] == "backward op":
                ax.broken_barh([(s["start_ms"], width)], (base + 1.1, 0.8), fc="C0", ec="none")
            elif s["kind"] == "all-reduce":
                ax.broken_barh([(s["start_ms"], width)], (base, 0.8), fc="C3", ec="k", lw=0.4, alpha=0.8)
                if width > 0.025 * end:  # the bucket's number where it fits (gloo runs them in bucket order)
                    ax.text(s["start_ms"] + width / 2, base + 0.4, str(bucket), ha="center", va="center",
                            fontsize=7, color="white")
                bucket += 1
        done = backward_compute_end(t)
        ax.plot([done, done], [base - 0.2, base + 2.1], color="k", ls=":", lw=1)
        yticks += [base + 0.4, base + 1.5]
        ylabels += [f"rank {t['rank']}: all-reduce\n(gloo thread)",
                    f"rank {t['rank']}: backward ops\n(training thread)"]
    for name, color in phase_colors.items():
        ax.add_patch(Rectangle((0, 0), 0, 0, fc=color, alpha=0.3, label=f"{name} (shaded)"))
    ax.plot([], [], "k:", label="last gradient computed")
    ax.broken_barh([], (0, 0), fc="C3", label="one bucket's all-reduce\n(its number where it fits)")
    ax.set(xlim=(0, end * 1.02), ylim=(-0.5, 3.0 * len(traces) - 0.5), xlabel="ms since the step started",
           title=f"one DDP step on {len(traces)} ranks, traced: bucket all-reduces run during backward")
    ax.set_yticks(yticks, ylabels, fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    out = save_figure(fig, path, provenance)
    plt.close(fig)
    return out


# ---------------------------------------------------------------- where a step's time goes


def step_split(breakdown: Mapping[int, object]) -> dict[str, dict[str, float]]:
    """{"k rank(s)": compute / wait / transfer seconds per step} from the runs timed with the comm hook
    (`breakdown`: world size -> job), for plot_step_split."""
    out = {}
    for k, job in sorted(breakdown.items()):
        c = scaling_table.comm_split(job.log)
        step = scaling_table.run_summary(job.log)["step_time_s"]
        out[f"{k} rank(s)"] = {"compute_s": step - c["comm_time_s"], "comm_wait_s": c["comm_wait_s"],
                               "comm_transfer_s": c["comm_transfer_s"]}
    return out


def plot_step_split(rows: Mapping[str, Mapping[str, float]], path: str | Path, provenance: dict,
                    title: str = "where a step's time goes (separate runs, timing hook on)") -> Path:
    """Stacked bars, one per run ({label: {"compute_s", "comm_wait_s", "comm_transfer_s"}}), in ms, every
    segment labelled with its value (inside when it is tall enough to hold the text, beside the bar if not)."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    labels = list(rows)
    parts = (("compute_s", "compute", "C0"), ("comm_wait_s", "all-reduce: waiting for the slower rank", "C1"),
             ("comm_transfer_s", "all-reduce: the transfer itself", "C2"))
    totals = [sum(rows[label].get(key, 0.0) for key, _, _ in parts) * 1e3 for label in labels]
    tallest = max(totals)
    bottom = [0.0] * len(labels)
    slivers: list[list[tuple[str, str]]] = [[] for _ in labels]  # (text, color) of segments too thin to label
    for key, name, color in parts:
        values = [rows[label].get(key, 0.0) * 1e3 for label in labels]
        ax.bar(range(len(labels)), values, bottom=bottom, label=name, color=color, width=0.5)
        for x, (v, b) in enumerate(zip(values, bottom)):
            if v >= 0.06 * tallest:
                ax.text(x, b + v / 2, f"{v:.1f} ms", ha="center", va="center", fontsize=8, color="white")
            elif v > 0:
                slivers[x].append((f"{name.split(': ')[-1]}: {v:.2f} ms", color))
        bottom = [b + v for b, v in zip(bottom, values)]
    for x, texts in enumerate(slivers):  # listed beside the bar, top down, one line each
        for j, (text, color) in enumerate(reversed(texts)):
            ax.text(x + 0.3, totals[x] + (0.03 - j * 0.07) * tallest, text, ha="left", va="center", fontsize=7,
                    color=color)
    ax.set_xticks(range(len(labels)), labels)
    ax.set(ylabel="ms per optimizer step (slowest rank)", title=title, ylim=(0, tallest * 1.1),
           xlim=(-0.5, len(labels) - 0.5 + 0.9))
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    fig.tight_layout()
    out = save_figure(fig, path, provenance)
    plt.close(fig)
    return out


# ---------------------------------------------------------------- the fault demo's timeline

WRAPPER_MAX_MIB = 30.0  # bash and `timeout` only wait for their child; every Python process is far larger


def line_times(lines: Sequence[tuple[float, str]], *markers: str) -> dict[str, float | None]:
    """For each marker, the wall-clock time of the first output line containing it (None if none did)."""
    return {m: next((t for t, line in lines if m in line), None) for m in markers}


def plot_fault_timeline(csv_path: str | Path, out_png: str | Path, provenance: dict, t0: float,
                        events: Mapping[str, float | None], title: str):
    """CPU % and RSS of the killed run's Python processes (ranks, torchrun's agent) from the utilisation
    sampler's CSV; the shell wrappers (bash, `timeout`, under WRAPPER_MAX_MIB) are left out. `events`
    ({label: wall-clock time}, `t0` the sampler's start) are drawn as vertical lines."""
    marks = [(when - t0, name) for name, when in events.items() if when is not None]
    return utilisation.plot_utilization(csv_path, out_png, provenance, title, events=marks, min_mib=WRAPPER_MAX_MIB)


class LineClock:
    """An `echo` callable for distlab.launch: keeps every output line with the wall-clock time it arrived."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []

    def __call__(self, line: str) -> None:
        self.lines.append((time.time(), line))


# ---------------------------------------------------------------- tables the notebook asserts on


def efficiency_table(scaling: pd.DataFrame) -> pd.DataFrame:
    """Speedup and efficiency per world size, with the spread that pairing the rounds gives."""
    cols = ["rounds", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "speedup", "scaling_efficiency",
            "scaling_efficiency_min", "scaling_efficiency_max", "step_time_s"]
    return scaling.set_index("world_size")[cols]


def breakdown_table(split: Mapping[str, Mapping[str, float]], breakdown: Mapping[int, object],
                    scaling: pd.DataFrame) -> pd.DataFrame:
    """Per world size: the hook-on run's compute / wait / transfer (ms per step), its tokens/s, and the
    hook-off median tokens/s, so that the instrument's own cost shows."""
    off = scaling.set_index("world_size")["tokens_per_s"]
    rows = []
    for k, job in sorted(breakdown.items()):
        s = split[f"{k} rank(s)"]
        rows.append({"world_size": k, "compute_ms": s["compute_s"] * 1e3, "wait_ms": s["comm_wait_s"] * 1e3,
                     "transfer_ms": s["comm_transfer_s"] * 1e3,
                     "tokens_per_s_hook_on": scaling_table.run_summary(job.log)["tokens_per_s"],
                     "tokens_per_s_hook_off": float(off.loc[k])})
    return pd.DataFrame(rows).set_index("world_size")


def plot_loss_by_world_size(logs: Mapping[int, str | Path], path: str | Path, provenance: dict,
                            global_batch_size: int) -> pd.Series:
    """Two loss curves (the first two world sizes) and their relative difference per step, drawn;
    returns the relative difference."""
    (k1, log1), (k2, log2) = list(logs.items())[:2]
    a = pd.DataFrame(read_log(log1)).set_index("step")["loss"]
    b = pd.DataFrame(read_log(log2)).set_index("step")["loss"]
    rel = (b - a).abs() / a.abs()
    fig, (ax, axd) = plt.subplots(2, 1, figsize=(6.5, 4.2), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    ax.plot(a.index, a, "o-", ms=5, lw=2.5, alpha=0.5, label=f"{k1} rank")
    ax.plot(b.index, b, "x--", ms=6, lw=1, color="k", label=f"{k2} ranks")
    ax.set_ylabel("training loss")
    ax.legend()
    ax.set_title(f"same global batch ({global_batch_size} rows), same data order: the curves coincide")
    axd.plot(rel.index, rel.clip(lower=1e-12), "o-", ms=3, color="C3")
    axd.set(yscale="log", ylabel="relative\ndifference", xlabel="optimizer step")
    axd.set_xticks(list(a.index))
    fig.tight_layout()
    save_figure(fig, path, provenance)
    plt.close(fig)
    return rel


def allreduce_cost_table(model, lora_rank: int = 16) -> pd.DataFrame:
    """Bytes and ring all-reduce time of one step's fp32 gradients at 1, 10 and 100 Gbit/s on 2 ranks:
    LoRA and full fine-tuning, of `model` (a transformers model) and of Llama-2-7B."""
    llama = LLAMA2_7B
    cases = {"LoRA, this model": lora_parameter_count(model.config, lora_rank, LORA_TARGETS),
             "full, this model": sum(p.numel() for p in model.parameters()),
             f"LoRA r{lora_rank} (7 proj), Llama-2-7B": lora_parameter_count(llama, lora_rank, LORA_TARGETS),
             "full, Llama-2-7B": parameter_count(llama)}
    rows = []
    for name, n in cases.items():
        row = {"gradients": name, "trainable_params": int(n), "MiB_per_step_fp32": n * 4 / 2**20}
        for gbit in (1, 10, 100):
            row[f"ms_at_{gbit}_Gbit_2_ranks"] = scaling_table.allreduce_cost(n, 4, 2, gbit) * 1e3
        rows.append(row)
    return pd.DataFrame(rows).set_index("gradients")


def cost_model_table(job, world_size: int, latency_s: float, busbw_bytes_per_s: float) -> pd.DataFrame:
    """The hook-on run's calls, bytes, transfer and wait per step against the latency-bandwidth model."""
    c = scaling_table.comm_split(job.log)
    m = scaling_table.allreduce_model(c["comm_calls"], c["comm_bytes"], world_size, latency_s, busbw_bytes_per_s)
    return pd.Series({
        "all-reduce calls per step (measured)": c["comm_calls"],
        "MiB all-reduced per step (measured)": c["comm_bytes"] / 2**20,
        "bandwidth term: 2(k-1)/k x bytes / busbw (ms)": m["bandwidth_term_s"] * 1e3,
        "latency term: calls x small all-reduce latency (ms)": m["latency_term_s"] * 1e3,
        "latency-bandwidth model (ms)": m["predicted_s"] * 1e3,
        "measured transfer (ms)": c["comm_transfer_s"] * 1e3,
        "measured wait for the slower rank (ms)": c["comm_wait_s"] * 1e3,
    }, name="value").to_frame()


def adapter_accuracy(job, model, keyfact_rows) -> dict:
    """Score a DDP run's saved adapter as chapter 01 scores its own: {"summary": Series, "answers": DataFrame
    (the first two held-out answers and the facts they miss)}."""
    learned = adapter_keyfact_accuracy(job.output_dir / "model", model=model, max_new_tokens=160, limit=keyfact_rows)
    summary = pd.Series({"seconds": round(job.result.elapsed_s),
                         "final training loss": scaling_table.run_summary(job.log)["final_loss"],
                         "held-out answers": len(learned["rows"]), "facts asked": learned["asked"],
                         "facts found": learned["found"], "key-fact accuracy": learned["accuracy"]})
    return {"summary": summary, "answers": pd.DataFrame(learned["answers"][:2])[["prompt", "answer", "missing"]]}
