"""Chapter 07 (tensor parallelism): Megatron's split drawn, the by-hand and DTensor results set side by side,
the bytes a layer all-reduces against the formula, the loss of a `tp` run against one device, and the bytes one
optimizer step sends under ddp, fsdp, tp and tp with sequence parallelism (formula and counted). What it shares
with chapter 08 (2-D meshes), which builds on it, lives below both in distlab.lessons: the devices, dtypes and
loss tolerance each run gets on this machine, the loss comparison, Megatron's bytes per layer and the diagrams'
colours; the notebook runs its scripts with distlab.launch.scripts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.patches import FancyArrowPatch, Rectangle

from distlab import paths
from distlab.launch import local
from distlab.launch.torchrun import torchrun_flags
from distlab.lessons import RANK_COLORS, allreduce_bytes_per_layer, save_diagram
from distlab.planning.memory import state_vs_plan
from distlab.planning.wire_bytes import step_bytes_sent
from distlab.results.extract import collect_sweep
from distlab.workers import launcher
from distlab.workers.step_bytes import RUNS as STEP_BYTES_RUNS  # {name: TrainConfig fields}

# ---------------------------------------------------------------- the idea, drawn


def _matrix(ax, x: float, y: float, w: float, h: float, split: str, title: str, note: str) -> None:
    """A weight drawn as X @ A sees it (rows: inputs, columns: outputs), cut in two by columns or rows."""
    for r, color in enumerate(RANK_COLORS):
        if split == "columns":
            ax.add_patch(Rectangle((x + r * w / 2, y), w / 2, h, fc=color, alpha=0.45, ec="k"))
        else:
            ax.add_patch(Rectangle((x, y + (1 - r) * h / 2), w, h / 2, fc=color, alpha=0.45, ec="k"))
    ax.text(x + w / 2, y + h + 0.25, title, ha="center", va="bottom", fontsize=8, weight="bold")
    ax.text(x + w / 2, y - 0.25, note, ha="center", va="top", fontsize=7)


def draw_tensor_parallel(path: str | Path, provenance: dict, config, tp: int = 2) -> Path:
    """Left: which slice of each weight a rank holds (attention by heads, the MLP by FFN columns then rows).
    Right: one decoder layer on two ranks, with the only all-reduces: after o_proj and after down_proj in
    forward, and their mirrors (the input gradients of q/k/v and of gate/up) in backward."""
    heads, kv, ffn = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    fig, (ax_w, ax_f) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [1, 1.45]})
    ax_w.set(xlim=(0, 10), ylim=(0, 10), title="who holds which slice (as X @ A: rows in, columns out)")
    _matrix(ax_w, 0.4, 5.6, 2.0, 2.6, "columns", "q, k, v", f"heads {heads // tp} + {heads // tp}\n"
            f"kv heads {kv // tp} + {kv // tp}")
    _matrix(ax_w, 3.0, 5.6, 2.0, 2.6, "rows", "o_proj", "rows of\nmy heads' outputs")
    _matrix(ax_w, 5.6, 5.6, 2.0, 2.6, "columns", "gate, up", f"FFN columns\n{ffn // tp} + {ffn // tp}")
    _matrix(ax_w, 8.0, 5.6, 1.6, 2.6, "rows", "down", "FFN rows\n(the same blocks)")
    for r, color in enumerate(RANK_COLORS):
        ax_w.add_patch(Rectangle((0.6 + 4.6 * r, 2.3), 0.5, 0.5, fc=color, alpha=0.45, ec="k"))
        ax_w.text(1.25 + 4.6 * r, 2.55, f"rank {r}'s slice", va="center", fontsize=8)
    ax_w.text(5, 1.2, "column-parallel: outputs split, no communication\nrow-parallel: partial sums, one "
              "all-reduce", ha="center", va="center", fontsize=8)
    ax_w.axis("off")

    ax_f.set(xlim=(0, 14), ylim=(0, 10), title="one decoder layer, 2 ranks: where the all-reduces sit")
    steps = [(0.2, "x\n(whole)"), (2.0, "q,k,v\nmy heads"), (3.8, "attention\nmy heads"), (5.6, "o_proj\npartial"),
             (8.0, "+x, norm\n(whole)"), (9.8, "gate, up\nmy cols"), (11.6, "down\npartial")]
    for r, y in enumerate((6.3, 2.0)):
        ax_f.text(0.1, y + 1.75, f"rank {r}", color=RANK_COLORS[r], weight="bold", fontsize=9)
        for x, label in steps:
            ax_f.add_patch(Rectangle((x, y), 1.5, 1.3, fc=RANK_COLORS[r], alpha=0.25, ec="k"))
            ax_f.text(x + 0.75, y + 0.65, label, ha="center", va="center", fontsize=7)
        for (x0, _), (x1, _) in zip(steps, steps[1:]):
            if x1 - x0 < 2:  # inside a block: local, no arrow through an all-reduce
                ax_f.add_patch(FancyArrowPatch((x0 + 1.5, y + 0.65), (x1, y + 0.65), arrowstyle="->",
                                               mutation_scale=8))
    for x, tag in ((7.25, "all-reduce\n(sum)"), (13.25, "all-reduce\n(sum)")):
        ax_f.add_patch(Rectangle((x - 0.15, 2.0), 0.6, 5.6, fc="C3", alpha=0.3, ec="C3"))
        ax_f.text(x + 0.15, 4.95, tag, ha="center", va="center", fontsize=7, rotation=90)
    for y in (6.95, 2.65):  # the summed output goes on, whole, on every rank
        ax_f.add_patch(FancyArrowPatch((7.55, y), (8.0, y), arrowstyle="->", mutation_scale=8))
    for x in (1.75, 9.55):  # backward: the input gradient of a column-parallel block is summed
        ax_f.annotate("", (x, 2.0), (x, 7.6), arrowprops=dict(arrowstyle="<->", color="C2", ls="--"))
        ax_f.text(x + 0.12, 4.95, "backward:\nall-reduce\nof dL/dx", color="C2", fontsize=7, va="center")
    ax_f.text(7.0, 0.55, "forward: 2 all-reduces of b x s x h (red); backward: 2 more, of the input "
              "gradients (green, dashed)", ha="center", fontsize=8)
    ax_f.axis("off")
    return save_diagram(fig, path, provenance)


# ---------------------------------------------------------------- tables


def differences(by_hand: Mapping[str, Mapping[str, float]]) -> pd.DataFrame:
    """The by-hand script's max differences against one device, one row per block."""
    cols = ["output", "input_grad", "weight_grads"]
    return pd.DataFrame(by_hand).T[cols].astype(float)


def layer_bytes(by_hand: Mapping, dtensor: Mapping, batch: int, seq: int, hidden: int,
                bytes_per_value: int = 4) -> pd.DataFrame:
    """All-reduce payload bytes of one decoder layer: the formula, the by-hand split, DTensor's per-projection
    plan and, where `dtensor` holds its `block_input` run, the same plan with each block's input made one
    DTensor first (distlab.strategies.tp.block_input_plan)."""
    formula = allreduce_bytes_per_layer(batch, seq, hidden, bytes_per_value)
    plans = {"DTensor": dtensor, **({"DTensor + block input": dtensor["block_input"]} if "block_input" in dtensor
                                   else {})}
    rows = {}
    for phase in ("forward", "backward"):
        rows[phase] = {"formula: all-reduces": 2, "formula: bytes": formula[phase],
                       "by hand: all-reduces": sum(b[f"{phase}_calls"] for b in by_hand.values()),
                       "by hand: bytes": sum(b[f"{phase}_bytes"] for b in by_hand.values())}
        for label, run in plans.items():
            rows[phase][f"{label}: all-reduces"] = sum(1 for name, _ in run[phase] if name == "all_reduce")
            rows[phase][f"{label}: bytes"] = sum(n for name, n in run[phase] if name == "all_reduce")
    table = pd.DataFrame(rows).T
    table.loc["per layer"] = table.sum()
    return table.astype(int)


TP_RUNS = "07_tp_runs"  # the launch that runs both tp runs, one after the other in the same two ranks


def train_one_and_tp(overrides: Mapping, timeout_s: int = 300,
                     one_device: Mapping | None = None) -> dict[str, local.TrainJob]:
    """The same full fine-tuning on one process (`single`, with `one_device`'s device and dtype on top) and on two
    tensor-parallel ranks, twice in one launch: the layers split (`tp`), then the vocabulary split as well
    (`tp_vocab`: vocab_parallel), each rank's state bytes recorded."""
    single = local.launch_training("07_single", 1, {**overrides, **(one_device or {}), "strategy": "single"},
                                   timeout_s=timeout_s, echo=False)
    split = local.launch_sweep(TP_RUNS, 2, {**overrides, "strategy": "tp", "measure_state": True},
                               {"07_tp": {}, "07_tp_vocab": {"vocab_parallel": True}}, timeout_s=timeout_s, echo=False)
    return {"single": single, "tp": split["07_tp"], "tp_vocab": split["07_tp_vocab"]}


def tp_state_against_plan(config) -> pd.DataFrame:
    """Rank 0's measured weight, gradient and optimizer bytes in both tp runs of `train_one_and_tp`, against the
    planner's, in MiB (rank 1 holds the same, give or take a row of an odd vocabulary)."""
    runs = collect_sweep(paths.RUNS_DIR / TP_RUNS, 2)
    table = state_vs_plan([runs["07_tp"], runs["07_tp_vocab"]], config)
    table["split"] = table["run"].map({"07_tp": "layers", "07_tp_vocab": "layers + vocabulary"})
    table = table[(table["component"] != "adapter_weights") & (table["rank"] == 0)]
    return table.set_index(["split", "component"])[["measured_mib", "planned_mib", "planned / measured"]].round(4)


# ---------------------------------------------------------------- sequence parallelism, and what each strategy sends

def measure_step_bytes(rows: int, seq_len: int, timeout_s: int = 300) -> dict:
    """One optimizer step of the same full fine-tuning of the tiny model as ddp, fsdp, tp, tp with sequence
    parallelism and tp with the vocabulary split, on two ranks on CPU (gloo), from the same weights on the same
    `rows` x `seq_len` batch, each step's collectives counted (distlab.workers.step_bytes; a counting run:
    nothing is timed)."""
    out = paths.BUILD_DIR / "ch07" / "step_bytes.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    args = ["--rows", str(rows), "--set", f"seq_len={seq_len}", "--set", "device=cpu", "--set", "dtype=fp32"]
    launcher.run_worker("distlab.workers.step_bytes", out, args, torchrun_flags(2), timeout_s=timeout_s, echo=False)
    measured = json.loads(out.read_text())
    if list(measured["runs"]) != list(STEP_BYTES_RUNS):
        raise ValueError(f"{out}: runs {list(measured['runs'])}, expected {list(STEP_BYTES_RUNS)}")
    return measured


def step_bytes_table(measured: Mapping, config) -> pd.DataFrame:
    """Per strategy, the MiB one rank sends in the step: the formula (distlab.planning.wire_bytes.step_bytes_sent,
    part by part) beside the counted collectives, their ratio, and the step's loss (the same for all)."""
    k, rows, seq = measured["world_size"], measured["rows"], measured["seq_len"]
    table = {}
    for name, settings in STEP_BYTES_RUNS.items():
        run = measured["runs"][name]
        parts = step_bytes_sent(config, settings["strategy"], k, rows=rows, seq_len=seq,
                                sequence_parallel=settings.get("sequence_parallel", False),
                                vocab_parallel=settings.get("vocab_parallel", False),
                                label_tokens=measured["label_tokens"])
        table[name] = {"formula MiB": sum(parts.values()) / 2**20, "measured MiB": run["sent_bytes"] / 2**20,
                       "largest part (formula)": max(parts, key=parts.get), "step loss": run["loss"]}
    table = pd.DataFrame(table).T
    table.insert(2, "measured / formula", table["measured MiB"] / table["formula MiB"])
    return table.astype({"formula MiB": float, "measured MiB": float, "measured / formula": float, "step loss": float})


def sequence_parallel_break_even(config, world_size: int = 2, grad_bytes: int = 4, activation_bytes: int = 2) -> float:
    """Tokens per optimizer step (one micro-batch) at which tp + sequence parallelism sends what ddp sends: DDP's
    bytes are the gradients, fixed by the parameters; TP's are activations, proportional to the tokens (the norms'
    few gradient bytes left out). Defaults as on GPUs: gradients reduced in fp32, activations in bf16."""
    ddp = sum(step_bytes_sent(config, "ddp", world_size, rows=1, seq_len=1, value_bytes=grad_bytes).values())
    per_token = step_bytes_sent(config, "tp", world_size, rows=1, seq_len=1, value_bytes=activation_bytes,
                                sequence_parallel=True)["activations (all-gather, reduce-scatter)"]
    return ddp / per_token
