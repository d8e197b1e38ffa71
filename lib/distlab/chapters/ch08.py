"""Chapter 08 (2-D meshes): the (dp, tp) device mesh of FSDP x TP drawn, run on 4 ranks against one device and
each rank's bytes set against the planner; HSDP's (replicate, shard) mesh and the 3-D (pp, dp, tp) mesh drawn;
decoding split by layers (chapter 06's pipeline) against split within layers (TP); and TP against DDP across
chapter 05's shaped links (step time against link rate, beside bytes / rate; on loopback, labelled so, in the
localhost fallback). The devices, dtypes and loss tolerance each run gets, the loss comparison and the diagrams'
colours it shares with chapter 07, which it builds on: they live below both, in distlab.lessons."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.patches import Rectangle

from distlab import paths
from distlab.bench import lan_ddp
from distlab.inference.outputs import latency_stats, load_run, run_here
from distlab.lan import host_runs
from distlab.lan.hosts import LOOPBACK, link_bits, link_bytes_per_s, link_floor_s, rate_bits
from distlab.launch import local
from distlab.lessons import RANK_COLORS, save_diagram
from distlab.metrics import read_log
from distlab.planning.memory import state_vs_plan
from distlab.planning.wire_bytes import communication_bytes, step_bytes_sent
from distlab.results import schema
from distlab.results.extract import collect_run

# ---------------------------------------------------------------- the meshes, drawn


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
    return save_diagram(fig, path, provenance)


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
    return save_diagram(fig, path, provenance)


# ---------------------------------------------------------------- FSDP x TP on 4 ranks, against one device


def train_one_and_2d(overrides: Mapping, timeout_s: int = 300, one_device: Mapping | None = None,
                     world_size: int = 4, tp_size: int = 2) -> dict[str, local.TrainJob]:
    """The same full fine-tuning on one process (`single`, with `one_device`'s device and dtype on top) and as
    `fsdp_tp` on a (world / tp, tp) mesh (`fsdp_tp`), each rank's state bytes recorded. Both take the same rows
    per step: the one device all of `micro_batch_size`, each of the 2-D run's world / tp groups its share."""
    groups = world_size // tp_size
    rows = overrides["micro_batch_size"]
    if rows % groups:
        raise ValueError(f"micro_batch_size={rows} does not split over {groups} data-parallel groups")
    single = local.launch_training("08_single", 1, {**overrides, **(one_device or {}), "strategy": "single"},
                                   timeout_s=timeout_s, echo=False)
    two_d = local.launch_training("08_fsdp_tp", world_size, {**overrides, "strategy": "fsdp_tp", "tp_size": tp_size,
                                                             "micro_batch_size": rows // groups,
                                                             "global_batch_size": rows, "measure_state": True},
                                  timeout_s=timeout_s, echo=False)
    return {"single": single, "fsdp_tp": two_d}


def state_2d_against_plan(job: local.TrainJob, config) -> pd.DataFrame:
    """The measured weight, gradient and optimizer bytes of the first and the last rank against the
    planner's, in MiB (the ranks between hold what one of them holds)."""
    table = state_vs_plan([collect_run(job.output_dir)], config)
    table = table[(table["component"] != "adapter_weights") & table["rank"].isin([0, table["rank"].max()])]
    return table.set_index(["rank", "component"])[["measured_mib", "planned_mib", "planned / measured"]].round(4)


# ---------------------------------------------------------------- decoding: split by layers or within them


def decode_comparison(model: str | None = None, prompts: int = 8, new_tokens: int = 16, batch_sizes=(1, 8),
                      timeout_s: int = 300) -> tuple[pd.DataFrame, dict[str, bool]]:
    """The same greedy decoding four ways, one thread per rank: chapter 06's pipeline engine on 1 and 2 stages
    (every micro-batch in flight), and tensor-parallel decoding (distlab.inference.tp_decode) on 1 and 2
    ranks, all on CPU (gloo). Returns one row per (way, batch size) with tokens/s, time to first token and
    per-token latency in ms, and whether each 2-rank way's tokens equal its 1-rank way's."""
    work = paths.BUILD_DIR / "ch08" / "decode"
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


def link_bytes(config, rows: int, seq_len: int, lora_r: int = 16) -> dict[str, float]:
    """Bytes each of 2 ranks sends per optimizer step of LoRA (rank `lora_r`, all seven projections), as
    distlab.planning.wire_bytes counts them. tp: every layer's activation all-reduces of rows x seq x hidden fp32
    values, Megatron's 2 forward and 2 backward (the `tp` strategy sums each block's input gradient once,
    chapter 07 section 4), less the first block's input gradient that a frozen embedding never needs, and the
    LoRA factors' small sums; ddp: the ring all-reduce of the LoRA gradients. On 2 ranks a ring all-reduce
    sends 2 (k - 1) / k = 1 times its payload."""
    tp = step_bytes_sent(config, "tp", 2, rows=rows, seq_len=seq_len, lora_r=lora_r)
    return {"tp": sum(tp.values()), "ddp": communication_bytes(config, "ddp", 2, lora_r=lora_r, grad_bytes=4)}


def link_runs(rates: Sequence[str], rows: int, seq_len: int) -> list[lan_ddp.LinkRun]:
    """tp and ddp at every rate, fastest first; the same rows per step (tp's ranks all see them, ddp's split them)."""
    common = {**LINK_TRAINING, "seq_len": seq_len}
    return [lan_ddp.LinkRun(f"08_link_{rate}_{strategy}", rate, {**common, "strategy": strategy,
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
        lan_ddp.run_on_links(placement, "08_link", runs, steps, timeout_s=timeout_s)
    table = pd.DataFrame([{"rate": r.rate, "Gbit/s": link_bytes_per_s(r.rate) * 8 / 1e9,  # NaN on loopback
                           "strategy": r.overrides["strategy"],
                           "step s": median_step_s(lan_ddp.RUNS / r.name / "train_log.jsonl"),
                           "placement": placement.kind} for r in runs])
    return table, placement.mode_line(demos=False)


def why_unshaped(sweep: pd.DataFrame) -> str | None:
    """Why the sweep's step times say nothing about link rates (None when every run was on a shaped link)."""
    shaped = (sweep.placement == "namespaces").all()
    return None if shaped else "the links are loopback, not shaped (localhost fallback)"


def link_prediction(sent: Mapping[str, float], rates: Sequence[str], burst: bool = False) -> pd.DataFrame:
    """Seconds the link needs for each strategy's bytes per step at each rate: bytes x 8 / bits per second.
    `burst`: only for the bytes beyond one tbf bucket, which pass at once after the link was idle: no step at
    that rate can be shorter (the link floor)."""
    def seconds(n: float, rate: str) -> float:
        return link_floor_s(n, rate_bits(rate)) if burst else n * 8 / rate_bits(rate)
    return pd.DataFrame({rate: {s: seconds(n, rate) for s, n in sent.items()} for rate in rates}).T


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
        ax.plot(grid, [link_floor_s(sent[strategy], b * 1e9) for b in grid], ":", color=color, lw=1.5,
                label=f"{strategy}: link floor, the bytes beyond one tbf bucket / rate")
    ax.set_xscale("log")
    ax.set_xlabel("link rate, tc tbf on each host's link (Gbit/s)")
    ax.set_ylabel("median step time (s)")
    ax.set_title("tp and ddp on 2 ranks, tiny model with LoRA, the same rows per step\n"
                 "2 emulated hosts, links shaped by tc tbf", fontsize=10)
    ax.legend(fontsize=8)
    return save_diagram(fig, path, provenance)


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
    return save_diagram(fig, path, provenance)
