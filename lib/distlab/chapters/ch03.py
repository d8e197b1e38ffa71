"""Chapter 03 (FSDP and ZeRO): who holds what under each strategy, drawn; the by-hand scripts' results as
tables; each rank's measured state bytes stacked per strategy against the planner; communication per step
from the formulas against the measured collectives; the loss curves compared; the planner's answers for the
LAN cluster's cards, as a table and as a figure; FSDP's communication against compute in a profiler trace."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.patches import Rectangle

from distlab.config import LORA_TARGETS, STRATEGY_NAMES
from distlab.launch.scripts import torchrun_module_or_script
from distlab.planning.advice import recommend
from distlab.planning.cards import LAN_CLUSTER
from distlab.planning.load import plan_load
from distlab.planning.memory import GIB, breakdown_table
from distlab.planning.plan import DTYPE_BYTES, plan_memory
from distlab.planning.shapes import parameter_layout
from distlab.provenance import save_figure
from distlab.results.schema import MemoryBreakdown

# ---------------------------------------------------------------- the idea, drawn

# (strategy, does a rank keep only 1/k of: parameters, gradients, optimizer state; the collectives per step)
STAGES = [("DDP", (False, False, False), "all-reduce gradients"),
          ("ZeRO-1", (False, False, True), "reduce-scatter gradients,\nall-gather parameters"),
          ("ZeRO-2", (False, True, True), "reduce-scatter gradients,\nall-gather parameters"),
          ("ZeRO-3 / FSDP", (True, True, True), "all-gather parameters (forward\nand backward), reduce-scatter grads")]
PARTS = [("parameters", 1.0, "C0"), ("gradients", 1.0, "C1"), ("optimizer state\n(AdamW: 2 moments)", 2.0, "C2")]


def draw_who_holds_what(path, provenance: dict, k: int = 2):
    """Four panels (DDP, ZeRO-1, ZeRO-2, ZeRO-3/FSDP); in each, every rank's parameters, gradients and
    AdamW state as bars of their fp32 size (Psi parameters: 4, 4 and 8 Ψ bytes): filled where the rank
    holds it, outlined where another rank does; the per-rank total and the collectives below."""
    fig, axes = plt.subplots(1, len(STAGES), figsize=(12, 3.9), sharey=True)
    for ax, (name, sharded, comm) in zip(axes, STAGES):
        total = 0.0
        for r in range(k):
            y0 = (k - 1 - r) * (len(PARTS) + 1.2)
            ax.text(-0.1, y0 + len(PARTS) - 0.4, f"rank {r}", ha="left", fontsize=8, weight="bold")
            for j, ((label, size, color), cut) in enumerate(zip(PARTS, sharded)):
                y = y0 + len(PARTS) - 1.5 - j
                ax.add_patch(Rectangle((0, y), size, 0.7, fc="none", ec=color, ls="--", lw=0.8))
                start, width = (r * size / k, size / k) if cut else (0, size)
                ax.add_patch(Rectangle((start, y), width, 0.7, fc=color, ec=color, alpha=0.8))
                if r == 0:
                    total += 4 * width
                    if name == STAGES[0][0]:
                        ax.text(size + 0.05, y + 0.35, label, va="center", fontsize=7)
        ax.set_title(f"{name}\nper rank: {total:g} Ψ bytes", fontsize=9)
        ax.text(1.0, -0.9, comm, ha="center", va="top", fontsize=7.5)
        ax.set(xlim=(-0.15, 2.2), ylim=(-2.2, k * (len(PARTS) + 1.2) - 0.5))
        ax.axis("off")
    fig.suptitle(f"who holds what on {k} ranks (fp32, Ψ parameters, all trained): filled = this rank holds it, "
                 "dashed = another rank does", fontsize=9)
    fig.tight_layout()
    out = save_figure(fig, path, provenance)
    plt.close(fig)
    return out


# ---------------------------------------------------------------- the by-hand scripts

def hand_zero_table(per_rank: Sequence[Mapping[str, Mapping[str, float]]]) -> pd.DataFrame:
    """The ZeRO script's numbers, one row per (strategy, rank): what the rank kept, what it sent per step,
    and how far its weights are from DDP's."""
    rows = [{"strategy": s, "rank": r, **{key: v for key, v in rec.items()}}
            for r, out in enumerate(per_rank) for s, rec in out.items()]
    table = pd.DataFrame(rows).set_index(["strategy", "rank"])
    for col in ("moments_bytes", "grad_bytes_after_sync", "sent_bytes_per_step"):
        table[col.replace("bytes", "MiB")] = table.pop(col) / 2**20
    return table


# ---------------------------------------------------------------- per-rank state, measured and planned

SHOWN_PARTS = [("weights", "weights", "C0"), ("adapter_weights", "LoRA adapters", "C4"),
               ("gradients", "gradients", "C1"), ("optimizer_state", "optimizer state", "C2"),
               ("buffers", "buffers", "C7")]


def plot_state_per_rank(state: pd.DataFrame, path, provenance: dict, rank: int = 0):
    """One panel per training mode: rank `rank`'s measured bytes per component stacked per strategy, the
    planner's total beside each bar (a black tick) and DDP's total / k (dotted), in MiB."""
    modes = list(dict.fromkeys(state["mode"]))
    fig, axes = plt.subplots(1, len(modes), figsize=(5.2 * len(modes), 3.8), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        sub = state[(state["mode"] == mode) & (state["rank"] == rank)]
        order = [s for s in ("ddp", "zero2", "fsdp", "zero3") if s in set(sub["strategy"])]
        measured = sub.pivot_table(index="strategy", columns="component", values="measured_mib").reindex(order)
        planned = sub.groupby("strategy")["planned_mib"].sum().reindex(order)
        bottom = np.zeros(len(order))
        for key, label, color in SHOWN_PARTS:
            values = measured.get(key, pd.Series(0.0, index=order)).to_numpy()
            if values.any():
                ax.bar(range(len(order)), values, 0.55, bottom=bottom, color=color, label=label)
            bottom += values
        ax.plot(range(len(order)), planned, "k_", ms=30, mew=2, label="planner's total")
        k = int(sub["world_size"].iloc[0])
        ax.axhline(bottom[0] / k, color="0.3", ls=":", lw=1.2, label=f"DDP's total / {k}")
        for x, v in enumerate(bottom):
            ax.text(x, v + 0.03 * bottom.max(), f"{v:.1f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(order)), order)
        ax.set(ylabel=f"MiB held by rank {rank} (measured)", title=f"{mode}: model state per rank, {k} ranks",
               ylim=(0, bottom.max() * 1.15))
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, frameon=False, markerscale=0.5)
    fig.tight_layout()
    out = save_figure(fig, path, provenance)
    plt.close(fig)
    return out


def state_totals(state: pd.DataFrame, rank: int = 0) -> pd.DataFrame:
    """Rank `rank`'s measured and planned state (MiB) per mode and strategy, and each as a fraction of DDP's."""
    sub = state[state["rank"] == rank]
    table = sub.groupby(["mode", "strategy"])[["measured_mib", "planned_mib"]].sum()
    ddp = table.xs("ddp", level="strategy")["measured_mib"]
    table["measured / ddp"] = [row.measured_mib / ddp[mode] for (mode, _), row in table.iterrows()]
    return table


# ---------------------------------------------------------------- communication per step

def comm_table(runs: Mapping[str, Mapping[int, Mapping]], config, accumulation: int, weight_bytes: int = 4,
               grad_bytes: int = 4) -> pd.DataFrame:
    """Per run: the collectives' buffer bytes per optimizer step, measured (rank 0's median over the steady
    steps, each collective counted by its largest tensor) against the formula for that strategy with
    `accumulation` micro-steps, and what each rank then sends on a ring."""
    rows = []
    for name, results in runs.items():
        rec = results[0]
        k, strategy = rec["world_size"], rec["strategy"]
        layout = parameter_layout(config, rec.get("lora_r") if rec["mode"] == "lora" else None, None)
        trained = sum(p.numel for p in layout if p.trainable)
        every = sum(p.numel for p in layout)
        root = config.vocab_size * config.hidden_size + config.hidden_size  # embedding (tied head) + final norm
        grads, gathers = trained * grad_bytes, 0.0
        if strategy == "zero2":  # DeepSpeed reduces at every micro-step, then gathers the updated weights
            grads, gathers = accumulation * trained * grad_bytes, trained * weight_bytes
        elif strategy == "fsdp":  # every layer gathered twice per micro-step; the root once (kept for backward)
            gathers = accumulation * (2 * every - root) * weight_bytes
        measured = float(np.median(rec["comm_bytes"][2:]))
        sent = ((2 if strategy == "ddp" else 1) * grads + gathers) * (k - 1) / k  # ring: (k-1)/k per pass
        rows.append({"run": name, "strategy": strategy, "gradient buffers MiB (formula)": grads / 2**20,
                     "parameter gathers MiB (formula)": gathers / 2**20,
                     "formula MiB": (grads + gathers) / 2**20, "measured MiB": measured / 2**20,
                     "sent per rank MiB (ring)": sent / 2**20})
    table = pd.DataFrame(rows).set_index("run")
    table["measured / formula"] = table["measured MiB"] / table["formula MiB"]
    return table


# ---------------------------------------------------------------- the loss curves compared

STYLES = {"single": ("o-", 3, 8), "ddp": ("x--", 1, 7), "fsdp": ("s:", 1, 6), "zero2": ("^-.", 1, 6),
          "zero3": ("v:", 1, 6)}


def plot_loss_by_strategy(curves: pd.DataFrame, modes: Sequence[str], path, provenance: dict, tolerance: float,
                          global_batch_size: int):
    """Per mode: every strategy's loss curve, and below, its relative difference from DDP's (log scale)."""
    fig, axes = plt.subplots(2, len(modes), figsize=(5 * len(modes), 5), squeeze=False, sharex=True,
                             gridspec_kw={"height_ratios": [2, 1]})
    colors = {s: f"C{i}" for i, s in enumerate(STYLES)}
    for ax, axd, mode in zip(axes[0], axes[1], modes):
        names = [n for n in curves if f"_{mode}" in n]
        ref = next(n for n in names if n.startswith("03_ddp_"))
        for name in names:
            strategy = name.split("_")[1]
            style, lw, ms = STYLES.get(strategy, (".-", 1, 5))
            hollow = "none" if style[0] in "s^v" else None
            ax.plot(curves.index, curves[name], style, lw=lw, ms=ms, alpha=0.45 if lw > 1 else 1,
                    color=colors.get(strategy), mfc=hollow, label=name.replace("03_", ""))
            if name != ref:
                diff = (curves[name] - curves[ref]).abs() / curves[ref].abs()
                axd.plot(curves.index, diff.clip(lower=1e-12), style, ms=4, mfc=hollow, color=colors.get(strategy))
        ax.set_title(f"{mode}: same data order, global batch {global_batch_size}", fontsize=9)
        ax.set_ylabel("training loss")
        ax.legend(fontsize=7)
        axd.set(yscale="log", ylim=(5e-13, tolerance * 30), xlabel="optimizer step")
        axd.set_ylabel("relative difference\nfrom DDP (0 drawn at 1e-12)", fontsize=7)
        axd.set_xticks(list(curves.index))
        axd.axhline(tolerance, color="0.5", ls="--", lw=1)
        axd.text(curves.index[0], tolerance, f" tolerance {tolerance:g}", fontsize=7, va="bottom", color="0.3")
    fig.tight_layout()
    out = save_figure(fig, path, provenance)
    plt.close(fig)
    return out


# ---------------------------------------------------------------- the LAN cluster's cards

RESERVE_GIB = inspect.signature(recommend).parameters["reserve_gib"].default  # the recommender's reserve
SETUPS = (("LoRA, bf16 weights", dict(lora_r=16, weight_bytes=2)),
          ("LoRA, 8-bit weights", dict(lora_r=16, weight_bytes=1)),
          ("LoRA, 4-bit weights", dict(lora_r=16, weight_bytes=0.5)), ("full, bf16", dict(lora_r=None, weight_bytes=2)))


def fit_table(models: Mapping[str, object], cards: Sequence[Mapping], world_size: int = 3) -> pd.DataFrame:
    """Planned GiB per GPU for each model, setup and strategy on `world_size` ranks (bf16 activations,
    checkpointing, 1 x 2048 tokens), in a step and while the model loads (distlab.planning.load), and which
    cards the larger of the two fits after the recommender's reserve. Quantised base weights run DDP (one
    replica per GPU, as QLoRA); a 4-bit base also FSDP (FSDP + QLoRA)."""
    targets = {"Llama-2-7B": ["q_proj", "v_proj"]}  # the guide's LoRA targets for Llama; all projections otherwise
    rows = []
    for name, shape in models.items():
        for setup, kw in SETUPS:
            for s in ("ddp", "zero2", "fsdp", "zero3"):
                if kw["weight_bytes"] < 2 and s not in ("ddp", "fsdp" if kw["weight_bytes"] == 0.5 else "ddp"):
                    continue
                run = dict(strategy=s, world_size=world_size, micro_batch=1, seq_len=2048, activation_bytes=2,
                           activation_checkpointing=True, lora_targets=targets.get(name), **kw)
                step, load = plan_memory(shape, **run), plan_load(shape, **run)
                peak = max(step.total, load.device) / GIB
                fits = [c["name"] for c in cards if peak <= c["memory_gib"] - RESERVE_GIB]
                rows.append({"model": name, "setup": setup, "strategy": s, "planned_gib": step.total / GIB,
                             "load_gib": load.device / GIB, "peak_gib": peak,
                             "fits": "every card" if len(fits) == len(cards) else ", ".join(fits) or "no card"})
    return pd.DataFrame(rows)


def fit_grid(fit: pd.DataFrame) -> pd.DataFrame:
    """fit_table as a grid: (model, setup) x strategy, each cell 'GiB: cards' (the step's GiB, and the load's
    where loading needs more)."""
    shown = fit.assign(cell=[f"{g:.1f} GiB" + (f", load {ld:.1f}" if ld > g else "") + f": {f}"
                             for g, ld, f in zip(fit.planned_gib, fit.load_gib, fit.fits)])
    return (shown.pivot_table(index=["model", "setup"], columns="strategy", values="cell", aggfunc="first", sort=False)
            .reindex(columns=["ddp", "zero2", "fsdp", "zero3"]).fillna("-"))


def plot_breakdowns(rows: Mapping[str, MemoryBreakdown], capacities: Mapping[str, float] | None = None,
                    title: str = "", unit: float = GIB, unit_name: str = "GiB", ax=None):
    """Stacked horizontal bars, one per breakdown (e.g. per strategy), with dashed lines at usable
    capacities (label -> GiB). Returns the figure."""
    table = breakdown_table(dict(rows), unit=unit, unit_name=unit_name).T.drop(columns="total")
    if ax is None:
        fig, ax = plt.subplots(figsize=(7.5, 0.5 + 0.45 * len(table)))
    else:
        fig = ax.figure
    table.plot.barh(stacked=True, ax=ax, width=0.7)
    ax.invert_yaxis()
    for i, (name, gib) in enumerate((capacities or {}).items()):
        ax.axvline(gib * GIB / unit, color="k", ls="--", lw=1)
        ax.text(gib * GIB / unit, 1.02 + 0.09 * i, name, transform=ax.get_xaxis_transform(), fontsize=7,
                ha="right", va="bottom")
    ax.set_xlabel(f"{unit_name} per rank (planned)")
    ax.set_title(title, fontsize=9, pad=8 + 14 * len(capacities or {}))
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def plan_figure(models: Mapping[str, object], model: str = "Qwen2.5-7B-Instruct", dtype: str = "bf16",
                lora_r: int = 16, micro_batch: int = 1, seq_len: int = 2048, strategy: str = "all",
                world_size: int = 3, checkpointing: bool = True, cards: Sequence[Mapping] = LAN_CLUSTER[:2]):
    """The planner's per-rank bytes for one setup, every strategy, against the usable memory of `cards`
    (a card's "GB" are GiB, distlab.planning.cards, less the recommender's reserve)."""
    wb, ab = DTYPE_BYTES[dtype]
    shown = STRATEGY_NAMES[:5] if strategy == "all" else (strategy,)
    rows = {}
    for s in shown:
        if wb < 2 and (not lora_r or s not in ("ddp", "single")):
            continue  # quantised base weights: LoRA on one replica per GPU only
        k = 1 if s == "single" else world_size
        rows[f"{s} x{k}"] = plan_memory(models[model], strategy=s, world_size=k, weight_bytes=wb,
                                        activation_bytes=ab, lora_r=lora_r or None, micro_batch=micro_batch,
                                        seq_len=seq_len, activation_checkpointing=checkpointing)
    usable = {}
    for c in sorted(cards, key=lambda c: c["memory_gib"]):
        name, left = c["name"].removeprefix("GeForce "), c["memory_gib"] - RESERVE_GIB
        usable[f"{name} ({c['memory_gib']:g} GiB): {left:g} usable"] = left
    title = f"{model}, {dtype}, {'LoRA r=%d' % lora_r if lora_r else 'full'}, {micro_batch} x {seq_len} tokens"
    fig = plot_breakdowns(rows, usable, title=title)
    fig.axes[0].set_xlabel(f"GiB per rank (planned); dashed: usable after a {RESERVE_GIB:g} GiB reserve")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- FSDP's overlap, traced


def trace_fsdp_steps(out_dir, steps: int = 2, nproc: int = 2, timeout_s: int = 300) -> dict:
    """Run distlab.measure.fsdp_trace on `nproc` ranks (fully_shard, full fine-tuning of the tiny model);
    rank 0's traced spans (compute, all-gathers, reduce-scatters, steps)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torchrun_module_or_script("distlab.measure.fsdp_trace", nproc, [str(out_dir), "--steps", str(steps)],
                              timeout_s=timeout_s, module=True)
    return json.loads((out_dir / "rank0.json").read_text())


def _union(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _covered(a: float, b: float, union: Sequence[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in union)


def overlap_share(trace: Mapping) -> pd.DataFrame:
    """Per collective kind: how many ran, their time (ms, their union on gloo's threads), and the part of
    it during which the training thread was computing (matrix products, attention): the overlap."""
    spans = trace["spans"]
    compute = _union([(s["start_ms"], s["end_ms"]) for s in spans if s["kind"] == "compute"])
    rows = []
    for kind in ("all-gather", "reduce-scatter"):
        comm = _union([(s["start_ms"], s["end_ms"]) for s in spans if s["kind"] == kind])
        total = sum(b - a for a, b in comm)
        hidden = sum(_covered(a, b, compute) for a, b in comm)
        rows.append({"collective": kind, "count": sum(s["kind"] == kind for s in spans), "time_ms": total,
                     "overlapped_ms": hidden, "overlap_share": hidden / total if total else 0.0})
    steps = [s for s in spans if s["kind"] == "step"]
    span = max(s["end_ms"] for s in steps) - min(s["start_ms"] for s in steps)
    rows.append({"collective": "compute (training thread)", "count": sum(s["kind"] == "compute" for s in spans),
                 "time_ms": sum(b - a for a, b in compute), "overlapped_ms": float("nan"),
                 "overlap_share": float("nan")})
    out = pd.DataFrame(rows).set_index("collective")
    out.attrs["steps_ms"] = span
    return out


def plot_fsdp_trace(trace: Mapping, path, provenance: dict):
    """Rank 0's traced steps: a lane of compute on the training thread over lanes of all-gathers and
    reduce-scatters on gloo's threads; where a collective's bar sits under compute, the two overlapped."""
    spans = trace["spans"]
    end = max(s["end_ms"] for s in spans)
    lanes = [("compute", "compute: matmuls, attention\n(training thread)", "C0"),
             ("all-gather", "all-gather parameters\n(gloo thread)", "C2"),
             ("reduce-scatter", "reduce-scatter gradients\n(gloo thread)", "C3")]
    fig, ax = plt.subplots(figsize=(10, 2.9))
    for y, (kind, label, color) in enumerate(reversed(lanes)):
        bars = [(s["start_ms"], max(s["end_ms"] - s["start_ms"], end * 1e-4)) for s in spans if s["kind"] == kind]
        ax.broken_barh(bars, (y - 0.35, 0.7), fc=color, ec="none")
    for s in spans:
        if s["kind"] == "step":
            ax.axvline(s["start_ms"], color="k", ls=":", lw=0.8)
    ax.set_yticks(range(len(lanes)), [label for _, label, _ in reversed(lanes)], fontsize=8)
    ax.set(xlim=(0, end * 1.01), xlabel="ms since the first traced step started (dotted: a step starts)",
           title=f"FSDP2 on rank 0 of {provenance.get('world_size', 2)}, {trace['steps']} steps traced: "
                 "communication on gloo's threads against compute")
    ax.title.set_fontsize(9)
    fig.tight_layout()
    out = save_figure(fig, path, provenance)
    plt.close(fig)
    return out


# ---------------------------------------------------------------- FSDP + QLoRA

QLORA = {"lora": True, "quantization": "nf4", "double_quant": True}  # a 4-bit NF4 base under the adapters


def launch_qlora(common: Mapping, nproc: int, steps: int, timeout_s: float) -> dict:
    """The same QLoRA run on one rank (single) and sharded on `nproc` (fsdp), each in fresh processes, so that
    each rank's host memory at load is its own: {"single": job, "fsdp": job}."""
    from distlab.launch import local  # deferred: the launcher imports the training stack

    overrides = {**common, **QLORA, "max_steps": steps}
    return {strategy: local.launch_training(f"03_qlora_{strategy}", n, {**overrides, "strategy": strategy},
                                            timeout_s=timeout_s, echo=False)
            for strategy, n in (("single", 1), ("fsdp", nproc))}


def weights_file_mib(model: str | None) -> float:
    """MiB of the safetensors files a QLoRA run of `model` reads (a random preset: the folder it is saved to)."""
    from distlab import sharded_load  # deferred: it imports the training stack
    from distlab.config import TrainConfig

    folder = sharded_load.weights_folder(TrainConfig(model=model, **QLORA))
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20


def qlora_bytes_table(records: Mapping[str, Mapping[int, Mapping]], model_config, nproc: int) -> pd.DataFrame:
    """Per run and rank, MiB measured and planned for each state component (the 4-bit base under "weights":
    packed values, their constants and the unquantised tensors), and host memory before and at the peak of
    loading the model. records: {"single": {rank: result record}, "fsdp": {...}}."""
    rows = []
    for strategy, by_rank in records.items():
        world = len(by_rank)
        for rank, rec in sorted(by_rank.items()):
            plan = plan_memory(model_config, strategy=strategy, world_size=world, rank=rank, dtype="nf4",
                               double_quant=QLORA["double_quant"], lora_r=rec["lora_r"],
                               lora_targets=LORA_TARGETS, activation_bytes=4)
            row = {"run": f"{strategy} x{world}", "rank": rank}
            for part in ("weights", "adapter_weights", "gradients", "optimizer_state"):
                row[f"{part} MiB"] = rec["state_bytes"][part] / 2**20
                row[f"{part} planned"] = getattr(plan, part) / 2**20
            row["host before load MiB"] = rec["host_before_load_bytes"] / 2**20
            row["host peak at load MiB"] = rec["host_peak_at_load_bytes"] / 2**20
            rows.append(row)
    return pd.DataFrame(rows).set_index(["run", "rank"])


def advice_before_after(shape, cards: Sequence[Mapping], model_name: str, **kw) -> pd.DataFrame:
    """The recommender on `cards` for one model, with one quantised replica per GPU as its last resort (before)
    and with a 4-bit base sharded by FSDP allowed (after): its choice and the planned GiB per GPU."""
    rows = []
    for when, shard in (("before: a quantised base runs one replica per GPU", False),
                        ("after: FSDP may shard a 4-bit base", True)):
        rec = recommend(shape, cards, model_name=model_name, shard_quantised=shard, **kw)
        tried = rec.decision.tried("fsdp", 0.5)
        rows.append({"advice": when, "recommended": rec.label,
                     "GiB per GPU": round(rec.decision.chosen.peak / GIB, 2) if rec.plan is not None else float("nan"),
                     "FSDP + QLoRA, step GiB": round(tried.plan.total / GIB, 2) if tried else float("nan"),
                     "FSDP + QLoRA, load GiB": round(tried.load.device / GIB, 2) if tried else float("nan"),
                     "smallest usable GiB": round(min(c["memory_gib"] for c in cards) - RESERVE_GIB, 2),
                     "last step of the reasoning": rec.reasoning[-1]})
    return pd.DataFrame(rows).set_index("advice")
