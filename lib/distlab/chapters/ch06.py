"""Chapter 06 (Slurm pipeline inference): the 2-stage pipeline with a KV cache per stage drawn, the Slurm jobs
planned from the notebook's parameters, the KV cache's bytes (counted in a cache, and by the formula), the
scaling, batch-sweep, stage-memory and width tables and figures, and a finished run's stage timeline (one row
per stage, one bar per forward, micro-batches told apart by colour; the runs are read by
distlab.inference.outputs.load_run); and the stage-loss demo: a stage killed mid-job, the job finished by
submitting it again (`stage_loss_demo`). Where this machine cannot start a Slurm cluster (or `scheduler = "local"`),
every job runs through distlab.slurm.local instead (`choose_scheduler`, `run_job`): the same run.sh, once per task,
the same outputs and a record shaped like sacct's."""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from collections import Counter
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from distlab import paths
from distlab.inference import outputs
from distlab.inference.resume import COMPLETIONS
from distlab.launch.sbatch import SlurmSpec
from distlab.layer_split import split_layers
from distlab.provenance import save_figure
from distlab.slurm import local, submit

MIB = 2 ** 20
MB_COLORS = plt.get_cmap("tab10")
SCHEDULERS = ("auto", "slurm", "local")
CLUSTER_SECTION = "3. A Slurm cluster on this machine"
MARGIN_SE = 2  # a timing claim's margin: standard errors of the rounds' mean time per token


# ---------------------------------------------------------------- where the jobs run

def choose_scheduler(scheduler: str, sections) -> str:
    """"slurm" or "local": where the chapter's jobs run, recorded in `sections` (distlab.machine.Sections).
    "auto": Slurm where this machine can start a cluster (Linux, root, slurm-wlm, munge), else the local
    launcher; "local" always the local launcher; "slurm" Slurm, or one line saying what is missing."""
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler={scheduler!r}: one of {', '.join(map(repr, SCHEDULERS))}")
    if scheduler == "slurm" and (lacking := sections.machine.missing("slurm")):
        raise ValueError(f"scheduler='slurm': this machine lacks {lacking}")
    if scheduler == "local":
        sections.skip(CLUSTER_SECTION, "scheduler = 'local' asked for the local launcher")
        chosen = "local"
    else:
        chosen = "slurm" if sections.run(CLUSTER_SECTION, "slurm") else "local"
    print("the jobs run under Slurm: sbatch on a cluster of two nodes started on this machine" if chosen == "slurm"
          else "the jobs run without Slurm: each job's run.sh once per task, on this machine (distlab.slurm.local)")
    return chosen


def run_job(cluster, spec: SlurmSpec, timeout_s: float, env: dict | None = None) -> tuple[int, dict]:
    """(job id, record): sbatch on `cluster` and wait for its sacct record, or, with no cluster (None), the
    same scripts run by the local launcher."""
    if cluster is None:
        return local.run_spec(spec, timeout_s, env=env)
    return submit.run_spec(cluster, spec, timeout_s, env=env)


def resolve_adapter(model_dir: Path, adapter) -> Path | None:
    """"auto": chapter 01's LoRA adapter when it was trained on this base model; a folder; or None."""
    if adapter != "auto":
        return Path(adapter) if adapter else None
    candidate = paths.RUNS_DIR / "01_baseline" / "model"
    cfg = candidate / "adapter_config.json"
    if cfg.is_file() and Path(json.loads(cfg.read_text())["base_model_name_or_path"]).resolve() == model_dir:
        return candidate
    return None


# ---------------------------------------------------------------- the idea, drawn

def draw_pipeline_kv(path: str | Path, provenance: dict, config, micro_batches: int = 3) -> Path:
    """Left: two stages, each with its own decoder layers and one KV cache per micro-batch for those layers
    only; hidden states go from stage 0 to stage 1, the sampled token comes back. Right: when each stage
    works, on ideal stages, with the micro-batches in flight (prefill first, then one decode step each)."""
    layers = split_layers(config.num_hidden_layers, 2)
    fig, (ax, ax_t) = plt.subplots(1, 2, figsize=(14, 4.8), gridspec_kw={"width_ratios": [1.25, 1]})
    ax.set(xlim=(0, 13), ylim=(0, 10), title="who holds what, who sends what to whom")
    for s, x in enumerate((0.1, 7.4)):
        ax.add_patch(Rectangle((x, 1.0), 5.5, 7.6, fc=f"C{s}", alpha=0.12, ec="k"))
        ax.text(x + 2.75, 8.8, f"stage {s}: rank {s}, its own process and device", ha="center", fontsize=8.5,
                weight="bold")
        parts = (["embeddings"] if s == 0 else []) + [f"decoder layer {i}" for i in layers[s]] + (
            ["final norm", "LM head", "greedy: argmax"] if s == 1 else [])
        for k, name in enumerate(parts):
            ax.add_patch(Rectangle((x + 0.2, 7.6 - 0.75 * k), 2.4, 0.6, fc="white", ec="k"))
            ax.text(x + 1.4, 7.9 - 0.75 * k, name, ha="center", va="center", fontsize=7)
        ax.text(x + 4.0, 7.95, f"KV cache of layers\n{layers[s].start}-{layers[s].stop - 1} only", ha="center",
                va="center", fontsize=7)
        for m in range(micro_batches):
            y = 6.4 - 1.25 * m
            ax.add_patch(Rectangle((x + 2.85, y), 2.35, 0.95, fc=MB_COLORS(m), alpha=0.55, ec="k"))
            ax.text(x + 4.02, y + 0.47, f"micro-batch {m}\nK, V: +1 row per token", ha="center", va="center",
                    fontsize=6.5)
    ax.add_patch(FancyArrowPatch((5.6, 6.2), (7.4, 6.2), arrowstyle="-|>", mutation_scale=14, color="C0"))
    ax.text(6.5, 6.4, "hidden\nstates", ha="center", va="bottom", fontsize=7)
    ax.add_patch(FancyArrowPatch((7.4, 2.2), (5.6, 2.2), arrowstyle="-|>", mutation_scale=14, color="C1"))
    ax.text(6.5, 2.4, "next\ntoken ids", ha="center", va="bottom", fontsize=7)
    ax.text(6.5, 0.35, "stage 0 embeds the returned tokens for the next step; a cache never leaves its stage",
            ha="center", fontsize=8)
    ax.axis("off")

    # ideal stages: every forward takes one unit; stage 1 works on micro-batch m while stage 0 takes m + 1
    steps = 3
    for step in range(steps):
        for m in range(micro_batches):
            for s in range(2):
                t = step * micro_batches + m + s
                ax_t.barh(s, 1, left=t, height=0.6, color=MB_COLORS(m), alpha=1.0 if step == 0 else 0.55,
                          edgecolor="black" if step == 0 else "none", lw=0.8)
                ax_t.text(t + 0.5, s, "P" if step == 0 else f"D{step}", ha="center", va="center", fontsize=7)
    ax_t.set_yticks([0, 1], ["stage 0", "stage 1"])
    ax_t.set_ylim(1.6, -0.6)
    ax_t.set(xlabel="time (one unit = one stage forward of one micro-batch)",
             title=f"when: {micro_batches} micro-batches in flight keep both stages busy")
    handles = [Patch(color=MB_COLORS(m), label=f"micro-batch {m}") for m in range(micro_batches)] + [
        Patch(facecolor="white", edgecolor="black", label="P: prefill (whole prompt)"),
        Patch(facecolor="0.85", label="D: decode step (one token)")]
    ax_t.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3)
    fig.tight_layout()
    out = save_figure(fig, path, provenance)
    plt.close(fig)
    return out


# ---------------------------------------------------------------- the KV cache's bytes

def cache_layer_bytes(cache, num_layers: int) -> list[int]:
    """Bytes of keys + values each layer of a transformers DynamicCache holds (0 for a layer it never saw)."""
    out = []
    for i in range(num_layers):
        layer = cache.layers[i] if i < len(cache.layers) else None
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        out.append(sum(t.numel() * t.element_size() for t in (keys, values) if t is not None and t.numel()))
    return out


def kv_formula_bytes(config, layers: int, tokens: int, bytes_per_value: int = 4) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x tokens x bytes."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * layers * config.num_key_value_heads * head_dim * tokens * bytes_per_value


def kv_table(config, stage_layers, layer_bytes: list[int], tokens: int) -> pd.DataFrame:
    """Per stage: its layers, the KV bytes the formula predicts for `tokens` cached tokens, the bytes counted."""
    rows = [{"stage": s, "layers": len(r), "tokens cached": tokens,
             "formula (KiB)": kv_formula_bytes(config, len(r), tokens) / 1024,
             "measured (KiB)": sum(layer_bytes[i] for i in r) / 1024} for s, r in enumerate(stage_layers)]
    return pd.DataFrame(rows).set_index("stage")


# ---------------------------------------------------------------- the jobs

def job_spec(name: str, stages: int, prompts: int, batch, args: list[str], model_dir, job_time: str,
             extra=()) -> SlurmSpec:
    """One pipeline-inference job: one task per stage (3 stages: 3 tasks on the 2 nodes), one CPU each."""
    run_root = paths.RUNS_DIR / "06_slurm"
    return SlurmSpec(name, args=list(args) + ["--num-prompts", str(prompts), "--batch-size", str(batch), *extra],
                     nodes=min(stages, 2), tasks_per_node=1, ntasks=stages if stages > 2 else None, cpus_per_task=1,
                     time=job_time, partition="debug", model_dir=str(model_dir), out_dir=str(run_root),
                     log_dir=str(paths.BUILD_DIR / "slurm" / "logs"),
                     script_dir=str(paths.BUILD_DIR / "slurm" / "jobs" / name),
                     description=f"{stages}-stage pipeline inference, {prompts} prompts")


def plan_jobs(common: list[str], model_dir, job_time: str, stage_counts, strong_prompts: int, prompts_per_stage: int,
              batch_size: int, batch_sizes, sweep_stages: int, wide_models: dict, bench_args: list[str]) -> dict:
    """Every job the chapter submits, in order: strong and weak scaling, the batch sweep (one job), one
    micro-batch at a time, and 1 vs 2 stages on each wide random-init model ({width: model folder}, run with
    `bench_args`)."""
    def spec(name, stages, prompts, batch, extra=(), model=model_dir, args=common):
        return job_spec(name, stages, prompts, batch, args, model, job_time, extra)

    plan = {f"strong-s{n}": spec(f"strong-s{n}", n, strong_prompts, batch_size) for n in stage_counts}
    for n in stage_counts:
        if prompts_per_stage * n != strong_prompts:
            plan[f"weak-s{n}"] = spec(f"weak-s{n}", n, prompts_per_stage * n, batch_size)
    plan["sweep"] = spec("sweep", sweep_stages, strong_prompts, ",".join(map(str, batch_sizes)))
    plan["one-at-a-time"] = spec("one-at-a-time", 2, strong_prompts, batch_size, ["--in-flight", "1"])
    for w, wide in wide_models.items():
        for n, extra in ((1, []), (2, []), (2, ["--in-flight", "1"])):
            tag = f"w{w}-s{n}" + ("-one" if extra else "")
            plan[tag] = spec(tag, n, 8, 2, extra, wide, bench_args)
    return plan


def load_runs(job_ids: dict, batch_sizes) -> dict:
    """Every finished job's outputs (the sweep's batch sizes as sweep-b<N>)."""
    root = paths.RUNS_DIR / "06_slurm"
    runs = {name: outputs.load_run(root / str(j)) for name, j in job_ids.items() if name != "sweep"}
    runs.update({f"sweep-b{b}": outputs.load_run(root / str(job_ids["sweep"]) / f"b{b}") for b in batch_sizes})
    return runs


# ---------------------------------------------------------------- scaling and the batch sweep

def mean_busy(run: dict) -> float:
    """The stages' mean busy fraction: the share of the run each stage spent in its own forwards."""
    return sum(outputs.busy_fraction(s) for s in run["stages"]) / len(run["stages"])


def round_rates(run: dict) -> pd.Series:
    """Tokens/s of each decode round of a run with every micro-batch in flight: round k is decode step k of
    every micro-batch, timed on the last stage from the end of round k - 1's last forward (the prefill's, for
    k = 1) to the end of its own; its tokens are the rows still generating in step k."""
    ends = pd.DataFrame(run["stages"][-1]["events"]).groupby("step")["end"].max().sort_index()
    rows = run["completions"]["new_tokens"]
    steps = ends.index[ends.index >= 1]
    tokens = pd.Series({k: int((rows > k).sum()) for k in steps}, dtype=float)
    return tokens / ends.diff().loc[steps]


def relative_error(run: dict) -> float:
    """The relative standard error of a run's mean time per token over its decode rounds: the spread of the
    rounds (standard deviation over mean) / sqrt(rounds)."""
    per_token = 1 / round_rates(run)
    return float(per_token.std() / per_token.mean() / math.sqrt(len(per_token)))


def scaling_tables(runs: dict, stage_counts, strong_prompts: int, prompts_per_stage: int, batch_sizes,
                   cores: int):
    """strong, weak and batch-sweep tables: tokens/s, latencies, and how busy the stages were. Strong scaling
    adds the ideal speedup (min(stages, cores): one stage's rate on every core the stages can use) and
    `speedup_high`, the speedup plus MARGIN_SE standard errors that the spread of the two runs' decode rounds
    gives (`relative_error`, of the split run and of the 1-stage run, combined)."""
    def row(name, **extra):
        return {**extra, **outputs.latency_stats(runs[name]), "stages_busy": mean_busy(runs[name])}

    strong = pd.DataFrame([row(f"strong-s{n}", stages=n, prompts=strong_prompts) for n in stage_counts])
    strong["speedup"] = strong["tokens_per_s"] / strong["tokens_per_s"].iloc[0]
    errors = [relative_error(runs[f"strong-s{n}"]) for n in stage_counts]
    strong["speedup_high"] = strong["speedup"] * [1 + MARGIN_SE * math.hypot(errors[0], e) for e in errors]
    strong["ideal"] = strong["stages"].clip(upper=cores)
    weak = pd.DataFrame([row(f"weak-s{n}" if f"weak-s{n}" in runs else f"strong-s{n}", stages=n,
                             prompts=prompts_per_stage * n) for n in stage_counts])
    sweep = pd.DataFrame([row(f"sweep-b{b}", batch_size=b, micro_batches=math.ceil(strong_prompts / b))
                          for b in batch_sizes])
    return strong, weak, sweep


SHARED_CLAIM = "6. Strong scaling far below the ideal where stages share cores"


def shared_core_rows(strong: pd.DataFrame, machine, sections) -> pd.DataFrame:
    """The strong-scaling rows whose processes share cores: more than one stage, and more processes (the
    stages and the notebook's kernel, which polls the job) than usable cores (`machine.timing_skip`). The
    claim is recorded in `sections`: run where such rows exist, else skipped with one printed line."""
    shares = strong["stages"].map(lambda n: machine.timing_skip(n + 1) is not None)
    shared = strong[(strong["stages"] > 1) & shares]
    if len(shared):
        sections.run(SHARED_CLAIM)
    else:
        sections.skip(SHARED_CLAIM, f"the stages and this kernel each have a core of their own "
                                    f"({machine.cores} usable cores for at most {strong['stages'].max() + 1} "
                                    "processes): the claim is about shared cores")
    return shared


def plot_scaling(strong: pd.DataFrame, weak: pd.DataFrame, runs: dict, path, provenance: dict,
                 cores: int) -> Path:
    """Strong and weak scaling: tokens/s against stages, with the ideal (one stage's rate x the cores the
    stages can use), and each stage's busy fraction in the strong-scaling runs."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for ax, df, title in ((axes[0], strong, f"strong scaling ({strong['prompts'].iloc[0]} prompts)"),
                          (axes[1], weak, f"weak scaling ({weak['prompts'].iloc[0]} prompts per stage)")):
        ideal = df["tokens_per_s"].iloc[0] * df["stages"].clip(upper=cores)
        ax.plot(df["stages"], df["tokens_per_s"], "o-", label="measured")
        ax.plot(df["stages"], ideal, "k:", label=f"ideal: 1 stage x min(stages, {cores} cores)")
        ax.set(title=title, xlabel="stages", ylabel="tokens/s", xticks=list(df["stages"]))
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    width = 0.8 / strong["stages"].max()
    for n in strong["stages"]:
        busy = [outputs.busy_fraction(s) for s in runs[f"strong-s{n}"]["stages"]]
        axes[2].bar([n + (r - (len(busy) - 1) / 2) * width for r in range(len(busy))], busy, width * 0.9,
                    color=[f"C{r}" for r in range(len(busy))])
    axes[2].legend(handles=[Patch(color=f"C{r}", label=f"stage {r}") for r in range(strong["stages"].max())],
                   fontsize=8, loc="upper right")
    axes[2].set(title="strong scaling: share of the run each stage computes", xlabel="stages",
                ylabel="busy fraction", xticks=list(strong["stages"]), ylim=(0, 1.25))
    fig.tight_layout()
    out = save_figure(fig, path, provenance)
    plt.show()
    return out


def decode_forwards_ms(run: dict) -> list[float]:
    """Per stage, its mean decode forward (ms) over the steps each prompt's per-token latency spans (steps 1
    to the prompt's last token, its micro-batch's forwards), averaged over the prompts as the latency is."""
    rows = [r for r in run["completions"].itertuples() if r.new_tokens > 1]
    out = []
    for stage in run["stages"]:
        took = {(e["mb"], e["step"]): e["end"] - e["start"] for e in stage["events"] if e["kind"] == "decode"}
        per_prompt = [sum(took[(r.micro_batch, k)] for k in range(1, r.new_tokens)) / (r.new_tokens - 1)
                      for r in rows]
        out.append(1e3 * sum(per_prompt) / len(per_prompt))
    return out


def latency_alone(runs: dict) -> pd.Series:
    """One request's token, within the one-at-a-time job (one micro-batch in the 2 stages at a time): each
    stage's decode forward, their sum, the per-token latency, and the hand-offs (the latency minus the
    forwards), all means over the same decode steps; and, for comparison only (another job), the 1-stage
    job's decode forward through every layer over the same steps."""
    alone = runs["one-at-a-time"]
    forwards = decode_forwards_ms(alone)
    latency = 1e3 * outputs.latency_stats(alone)["per_token_s"]
    return pd.Series({"1 stage, another job: forward of all layers": decode_forwards_ms(runs["strong-s1"])[0],
                      **{f"stage {s} forward": ms for s, ms in enumerate(forwards)},
                      "stage forwards, summed": sum(forwards), "hand-offs": latency - sum(forwards),
                      "per-token latency": latency}, name="ms")


def plot_batch_sweep(sweep: pd.DataFrame, stages: int, path, provenance: dict) -> Path:
    """tokens/s and the two latencies against rows per micro-batch, with the micro-batches in flight."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    axes[0].plot(sweep["batch_size"], sweep["tokens_per_s"], "o-", color="C2")
    axes[0].set(title=f"batch sweep ({stages} stages)", xlabel="rows per micro-batch", ylabel="tokens/s")
    axes[1].plot(sweep["batch_size"], sweep["ttft_s"] * 1e3, "o-", label="time to first token")
    axes[1].plot(sweep["batch_size"], sweep["per_token_s"] * 1e3, "s-", label="per-token latency")
    axes[1].set(title="latency: fewer micro-batches in flight, shorter turns", xlabel="rows per micro-batch",
                ylabel="ms")
    for b, mb, y in zip(sweep["batch_size"], sweep["micro_batches"], sweep["per_token_s"] * 1e3):
        axes[1].annotate(f"{mb} in flight", (b, y), textcoords="offset points", xytext=(4, 6), fontsize=7)
    axes[1].legend(fontsize=8)
    # headroom above the highest point and room right of the last, so the "in flight" labels stay inside
    top = max(sweep["ttft_s"].max(), sweep["per_token_s"].max()) * 1e3
    axes[1].set_ylim(0, 1.25 * top)
    for ax in axes:
        ax.set_xticks(list(sweep["batch_size"]))
        ax.margins(x=0.12)
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    out = save_figure(fig, path, provenance)
    plt.show()
    return out


# ---------------------------------------------------------------- memory per stage

def stage_memory(runs: dict, stage_counts, layer_kv_bytes: list[int]) -> pd.DataFrame:
    """Per stage of each split: the parameters the job's stage held, and the KV cache of the prompts for
    that stage's layers (per-layer bytes counted in the by-hand run's caches)."""
    mem = pd.concat([runs[f"strong-s{n}"]["memory"].assign(stages=n) for n in stage_counts], ignore_index=True)
    mem["kv_cache_mib"] = [sum(layer_kv_bytes[i] for i in runs[f"strong-s{r.stages}"]["stages"][r.stage]["layers"])
                           / MIB for r in mem.itertuples()]
    return mem


def plot_stage_memory(mem: pd.DataFrame, path, provenance: dict) -> Path:
    """Stacked bars: parameters held + KV cache, per stage of 1, 2 and 3 stages, against the whole checkpoint."""
    ckpt_mib = mem["checkpoint_mib"].iloc[0]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    labels = [f"{r.stages} st. / stage {r.stage}" for r in mem.itertuples()]
    ax.bar(labels, mem["stage_params_mib"], color="C0", label="parameters")
    ax.bar(labels, mem["kv_cache_mib"], bottom=mem["stage_params_mib"], color="0.3", hatch="//",
           label="KV cache (all prompts in flight)")
    ax.axhline(ckpt_mib, color="black", ls="--", label=f"whole checkpoint: {ckpt_mib:.1f} MiB")
    ax.set(ylabel="MiB held by the stage", title="what each stage holds: its weights and its layers' KV cache")
    ax.tick_params(axis="x", rotation=30)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_ylim(0, (ckpt_mib + mem["kv_cache_mib"].max()) * 1.4)
    fig.tight_layout()
    out = save_figure(fig, path, provenance)
    plt.show()
    return out


# ---------------------------------------------------------------- the stage timeline

def plot_timeline(ax, stages: list[dict], until_s: float | None = None) -> set[int]:
    """Each stage's forwards as bars over time (ms): who works while whom waits. Returns the micro-batches drawn."""
    t0 = min(e["start"] for s in stages for e in s["events"])
    drawn = set()
    for s in stages:
        for e in s["events"]:
            if until_s is not None and e["start"] - t0 > until_s:
                continue
            drawn.add(e["mb"])
            ax.broken_barh([((e["start"] - t0) * 1e3, (e["end"] - e["start"]) * 1e3)], (s["rank"] - 0.4, 0.8),
                           facecolors=MB_COLORS(e["mb"] % 10), alpha=1.0 if e["kind"] == "prefill" else 0.55,
                           edgecolor="black" if e["kind"] == "prefill" else "none", linewidth=0.8)
    ax.set_yticks([s["rank"] for s in stages], [f"stage {s['rank']}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel("time since generation started (ms)")
    return drawn


def plot_timelines(runs: dict, names: dict, path, provenance: dict) -> dict:
    """The first part of each run's timeline, one panel per run, with the colour legend; returns each
    stage's busy fraction per run."""
    ends = {k: max(e["end"] for s in runs[k]["stages"] for e in s["events"]) for k in names}
    window = min(min(ends.values()), 0.6 * max(e["end"] for e in runs[next(iter(names))]["stages"][0]["events"]))
    fig, axes = plt.subplots(len(names), 1, figsize=(12, 2.1 * len(names) + 0.6), sharex=True)
    busy, drawn = {}, set()
    for ax, (name, title) in zip(axes, names.items()):
        drawn |= plot_timeline(ax, runs[name]["stages"], until_s=window)
        busy[name] = [outputs.busy_fraction(s) for s in runs[name]["stages"]]
        ax.set_title(f"{title}: stages busy {', '.join(f'{b:.0%}' for b in busy[name])} of the time", fontsize=10)
    for ax in axes[:-1]:
        ax.set_xlabel("")
    handles = [Patch(color=MB_COLORS(m % 10), label=f"micro-batch {m}") for m in sorted(drawn)] + [
        Patch(facecolor="0.6", edgecolor="black", label="prefill (outlined, solid)"),
        Patch(facecolor="0.6", alpha=0.55, label="decode step (lighter)")]
    # a legend of the last axes (not of the figure) is inside the bounds the provenance stamp goes under
    axes[-1].legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=min(len(handles), 6),
                    fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, provenance)
    plt.show()
    return busy


# ---------------------------------------------------------------- when two stages beat one

def width_ratios(runs: dict, tiny_width: int, bench_widths) -> pd.DataFrame:
    """tokens/s of 2 stages (micro-batches in flight, and one at a time) relative to 1 stage, per width."""
    def ratio(name, base):
        return runs[name]["summary"]["tokens_per_s"] / runs[base]["summary"]["tokens_per_s"]

    tiny = f"{tiny_width} (tiny base)"
    rows = {tiny: {"2 stages, in flight": ratio("strong-s2", "strong-s1"),
                   "2 stages, one at a time": ratio("one-at-a-time", "strong-s1")}}
    for w in bench_widths:
        rows[str(w)] = {"2 stages, in flight": ratio(f"w{w}-s2", f"w{w}-s1"),
                        "2 stages, one at a time": ratio(f"w{w}-s2-one", f"w{w}-s1")}
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.name = "width"
    return table


def plot_width_ratios(table: pd.DataFrame, path, provenance: dict, cores: int) -> Path:
    fig, ax = plt.subplots(figsize=(7, 3.6))
    table.plot.bar(ax=ax, rot=0)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(min(2, cores), color="grey", ls=":", label=f"ideal: min(2 stages, {cores} cores)")
    ax.set(ylabel="tokens/s relative to 1 stage", xlabel="model width (hidden size)", title="2 stages vs 1 stage")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(0, max(2.3, table.values.max() * 1.15))
    fig.tight_layout()
    out = save_figure(fig, path, provenance)
    plt.show()
    return out


# ---------------------------------------------------------------- a stage lost, the job finished by resubmitting it


def stage_loss_demo(cluster, model_dir, *, run_root, log_dir, job_dir, prompts: int = 8, batch_size: int = 2,
                    kill_after: int = 2, max_new_tokens: int = 24, adapter=None, job_time: str = "00:05:00",
                    timeout_s: float = 300, resubmit: str = "sbatch", reference=None) -> dict:
    """A stage lost mid-job, and the job finished by submitting it again.

    Two 2-stage jobs of one resumable script (SlurmSpec(resumable=True): a stable output folder, --resume,
    --requeue), on `cluster` or, where it is None, run by the local launcher (distlab.slurm.local): the run
    whose last stage (rank 1) SIGKILLs itself once `kill_after` micro-batches are written
    (DISTLAB_KILL_AFTER_MICRO_BATCHES), and its resubmission (`resubmit`: "sbatch" submits the script again,
    a new job id; "requeue" runs the same job id again, on a cluster only). Two micro-batches are in flight,
    so micro-batches finish, and are written, one pair after another. The answers are compared with an
    uninterrupted run of the same prompts and micro-batches: one stage in this process (the number of
    stages does not change a greedy answer; the chapter checks that first), or `reference`, a finished
    run's folder. Returns the counts and checks the chapter asserts: which rank the failed job names,
    prompts answered before the kill and by the resubmission, the total against the prompt count, prompts
    answered twice, and whether every answer's tokens equal the uninterrupted run's."""
    if resubmit not in ("sbatch", "requeue"):
        raise ValueError(f"resubmit={resubmit!r}: 'sbatch' or 'requeue'")
    if resubmit == "requeue" and cluster is None:
        raise ValueError("resubmit='requeue' needs a Slurm cluster (scontrol requeue); without one: 'sbatch'")
    run_root, log_dir, job_dir = Path(run_root), Path(log_dir), Path(job_dir)
    args = ["--max-new-tokens", str(max_new_tokens), "--num-prompts", str(prompts), "--batch-size", str(batch_size),
            "--in-flight", "2", *(["--adapter", str(adapter)] if adapter else [])]

    def spec(name):
        return SlurmSpec(name, args=args, nodes=2, tasks_per_node=1, cpus_per_task=1, time=job_time, partition="debug",
                         model_dir=str(model_dir), out_dir=str(run_root), log_dir=str(log_dir),
                         script_dir=str(job_dir / name), resumable=True,
                         description="2-stage pipeline inference that a resubmission finishes")

    env = {"PYTHON": sys.executable}
    shutil.rmtree(run_root / "stage-loss", ignore_errors=True)  # a resumable job skips what it finds there
    if reference is None:
        ref_rows = _uninterrupted_in_process(model_dir, adapter, prompts, batch_size, max_new_tokens)
    else:
        ref_rows = outputs.completions(reference)
    kill = {"DISTLAB_KILL_AFTER_MICRO_BATCHES": str(kill_after), "DISTLAB_KILL_RANK": "1"}
    lost_id, lost_rec = run_job(cluster, spec("stage-loss"), timeout_s, env={**env, **kill})
    failed = re.findall(r"task (\d+): Killed", (log_dir / f"stage-loss-{lost_id}.out").read_text())
    before = outputs.completions(run_root / "stage-loss")
    if resubmit == "requeue":  # the same job id again; Slurm's SLURM_RESTART_COUNT=1 disarms the kill
        again_rec = submit.requeue(cluster, lost_id, timeout_s)
    else:
        _, again_rec = run_job(cluster, spec("stage-loss"), timeout_s, env=env)
    after = outputs.completions(run_root / "stage-loss")
    ids = [json.loads(line)["id"] for line in (run_root / "stage-loss" / COMPLETIONS).read_text().splitlines()]
    summary = json.loads((run_root / "stage-loss" / "summary.json").read_text())
    return {"prompts": prompts, "micro_batches": -(-prompts // batch_size),
            "lost_job": lost_rec["State"],
            "failed_rank": int(failed[0]) if failed else None, "answered_before_kill": len(before),
            "resubmission": f"{resubmit if cluster is not None else 'by the local launcher'}: {again_rec['State']}",
            "answered_by_resubmission": summary["answered_now"], "total_answered": len(after),
            "answered_twice": sum(n - 1 for n in Counter(ids).values()),
            "identical_to_uninterrupted": not outputs.token_mismatches(after, ref_rows)}


def _uninterrupted_in_process(model_dir, adapter, prompts: int, batch_size: int, max_new_tokens: int) -> list[dict]:
    """The same prompts and micro-batches, greedy, as one stage in this process that nobody interrupts."""
    from transformers import AutoConfig  # deferred: transformers is slow to import

    from distlab.inference.batches import micro_batches, read_prompts  # deferred: the stage-loss demo only
    from distlab.inference.engine import Pipeline, Sampling  # deferred: as above
    from distlab.inference.run import completion_rows, repeat_prompts  # deferred: as above
    from distlab.inference.stage import InferenceStage  # deferred: as above
    from distlab.models import load_tokenizer  # deferred: as above
    from distlab.paths import DEMO_PROMPTS  # deferred: as above

    config = AutoConfig.from_pretrained(model_dir, attn_implementation="sdpa")
    stage = InferenceStage(config, range(config.num_hidden_layers), first=True, last=True)
    stage.load(model_dir, adapter)
    tokenizer = load_tokenizer(model_dir)
    batches = micro_batches(tokenizer, repeat_prompts(read_prompts(DEMO_PROMPTS), prompts), batch_size)
    pipe = Pipeline(stage, 0, 1, config, tokenizer.eos_token_id, tokenizer.pad_token_id, Sampling(max_new_tokens))
    return completion_rows(pipe.run(batches), tokenizer)
