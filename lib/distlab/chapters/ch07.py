"""Chapter 07 (tensor parallelism): Megatron's split drawn, the by-hand and DTensor results set side by side,
the bytes a layer all-reduces against the formula, the loss of a `tp` run against one device, the bytes one
optimizer step sends under ddp, fsdp, tp and tp with sequence parallelism (formula and counted), and the 2-D
(FSDP x TP) mesh drawn, run on 4 ranks and its per-rank bytes set against the planner; the devices, dtypes and
loss tolerance each run gets on this machine (distlab.machine), and TP against DDP across shaped links (on
loopback, labelled so, in the localhost fallback)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.patches import FancyArrowPatch, Rectangle

from distlab import paths
from distlab.bench import lan_ddp
from distlab.chapters import ch05
from distlab.chapters.ch02 import run_script  # noqa: F401 (the notebook calls ch07.run_script)
from distlab.inference.outputs import latency_stats, load_run, run_here
from distlab.lan import host_runs
from distlab.lan.hosts import LOOPBACK, bucket_bytes, burst_bytes, link_bits, link_bytes_per_s, rate_bits
from distlab.launch import local
from distlab.launch.torchrun import torchrun_flags
from distlab.machine import TOLERANCES, AutoParameters, pick
from distlab.metrics import read_log
from distlab.planning.advice import communication_bytes, step_bytes_sent
from distlab.planning.memory import state_vs_plan
from distlab.planning.shapes import config_value
from distlab.provenance import save_figure
from distlab.results import schema
from distlab.results.extract import collect_run, collect_sweep
from distlab.workers import launcher
from distlab.workers.step_bytes import RUNS as STEP_BYTES_RUNS  # {name: TrainConfig fields}

RANK_COLORS = ("C0", "C1")

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
    return _saved(fig, path, provenance)


def draw_mesh_2d(path: str | Path, provenance: dict, dp: int = 2, tp: int = 2) -> Path:
    """The (dp, tp) device mesh of FSDP x TP: rank = dp index x tp + tp index. Along a row (a tp group) the
    ranks hold different slices of each layer and all-reduce activations every block; down a column (a dp
    group) they hold different FSDP shards of the same slice, all-gather it before use and reduce-scatter
    its gradient, and take different rows of the batch."""
    right = 4.0 * tp + 0.2
    fig, ax = plt.subplots(figsize=(10, 1.0 + 2.1 * dp))
    ax.set(xlim=(0, right + 3.4), ylim=(-0.9, 2.4 * dp))
    for d in range(dp):
        y = 2.4 * (dp - 1 - d)
        ax.add_patch(Rectangle((0.2, y - 0.15), right - 0.2, 1.8, fc="none", ec="grey", ls="--"))
        for t in range(tp):
            x = 0.4 + 4.0 * t
            ax.add_patch(Rectangle((x, y), 2.6, 1.5, fc=RANK_COLORS[t % 2], alpha=0.3, ec="k"))
            ax.text(x + 1.3, y + 1.05, f"rank {d * tp + t}", ha="center", weight="bold", fontsize=9)
            ax.text(x + 1.3, y + 0.45, f"TP slice {t} of each projection,\nFSDP shard {d} of that slice",
                    ha="center", va="center", fontsize=7)
            if t:
                ax.annotate("", (x, y + 0.75), (x - 1.4, y + 0.75), arrowprops=dict(arrowstyle="<->", color="C3",
                                                                                    lw=2))
        ax.text(right + 0.2, y + 0.75, f"node {d} = tp group {d}:\nall-reduce of activations (every\n"
                f"block, every micro-batch);\nits own rows of the batch", fontsize=7, color="C3", va="center")
    for t in range(tp):
        x = 1.7 + 4.0 * t
        ax.annotate("", (x, 1.5 + 0.02), (x, 2.4 - 0.17), arrowprops=dict(arrowstyle="<->", color="C2", lw=2))
        ax.text(x + 0.15, 1.95, f"dp group {t}: all-gather weights,\nreduce-scatter gradients", fontsize=7,
                color="C2", va="center")
    ax.text(right / 2, -0.6, f"{dp * tp} ranks as a {dp} x {tp} mesh (dp, tp): tp inside a node, on its fast "
            "link; dp across nodes", ha="center", fontsize=8)
    ax.axis("off")
    return _saved(fig, path, provenance)


GPU_W = 1.85  # width of one GPU's box in the mesh diagrams (data units)


def _gpu(ax, x: float, y: float, rank: int, tp_index: int, text: str) -> None:
    ax.add_patch(Rectangle((x, y), GPU_W, 1.0, fc=RANK_COLORS[tp_index % 2], alpha=0.3, ec="k"))
    ax.text(x + GPU_W / 2, y + 0.68, f"rank {rank}", ha="center", va="center", weight="bold", fontsize=8)
    ax.text(x + GPU_W / 2, y + 0.3, text, ha="center", va="center", fontsize=6.5)


def _link(ax, a: tuple[float, float], b: tuple[float, float], color: str) -> None:
    ax.annotate("", b, a, arrowprops=dict(arrowstyle="<->", color=color, lw=1.8))


def draw_hsdp_and_3d(path: str | Path, provenance: dict) -> Path:
    """Left: HSDP, a (replicate, shard) mesh of 2 nodes x 2 GPUs: FSDP inside each node (all-gather,
    reduce-scatter on the fast link), the nodes replicas of each other (one all-reduce of each gradient
    shard across nodes per step). Right: the 3-D mesh (pp, dp, tp) = (2, 2, 2) of 8 GPUs: TP inside a node,
    FSDP between the nodes of one pipeline stage, and the pipeline's point-to-point sends between stages,
    on the slowest links."""
    fig, (ax_h, ax_3) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 1.55]})
    ax_h.set(xlim=(-0.5, 9.0), ylim=(-0.6, 6.4), title="HSDP: shard inside a node, replicate across nodes")
    for node in range(2):
        y = 3.4 - 3.0 * node
        ax_h.add_patch(Rectangle((0.2, y - 0.35), 4.95, 1.9, fc="none", ec="grey", ls="--"))
        ax_h.text(-0.25, y + 0.6, f"node {node}\n(replica {node})", fontsize=7, color="grey", rotation=90,
                  ha="center", va="center")
        for g in range(2):
            _gpu(ax_h, 0.5 + 2.65 * g, y, 2 * node + g, g, f"FSDP shard {g}")
        _link(ax_h, (0.5 + GPU_W, y + 0.5), (3.15, y + 0.5), "C2")
        ax_h.text(5.35, y + 0.5, "all-gather weights,\nreduce-scatter gradients\n(every layer, fast link)",
                  fontsize=7, color="C2", va="center")
    for g in range(2):
        _link(ax_h, (0.5 + GPU_W / 2 + 2.65 * g, 3.38), (0.5 + GPU_W / 2 + 2.65 * g, 1.42), "C0")
    ax_h.text(5.35, 2.4, "all-reduce of my gradient\nshard with my twin in the\nother node (once per step)",
              fontsize=7, color="C0", va="center")
    ax_h.text(4.0, -0.5, "each shard: 1/2 of every layer; mesh (replicate, shard) = (2, 2):\n"
              "fully_shard(model, mesh=mesh) on a 2-D mesh is HSDP", ha="center", va="center", fontsize=7.5)
    ax_h.axis("off")

    ax_3.set(xlim=(0, 12.6), ylim=(-0.9, 6.4), title="3-D: pipeline x FSDP x TP on (pp, dp, tp) = (2, 2, 2)")
    for stage in range(2):
        x0 = 0.3 + 6.8 * stage
        ax_3.add_patch(Rectangle((x0 - 0.15, -0.35), 5.3, 6.45, fc="C1", alpha=0.06, ec="C1"))
        ax_3.text(x0 + 2.5, 5.8, f"pipeline stage {stage}: layers {'first' if stage == 0 else 'second'} half",
                  ha="center", fontsize=7.5, color="C1")
        for d in range(2):
            y = 3.4 - 3.0 * d
            ax_3.add_patch(Rectangle((x0, y - 0.3), 5.0, 1.75, fc="none", ec="grey", ls="--"))
            ax_3.text(x0 + 0.05, y + 1.2, f"node {2 * stage + d}", fontsize=6.5, color="grey")
            for t in range(2):
                rank = 4 * stage + 2 * d + t
                _gpu(ax_3, x0 + 0.3 + 2.65 * t, y, rank, t, f"TP {t}, FSDP shard {d}")
            _link(ax_3, (x0 + 0.3 + GPU_W, y + 0.5), (x0 + 2.95, y + 0.5), "C3")
        for t in range(2):
            _link(ax_3, (x0 + 0.3 + GPU_W / 2 + 2.65 * t, 3.38), (x0 + 0.3 + GPU_W / 2 + 2.65 * t, 1.42), "C2")
    for d in range(2):
        y = 3.4 - 3.0 * d + 0.5
        ax_3.annotate("", (7.1, y), (5.3, y), arrowprops=dict(arrowstyle="->", color="C0", lw=1.8))
        ax_3.text(6.2, y + 0.15, "send/recv\nactivations", ha="center", va="bottom", fontsize=6.5, color="C0")
    ax_3.text(6.25, -0.75, "red: TP all-reduces (every block)   green: FSDP gathers and reduce-scatters (every "
              "layer)   blue: pipeline sends (every micro-batch)", ha="center", fontsize=7)
    ax_3.axis("off")
    return _saved(fig, path, provenance)


def _saved(fig, path: str | Path, provenance: dict) -> Path:
    """A drawn diagram laid out, saved with its provenance, and closed (the notebook displays the file)."""
    fig.tight_layout()
    out = save_figure(fig, path, provenance)
    plt.close(fig)
    return out


# ---------------------------------------------------------------- tables


def allreduce_bytes_per_layer(batch: int, seq: int, hidden: int, bytes_per_value: int = 4) -> dict[str, int]:
    """Megatron's count: the block outputs (forward) and block input gradients (backward) of attention
    and MLP, each b x s x h values."""
    one = batch * seq * hidden * bytes_per_value
    return {"forward": 2 * one, "backward": 2 * one}


def differences(by_hand: Mapping[str, Mapping[str, float]]) -> pd.DataFrame:
    """The by-hand script's max differences against one device, one row per block."""
    cols = ["output", "input_grad", "weight_grads"]
    return pd.DataFrame(by_hand).T[cols].astype(float)


def layer_bytes(by_hand: Mapping, dtensor: Mapping, batch: int, seq: int, hidden: int,
                bytes_per_value: int = 4) -> pd.DataFrame:
    """All-reduce payload bytes of one decoder layer: the formula, the by-hand split, DTensor's plan."""
    formula = allreduce_bytes_per_layer(batch, seq, hidden, bytes_per_value)
    rows = {}
    for phase in ("forward", "backward"):
        calls = dtensor[phase]
        rows[phase] = {"formula: all-reduces": 2, "formula: bytes": formula[phase],
                       "by hand: all-reduces": sum(b[f"{phase}_calls"] for b in by_hand.values()),
                       "by hand: bytes": sum(b[f"{phase}_bytes"] for b in by_hand.values()),
                       "DTensor: all-reduces": sum(1 for name, _ in calls if name == "all_reduce"),
                       "DTensor: bytes": sum(n for name, n in calls if name == "all_reduce")}
    table = pd.DataFrame(rows).T
    table.loc["per layer"] = table.sum()
    return table.astype(int)


def loss_tolerance(*dtypes: str) -> float:
    """The `auto` loss_atol for runs that compute in `dtypes`: the loosest of their tolerances
    (distlab.machine.TOLERANCES), so a one-device run on a GPU in bf16 beside TP ranks on CPU in fp32 (one GPU:
    the ranks cannot share it) is held to bf16's, and two fp32 runs to fp32's rounding."""
    loose = TOLERANCES["bf16-autocast"]["loss_atol"]  # any dtype but fp32 rounds like bf16 or worse
    return max(TOLERANCES["fp32"]["loss_atol"] if d == "fp32" else loose for d in dtypes)


def run_devices(device: str, dtype: str, auto: AutoParameters) -> tuple[dict[str, str], dict[str, str]]:
    """(the one-device run's device and dtype, the distributed runs'): "auto" takes distlab.machine's choice,
    a GPU for one device where there is one and for the ranks only where each gets its own; an explicit value
    (a profile's, the reader's) applies to both."""
    return ({"device": pick(device, auto.device), "dtype": pick(dtype, auto.dtype)},
            {"device": pick(device, auto.rank_device), "dtype": pick(dtype, auto.rank_dtype)})


def rank_needs(device: str, ranks: int) -> tuple[str, ...]:
    """What `ranks` ranks on `device` need of the machine (distlab.machine.Sections): a GPU each under NCCL,
    nothing on CPU (gloo ranks may share cores: the runs check what is computed, not speed)."""
    return (f"gpus:{ranks}",) if device == "cuda" else ()


def loss_comparison(single_log: str | Path, tp_log: str | Path, label: str = "tp, 2 ranks") -> pd.DataFrame:
    """Step losses of one device and of a split run (the steps both ran), and their difference."""
    one = pd.DataFrame(read_log(single_log)).set_index("step")["loss"]
    tp = pd.DataFrame(read_log(tp_log)).set_index("step")["loss"]
    one = one.loc[one.index.isin(tp.index)]
    return pd.DataFrame({"one device": one, label: tp, "difference": (tp - one).abs()})


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
    """Per strategy, the MiB one rank sends in the step: the formula (distlab.planning.advice.step_bytes_sent,
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

def train_2d(overrides: Mapping, world_size: int = 4, tp_size: int = 2, timeout_s: int = 300) -> local.TrainJob:
    """The same fine-tuning as `fsdp_tp` on a (world / tp, tp) mesh, recording each rank's state bytes."""
    return local.launch_training("07_fsdp_tp", world_size, {**overrides, "strategy": "fsdp_tp", "tp_size": tp_size,
                                                            "measure_state": True}, timeout_s=timeout_s, echo=False)


def state_2d_against_plan(job: local.TrainJob, config) -> pd.DataFrame:
    """The measured weight, gradient and optimizer bytes of the first and the last rank against the
    planner's, in MiB (the ranks between hold what one of them holds)."""
    table = state_vs_plan([collect_run(job.output_dir)], config)
    table = table[(table["component"] != "adapter_weights") & table["rank"].isin([0, table["rank"].max()])]
    return table.set_index(["rank", "component"])[["measured_mib", "planned_mib", "planned / measured"]].round(4)


def decode_comparison(model: str | None = None, prompts: int = 8, new_tokens: int = 16, batch_sizes=(1, 8),
                      timeout_s: int = 300) -> tuple[pd.DataFrame, dict[str, bool]]:
    """The same greedy decoding four ways, one thread per rank: chapter 06's pipeline engine on 1 and 2 stages
    (every micro-batch in flight), and tensor-parallel decoding (distlab.inference.tp_decode) on 1 and 2
    ranks, all on CPU (gloo). Returns one row per (way, batch size) with tokens/s, time to first token and
    per-token latency in ms, and whether each 2-rank way's tokens equal its 1-rank way's."""
    work = paths.BUILD_DIR / "ch07" / "decode"
    work.mkdir(parents=True, exist_ok=True)
    common = ["--num-prompts", str(prompts), "--max-new-tokens", str(new_tokens),
              "--batch-size", ",".join(map(str, batch_sizes))] + (["--model", model] if model else [])
    ways = {"pipeline, 1 stage": ("distlab.inference", 1), "pipeline, 2 stages": ("distlab.inference", 2),
            "TP, 1 rank": ("distlab.inference.tp_decode", 1), "TP, 2 ranks": ("distlab.inference.tp_decode", 2)}
    on_cpu = {"distlab.inference": ["--device", "cpu"], "distlab.inference.tp_decode": []}  # both on gloo/CPU
    rows, tokens = [], {}
    for way, (module, ranks) in ways.items():
        out = run_here(ranks, work / way.replace(", ", "_").replace(" ", ""), [*common, *on_cpu[module]], module,
                       timeout_s)
        for b in batch_sizes:
            folder = out / f"b{b}" if len(batch_sizes) > 1 else out
            done = [json.loads(line) for line in (folder / "completions.jsonl").read_text().splitlines()]
            tokens[(way, b)] = {row["id"]: row["tokens"] for row in done}
            stats = latency_stats(load_run(folder)) if module == "distlab.inference" else json.loads(
                (folder / "summary.json").read_text())
            rows.append({"way": way, "batch size": b, "tokens/s": stats["tokens_per_s"],
                         "first token (ms)": 1e3 * _mean_ttft(done), "per token (ms)": 1e3 * stats["per_token_s"]})
    same = {f"{kind}, batch {b}": tokens[(f"{kind}, 2 {unit}", b)] == tokens[(f"{kind}, 1 {unit[:-1]}", b)]
            for kind, unit in (("pipeline", "stages"), ("TP", "ranks")) for b in batch_sizes}
    return pd.DataFrame(rows).set_index(["way", "batch size"]).round(1), same


def _mean_ttft(completions: list[dict]) -> float:
    return sum(row["ttft_s"] for row in completions) / len(completions)


# ---------------------------------------------------------------- TP and DDP across a slow link

# LoRA, as on chapter 05's LAN; instruments off (throughput runs); the tiny model on CPU whatever the profile.
LINK_TRAINING = {"lora": True, "lr": 1e-2, "measure_comm": False, "model": None, "device": "cpu", "dtype": "fp32"}
DTENSOR_BACKWARD = 5  # all-reduces per layer in backward with the per-projection plan (section 4): q, k, v, gate, up


def link_bytes(config, rows: int, seq_len: int, lora_r: int = 16) -> dict[str, float]:
    """Bytes each of 2 ranks sends per optimizer step. tp: every layer's activation all-reduces of
    rows x seq x hidden fp32 values, Megatron's 2 forward (allreduce_bytes_per_layer) and DTensor's 5
    backward; ddp: the planner's ring all-reduce of the LoRA gradients. On 2 ranks a ring all-reduce sends
    2 (k - 1) / k = 1 times its payload."""
    hidden, layers = config_value(config, "hidden_size"), config_value(config, "num_hidden_layers")
    layer = allreduce_bytes_per_layer(rows, seq_len, hidden)
    per_layer = layer["forward"] + layer["backward"] * DTENSOR_BACKWARD / 2
    return {"tp": layers * per_layer,
            "ddp": communication_bytes(config, "ddp", 2, lora_r=lora_r, grad_bytes=4)}


def link_runs(rates: Sequence[str], rows: int, seq_len: int) -> list[lan_ddp.LinkRun]:
    """tp and ddp at every rate, fastest first; the same rows per step (tp's ranks all see them, ddp's split them)."""
    common = {**LINK_TRAINING, "seq_len": seq_len}
    return [lan_ddp.LinkRun(f"07_link_{rate}_{strategy}", rate, {**common, "strategy": strategy,
                                                                 "micro_batch_size": rows // split})
            for rate in sorted(rates, key=link_bits, reverse=True) for strategy, split in (("tp", 1), ("ddp", 2))]


def median_step_s(log: str | Path) -> float:
    """The median over the steady steps (after the warm-up) of the slower rank's step time."""
    merged = schema.merge_ranks({r: read_log(p) for r, p in enumerate(schema.rank_log_paths(log))})
    return statistics.median(s["step_time_s"] for s in schema.steady(merged))


def link_sweep(rates: Sequence[str], steps: int = 4, rows: int = 4, seq_len: int = 64, timeout_s: int = 300,
               force_local: bool = False) -> tuple[pd.DataFrame, str]:
    """tp and ddp on 2 emulated hosts (chapter 05's namespaces, links shaped with tc tbf) at each rate, in ONE
    launch (lan_ddp.run_on_links: each run gets its rate as it starts). Returns (one row per rate and
    strategy: the median steady step time and where it ran; which mode ran and why, as chapter 05 prints it).
    Without namespaces the runs go to localhost agents over loopback, once each, at the "rate" loopback: no rate
    is applied there, so none is claimed."""
    placement = host_runs.place(2, max(rates, key=rate_bits), force_local=force_local)
    runs = link_runs(placement.link_rates(rates), rows, seq_len)
    with placement.running():
        lan_ddp.run_on_links(placement, "07_link", runs, steps, timeout_s=timeout_s)
    table = pd.DataFrame([{"rate": r.rate, "Gbit/s": link_bytes_per_s(r.rate) * 8 / 1e9,  # NaN on loopback
                           "strategy": r.overrides["strategy"],
                           "step s": median_step_s(lan_ddp.RUNS / r.name / "train_log.jsonl"),
                           "placement": placement.kind} for r in runs])
    return table, ch05.mode(placement, demos=False)


def why_unshaped(sweep: pd.DataFrame) -> str | None:
    """Why the sweep's step times say nothing about link rates (None when every run was on a shaped link)."""
    shaped = (sweep.placement == "namespaces").all()
    return None if shaped else "the links are loopback, not shaped (localhost fallback)"


def link_prediction(sent: Mapping[str, float], rates: Sequence[str], burst: bool = False) -> pd.DataFrame:
    """Seconds the link needs for each strategy's bytes per step at each rate: bytes x 8 / bits per second.
    `burst`: only for the bytes beyond one tbf bucket, which pass at once after the link was idle: no step at
    that rate can be shorter (the link floor)."""
    def beyond(n: float, rate: str) -> float:
        return max(0.0, n - burst_bytes(rate)) if burst else n
    return pd.DataFrame({rate: {s: beyond(n, rate) * 8 / rate_bits(rate) for s, n in sent.items()}
                         for rate in rates}).T


def link_table(sweep: pd.DataFrame, sent: Mapping[str, float]) -> pd.DataFrame:
    """Per rate and strategy: MB sent per step, those bytes / the rate, the link floor (the bytes beyond one
    tbf burst / the rate) and the measured slow-down (the median step time minus the one at the fastest rate).
    On loopback (the localhost fallback) only the step time and the bytes: there is no rate to divide by."""
    if why_unshaped(sweep):
        out = sweep.assign(**{"MB per step": sweep.strategy.map(sent) / 1e6})
        return out.set_index(["rate", "strategy"])[["step s", "MB per step"]].round(3)
    fastest = sweep.loc[sweep["Gbit/s"].idxmax(), "rate"]
    base = sweep[sweep.rate == fastest].set_index("strategy")["step s"]
    rates = list(sweep.rate.unique())
    predicted, floor = (link_prediction(sent, rates, burst).stack() for burst in (False, True))
    keys = list(zip(sweep.rate, sweep.strategy))
    out = sweep.assign(**{"MB per step": sweep.strategy.map(sent) / 1e6,
                          "bytes / rate (s)": [predicted[k] for k in keys], "link floor (s)": [floor[k] for k in keys],
                          "slow-down (s)": sweep["step s"] - sweep.strategy.map(base)})
    columns = ["step s", "MB per step", "bytes / rate (s)", "link floor (s)", "slow-down (s)"]
    return out.set_index(["rate", "strategy"])[columns].round(3)


def link_figure(sweep: pd.DataFrame, sent: Mapping[str, float], path: str | Path, provenance: dict) -> Path:
    """Median step time against the link rate (log x), tp and ddp, each beside its prediction: the step at
    the fastest rate plus the bytes it sends per step over the rate. On loopback (the localhost fallback) the
    two measured steps as bars, labelled loopback, not shaped: no rate was applied, so no axis of rates."""
    if why_unshaped(sweep):
        return _loopback_figure(sweep, sent, path, provenance)
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    grid = np.geomspace(sweep["Gbit/s"].min(), sweep["Gbit/s"].max(), 60)
    for strategy, color in (("tp", "C3"), ("ddp", "C0")):
        g = sweep[sweep.strategy == strategy].sort_values("Gbit/s")
        ax.plot(g["Gbit/s"], g["step s"], "o-", color=color, label=f"{strategy}: measured")
        ax.plot(grid, g["step s"].iloc[-1] + sent[strategy] * 8 / (grid * 1e9), "--", color=color,
                label=f"{strategy}: predicted, fastest step + {sent[strategy] / 1e6:.1f} MB per step / rate")
        beyond = np.maximum(0.0, sent[strategy] - np.array([bucket_bytes(b * 1e9) for b in grid]))
        ax.plot(grid, beyond * 8 / (grid * 1e9), ":", color=color, lw=1.5,
                label=f"{strategy}: link floor, the bytes beyond one tbf bucket / rate")
    ax.set_xscale("log")
    ax.set_xlabel("link rate, tc tbf on each host's link (Gbit/s)")
    ax.set_ylabel("median step time (s)")
    ax.set_title("tp and ddp on 2 ranks, tiny model with LoRA, the same rows per step\n"
                 "2 emulated hosts, links shaped by tc tbf", fontsize=10)
    ax.legend(fontsize=8)
    return _saved(fig, path, provenance)


def _loopback_figure(sweep: pd.DataFrame, sent: Mapping[str, float], path: str | Path, provenance: dict) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    steps = sweep.set_index("strategy")["step s"]
    for i, (strategy, color) in enumerate((("tp", "C3"), ("ddp", "C0"))):
        ax.bar(i, steps[strategy], 0.5, color=color, alpha=0.7)
        ax.text(i, steps[strategy], f"{steps[strategy]:.3f} s\n{sent[strategy] / 1e6:.1f} MB per step", ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks([0, 1], ["tp", "ddp"])
    ax.set_ylim(0, 1.3 * steps.max())
    ax.set_ylabel("median step time (s)")
    ax.set_title("tp and ddp on 2 ranks, tiny model with LoRA, the same rows per step\n"
                 f"FALLBACK: 2 agents on localhost: {LOOPBACK}, not shaped (no link rate applied)", fontsize=10)
    return _saved(fig, path, provenance)
