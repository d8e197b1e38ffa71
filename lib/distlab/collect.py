"""Results that survive where only logs do: markers in every rank's log, a strict collector, and
the benchmark table, plots and report (the benchmark-framework seed's pipeline, as a library).

On Kubernetes a finished pod's files are gone; its log is not. So at the end of a run every rank
prints its result as one JSON object between two markers on stdout:

    === DISTLAB_RESULT_START rank=1 ===
    {"schema": "distlab.result/1", "strategy": "fsdp", "rank": 1, ...}
    === DISTLAB_RESULT_END rank=1 ===

`extract_results` reads them back from any log: torchrun's console (`--tee` prefixes each line with
`[defaultN]:`, and ranks interleave), per-rank files, `kubectl logs --timestamps` output. It never
skips anything silently: a START without END (a truncated log), JSON that does not parse, a rank
reported twice, an END without START and a rank that is missing are errors naming the log and
the line. `aggregate` turns runs into one row each (`figures/strategy_metrics.csv`),
`save_plots` draws tokens/s, step time, peak memory per rank and scaling efficiency, and
`write_report` writes `figures/BENCHMARK_REPORT.md` with the tables and their provenance.

Definitions (steady state: the first `skip_steps` optimizer steps are left out):
  tokens_per_sec          real (non-padding) tokens of the global batch / step time, all ranks together
  mean_step_time_sec      mean over steps of the slowest rank's step time
  peak_mem                per rank: CUDA allocator peak on GPU, peak RSS of the process on CPU
  mean_loss               mean training loss over all logged steps (the same on every rank)
  scaling_efficiency_pct  tokens/s(k ranks) / (k x tokens/s(1 rank, same mode)) x 100
  comm_time_share_pct     time inside collectives / step time (measured with measure_comm, which
                          waits for each collective as it is issued: exposed communication)
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

SCHEMA = "distlab.result/1"
START = "=== DISTLAB_RESULT_START rank={rank} ==="
END = "=== DISTLAB_RESULT_END rank={rank} ==="
_START_RE = re.compile(r"=== DISTLAB_RESULT_START rank=(\d+) ===")
_END_RE = re.compile(r"=== DISTLAB_RESULT_END rank=(\d+) ===")
# Decorations in front of a log line: a timestamp (kubectl logs --timestamps, RFC 3339) and
# torchrun's --tee prefix, which also says which rank's stream the line belongs to.
_TIMESTAMP_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)?\s")
_STREAM_RE = re.compile(r"^\[(?:default|rank)\d+\]:")


class ResultLogError(ValueError):
    """A log whose result markers cannot be trusted; the message names the log and line."""


# ----------------------------------------------------------------------------- emitting

def emit_result(record: Mapping[str, Any], rank: int | None = None, stream=None) -> None:
    """Print `record` as one JSON line between this rank's START/END markers, in one write."""
    rank = int(record.get("rank", 0) if rank is None else rank)
    text = json.dumps(dict(record), default=str, separators=(",", ":"), allow_nan=True)
    stream = stream or sys.stdout
    stream.write(f"{START.format(rank=rank)}\n{text}\n{END.format(rank=rank)}\n")
    stream.flush()


def emit_rank_result(cfg, strategy, model, optimizer, log_path, summary, probe=None, stream=None):
    """What distlab.train calls on every rank at the end of a run: print this rank's result between
    markers when the run was launched (torchrun, a Kubernetes pod: RANK is set) or when
    DISTLAB_EMIT_RESULT=1; an in-process run (a notebook calling train()) gets its TrainResult instead.
    Returns the record, or None when nothing was printed."""
    if "RANK" not in os.environ and os.environ.get("DISTLAB_EMIT_RESULT") != "1":
        return None
    record = rank_result(cfg, strategy, model, optimizer, log_path, summary, probe=probe)
    emit_result(record, stream=stream)
    return record


def _steady(values: list, skip: int) -> list:
    return values[skip:] if len(values) > skip else values


def _summarise(steps: list[dict[str, Any]], skip_steps: int) -> dict[str, Any]:
    times = _steady([s["step_time_s"] for s in steps], skip_steps)
    tokens = _steady([s["tokens"] for s in steps], skip_steps)
    comm = _steady([s.get("comm_time_s") for s in steps], skip_steps)
    out = {"tokens_per_sec": sum(tokens) / sum(times) if times else float("nan"),
           "mean_step_time_sec": sum(times) / len(times) if times else float("nan"),
           "mean_loss": sum(s["loss"] for s in steps) / len(steps) if steps else float("nan")}
    if comm and all(c is not None for c in comm):
        out["comm_time_share_pct"] = 100 * sum(comm) / sum(times)
    return out


def rank_result(cfg, strategy, model, optimizer, log_path: Path | None, summary: Mapping[str, Any],
                probe=None, skip_steps: int = 1) -> dict[str, Any]:
    """This rank's result record, from its own step log (every rank writes one when world > 1).

    With cfg.measure_state it carries `state_bytes`, the bytes of weights, adapters, gradients and
    optimizer state this rank owns: measured inside the optimizer step by strategies that keep
    their own (fsdp, zero2, zero3: `strategy.measured_state`), otherwise by `probe` = (choice,
    train_data): one more forward and backward on the first micro-batch, measured, then the
    gradients are dropped again. Every rank calls this (the probe is collective)."""
    from . import provenance
    from .metrics import read_log

    steps = read_log(log_path) if log_path is not None and Path(log_path).exists() else []
    dp = strategy.data_parallel_size
    accum = cfg.micro_steps(dp)
    record: dict[str, Any] = {
        "schema": SCHEMA, "run": Path(cfg.output_dir).name, "strategy": strategy.name,
        "mode": "lora" if cfg.lora else "full", "rank": strategy.rank, "world_size": strategy.world_size,
        "data_parallel_size": dp, "model": cfg.model or "distlab-tiny", "device": cfg.device, "dtype": cfg.dtype,
        "micro_batch_size": cfg.micro_batch_size, "grad_accum": accum,
        "global_batch_size": cfg.micro_batch_size * accum * dp, "seq_len": cfg.seq_len, "seed": cfg.seed,
        "lora_r": cfg.lora_r if cfg.lora else None, "skip_steps": skip_steps,
        "steps": [s["step"] for s in steps], "loss": [s["loss"] for s in steps],
        "step_time_s": [s["step_time_s"] for s in steps], "tokens": [s["tokens"] for s in steps],
        "comm_time_s": [s.get("comm_time_s") for s in steps],
        "peak_mem_bytes": max([int(summary.get("peak_mem_bytes") or 0)] + [int(s["peak_mem_bytes"]) for s in steps]),
        "final_loss": summary.get("final_loss"), "eval_loss_before": summary.get("eval_loss_before"),
        "eval_loss_after": summary.get("eval_loss_after"),
        "device_name": provenance.device_description(), "commit": provenance.git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    record.update(_summarise(steps, skip_steps))
    if getattr(cfg, "measure_state", False):
        measured = getattr(strategy, "measured_state", None)
        if measured is None and probe is not None:
            measured = _probe_state(cfg, strategy, model, optimizer, *probe)
        if measured is not None:
            from .memory import _COMPONENTS

            record["state_bytes"] = {k: int(getattr(measured, k)) for k in _COMPONENTS if k != "activations"}
    return record


def _probe_state(cfg, strategy, model, optimizer, choice, train_data):
    """Gradients exist only inside a step; for strategies that do not measure there, make them
    once more on one micro-batch (the same on every rank), measure, and drop them."""
    import torch

    from .memory import measure_owned_state

    batch = train_data.batch(list(range(min(cfg.micro_batch_size, len(train_data)))))
    tokens = strategy.all_reduce_sum(torch.tensor([float(batch["n_label_tokens"])], device=choice.device))
    model.train()
    strategy.forward_backward(model, [batch], choice, int(tokens.item()))
    measured = measure_owned_state(model, optimizer)
    optimizer.zero_grad(set_to_none=True)
    return measured


# ----------------------------------------------------------------------------- extracting

@dataclass
class _Block:
    rank: int
    line: int
    body: list[str] = field(default_factory=list)


def _read_source(source) -> tuple[str, str]:
    """(label, text) of a log given as a path or as its text (a one-line string is a path unless it
    holds a marker)."""
    if isinstance(source, str) and ("\n" in source or "DISTLAB_RESULT" in source):
        return "<log text>", source
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such log file")
    return str(path), path.read_text(encoding="utf-8", errors="replace")


def _expected(expected_ranks) -> list[int] | None:
    if expected_ranks is None:
        return None
    if isinstance(expected_ranks, int):
        return list(range(expected_ranks))
    return sorted(int(r) for r in expected_ranks)


def extract_results(source, expected_ranks=None, name: str | None = None) -> dict[int, dict[str, Any]]:
    """rank -> result record from one log (a path, or the log's text) or several (a list).

    expected_ranks: an int (world size: ranks 0..n-1) or the ranks that must be there. Raises
    ResultLogError for a START without END, an END without START, markers of different ranks
    paired, JSON that does not parse, a record whose "rank" disagrees with its markers, a rank
    reported twice, and (with expected_ranks) a missing or unexpected rank."""
    if isinstance(source, (list, tuple)):
        results: dict[int, dict[str, Any]] = {}
        where: dict[int, str] = {}
        for item in source:
            label, _ = _read_source(item)
            for rank, rec in extract_results(item).items():
                if rank in results:
                    raise ResultLogError(f"rank {rank} reported twice: in {where[rank]} and in {label}")
                results[rank], where[rank] = rec, label
        label = name or ", ".join(where.values()) or "<no logs>"
        return _check_ranks(results, expected_ranks, label)

    label, text = _read_source(source)
    label = name or label
    results, where = {}, {}
    open_blocks: dict[str, _Block] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = _TIMESTAMP_RE.sub("", raw.rstrip("\r"), count=1)
        m = _STREAM_RE.match(line)
        stream, rest = (m.group(0), line[m.end():]) if m else ("", line)
        start, end = _START_RE.search(rest), _END_RE.search(rest)
        if start:
            rank = int(start.group(1))
            if stream in open_blocks:
                b = open_blocks[stream]
                raise ResultLogError(f"{label}:{b.line}: result of rank {b.rank} has a START marker but no END "
                                     f"before the next START (line {lineno}): a truncated or interleaved log")
            open_blocks[stream] = _Block(rank, lineno)
        elif end:
            rank = int(end.group(1))
            block = open_blocks.pop(stream, None)
            if block is None:
                raise ResultLogError(f"{label}:{lineno}: END marker of rank {rank} without a START marker")
            if block.rank != rank:
                raise ResultLogError(f"{label}:{block.line}-{lineno}: START of rank {block.rank} closed by END of "
                                     f"rank {rank}")
            record = _parse_body(block.body, label, block.line, lineno, rank)
            if not isinstance(record, dict):
                raise ResultLogError(f"{label}:{block.line}: result of rank {rank} is a {type(record).__name__}, "
                                     "not a JSON object")
            if "rank" in record and int(record["rank"]) != rank:
                raise ResultLogError(f"{label}:{block.line}: markers say rank {rank}, the record says rank "
                                     f"{record['rank']}")
            if rank in results:
                raise ResultLogError(f"{label}:{block.line}: rank {rank} reported twice (first at line {where[rank]})")
            results[rank], where[rank] = record, block.line
        elif stream in open_blocks:
            open_blocks[stream].body.append(rest)
    if open_blocks:
        b = min(open_blocks.values(), key=lambda b: b.line)
        raise ResultLogError(f"{label}:{b.line}: result of rank {b.rank} has a START marker but the log ends "
                             "before its END marker (truncated log?)")
    return _check_ranks(results, expected_ranks, label)


def _parse_body(body: list[str], label: str, first: int, last: int, rank: int):
    """The JSON between a rank's markers: all body lines together (the record may be pretty-printed),
    or, when another thread of the rank printed inside the block (stderr merged by --tee), the one
    body line that is a JSON object."""
    text = "\n".join(body).strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        error = e
    objects = []
    for line in body:
        if line.lstrip().startswith("{"):
            try:
                objects.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    if len(objects) == 1:
        return objects[0]
    shown = text[:80] + ("..." if len(text) > 80 else "")
    raise ResultLogError(f"{label}:{first}-{last}: result of rank {rank} is not valid JSON ({error.msg} at "
                         f"character {error.pos}; truncated?): {shown!r}") from error


def _check_ranks(results, expected_ranks, label):
    expected = _expected(expected_ranks)
    if expected is not None:
        missing = [r for r in expected if r not in results]
        extra = [r for r in results if r not in expected]
        if missing or extra:
            found = ", ".join(map(str, sorted(results))) or "none"
            parts = [f"missing rank(s) {', '.join(map(str, missing))}"] if missing else []
            parts += [f"unexpected rank(s) {', '.join(map(str, sorted(extra)))}"] if extra else []
            raise ResultLogError(f"{label}: {'; '.join(parts)} (expected {', '.join(map(str, expected))}; "
                                 f"found {found})")
    return dict(sorted(results.items()))


def rank_logs(run_dir: str | Path) -> list[Path]:
    """torchrun's per-rank stdout files of a run's newest launch, last attempt:
    <run>/torchrun/<run id>/attempt_<k>/<local rank>/stdout.log."""
    root = Path(run_dir) / "torchrun"
    launches = sorted((p for p in root.glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
    if not launches:
        return []
    attempts = sorted(launches[-1].glob("attempt_*"), key=lambda p: int(p.name.split("_")[1]))
    if not attempts:
        return []
    return sorted(attempts[-1].glob("*/stdout.log"), key=lambda p: int(p.parent.name))


def collect_run(run_dir: str | Path, expected_ranks=None, source: str = "auto") -> dict[int, dict[str, Any]]:
    """Results of one launched run: from `<run>/console.log` (what jobs.launch_training saves),
    or from torchrun's per-rank logs (source="ranks"; "auto" falls back to them without a console)."""
    run_dir = Path(run_dir)
    console = run_dir / "console.log"
    if source == "console" or (source == "auto" and console.exists()):
        if not console.exists():
            raise ResultLogError(f"{console}: no console log")
        return extract_results(console, expected_ranks)
    logs = rank_logs(run_dir)
    if not logs:
        raise ResultLogError(f"{run_dir}: no console.log and no per-rank logs under torchrun/")
    return extract_results(logs, expected_ranks)


# ----------------------------------------------------------------------------- aggregating

METRICS = ["run", "strategy", "mode", "world_size", "global_batch_size", "steps", "tokens_per_sec",
           "mean_step_time_sec", "peak_mem_mib_max", "peak_mem_mib_per_rank", "mean_loss", "final_loss",
           "scaling_efficiency_pct", "comm_time_share_pct"]


def run_metrics(results: Mapping[int, Mapping[str, Any]], skip_steps: int | None = None) -> dict[str, Any]:
    """One run's row from its ranks' records (all ranks must be of the same run)."""
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
    skip = first.get("skip_steps", 1) if skip_steps is None else skip_steps
    # Steps every rank logged (after a resume, ranks other than 0 log only the new segment).
    by_rank = {r: {step: i for i, step in enumerate(results[r]["steps"])} for r in ranks}
    common = sorted(set.intersection(*(set(m) for m in by_rank.values())))
    n = len(common)

    def at(r, key, step):
        return results[r][key][by_rank[r][step]]

    steps = [{"step": step, "loss": at(ranks[0], "loss", step), "tokens": at(ranks[0], "tokens", step),
              # the step ends for everyone when the slowest rank is done
              "step_time_s": max(at(r, "step_time_s", step) for r in ranks),
              "comm_time_s": (None if any(at(r, "comm_time_s", step) is None for r in ranks)
                              else sum(at(r, "comm_time_s", step) for r in ranks) / len(ranks))}
             for step in common]
    peaks = [results[r]["peak_mem_bytes"] / 2**20 for r in ranks]
    row = {"run": first.get("run"), "strategy": first["strategy"], "mode": first["mode"], "world_size": world,
           "global_batch_size": first.get("global_batch_size"), "steps": n, **_summarise(steps, skip),
           "final_loss": first.get("final_loss"), "peak_mem_mib_max": max(peaks),
           "peak_mem_mib_per_rank": ";".join(f"{p:.0f}" for p in peaks)}
    row.setdefault("comm_time_share_pct", float("nan"))
    return row


def aggregate(runs: Iterable[Mapping[int, Mapping[str, Any]]], skip_steps: int | None = None):
    """A DataFrame with one row per run (METRICS columns). scaling_efficiency_pct compares each run
    with the 1-rank run of the same mode (LoRA or full) when there is one, else it is NaN."""
    import pandas as pd

    df = pd.DataFrame([run_metrics(r, skip_steps) for r in runs])
    if df.empty:
        return pd.DataFrame(columns=METRICS)
    df["scaling_efficiency_pct"] = float("nan")
    for mode, group in df.groupby("mode"):
        base = group[group["world_size"] == 1]
        if not base.empty:
            tps1 = float(base["tokens_per_sec"].iloc[0])
            sel = df["mode"] == mode
            df.loc[sel, "scaling_efficiency_pct"] = 100 * df.loc[sel, "tokens_per_sec"] / (df.loc[sel, "world_size"] * tps1)
    return df[METRICS]


def losses_by_run(runs: Iterable[Mapping[int, Mapping[str, Any]]]):
    """A DataFrame of the training loss per step (rows) and run (columns), from rank 0's records."""
    import pandas as pd

    cols = {}
    for results in runs:
        rec = results[min(results)]
        cols[rec["run"]] = pd.Series(rec["loss"], index=rec["steps"])
    return pd.DataFrame(cols).rename_axis("step")


def save_metrics(df, figures_dir: str | Path, provenance: dict, name: str = "strategy_metrics.csv") -> Path:
    from .provenance import save_table

    return save_table(df, Path(figures_dir) / name, provenance)


PLOTS = {"tokens_per_sec": "strategy_tokens_per_sec.png", "mean_step_time_sec": "strategy_step_time.png",
         "peak_mem": "strategy_peak_memory.png", "scaling_efficiency_pct": "strategy_scaling_efficiency.png"}


def _label(row) -> str:
    return f"{row['strategy']}\nx{row['world_size']}"


def save_plots(df, figures_dir: str | Path, provenance: dict) -> list[Path]:
    """The seed's four plots, one bar per run, grouped by mode (LoRA / full)."""
    import matplotlib.pyplot as plt
    import numpy as np

    from .provenance import save_figure

    figures_dir = Path(figures_dir)
    modes = list(dict.fromkeys(df["mode"]))
    out = []
    specs = [("tokens_per_sec", "tokens/s (all ranks)", "throughput"),
             ("mean_step_time_sec", "seconds per optimizer step", "step time"),
             ("peak_mem", "peak memory per rank (MiB)", "peak memory per rank"),
             ("scaling_efficiency_pct", "% of linear scaling vs 1 rank", "scaling efficiency")]
    for key, ylabel, title in specs:
        fig, axes = plt.subplots(1, len(modes), figsize=(4.2 * len(modes), 3.3), squeeze=False)
        for ax, mode in zip(axes[0], modes):
            sub = df[df["mode"] == mode].reset_index(drop=True)
            x = np.arange(len(sub))
            if key == "peak_mem":
                per_rank = [[float(v) for v in str(s).split(";")] for s in sub["peak_mem_mib_per_rank"]]
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
                if key == "scaling_efficiency_pct":
                    ax.axhline(100, color="0.6", ls="--", lw=1)
            ax.set_xticks(x, [_label(r) for _, r in sub.iterrows()], fontsize=7)
            ax.set_title(f"{title}: {mode}", fontsize=9)
            ax.set_ylabel(ylabel, fontsize=8)
        fig.tight_layout()
        out.append(save_figure(fig, figures_dir / PLOTS[key], provenance))
        plt.close(fig)
    return out


def _md_table(df, floatfmt: str = ".4g") -> str:
    return df.to_markdown(index=False, floatfmt=floatfmt)


def write_report(df, figures_dir: str | Path, provenance: dict, *, title: str = "Strategy benchmark",
                 sections: Mapping[str, Any] | None = None, notes: Iterable[str] = (),
                 name: str = "BENCHMARK_REPORT.md") -> Path:
    """figures/BENCHMARK_REPORT.md: the metrics per mode, peak memory per rank, extra `sections`
    (title -> DataFrame or Markdown text), the plots' file names and the provenance. Headings are
    level 4 so that the report nests under the book's results page, which includes it."""
    from .provenance import stamp_text, write_sidecar

    figures_dir = Path(figures_dir)
    lines = [f"**{title}**", "", f"_Provenance: {stamp_text(provenance)}_", "",
             "Generated by `distlab.collect.write_report` from the result JSON every rank printed between "
             "`DISTLAB_RESULT_START`/`END` markers in its log.", ""]
    cols = ["strategy", "world_size", "tokens_per_sec", "mean_step_time_sec", "peak_mem_mib_max", "mean_loss",
            "scaling_efficiency_pct", "comm_time_share_pct"]
    for mode in dict.fromkeys(df["mode"]):
        sub = df[df["mode"] == mode]
        lines += [f"#### {'LoRA' if mode == 'lora' else 'Full fine-tuning'}: metrics", "",
                  _md_table(sub[cols]), ""]
    lines += ["#### Peak memory per rank (MiB)", "", _md_table(df[["run", "peak_mem_mib_per_rank"]]), ""]
    for heading, content in (sections or {}).items():
        text = content if isinstance(content, str) else _md_table(content)
        lines += [f"#### {heading}", "", text, ""]
    lines += ["#### Plots", "", ", ".join(f"`{p}`" for p in PLOTS.values()) + " (next to this report).", ""]
    lines += ["#### Definitions", "",
              "- tokens_per_sec: real tokens of the global batch per second, all ranks together (steady state).",
              "- mean_step_time_sec: mean of the slowest rank's time per optimizer step.",
              "- peak_mem: per rank; CUDA allocator peak on GPUs, peak RSS of the process on CPU (which includes "
              "the Python runtime and libraries).",
              "- scaling_efficiency_pct: tokens/s over (ranks x tokens/s of the 1-rank run of the same mode).",
              "- comm_time_share_pct: time spent inside collectives, each waited for as issued, over step time.", ""]
    for note in notes:
        lines += [f"- {note}"]
    path = figures_dir / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines).rstrip() + "\n")
    write_sidecar(path, provenance)
    return path


# ----------------------------------------------------------------------------- comparisons

STATE_PARTS = ("weights", "adapter_weights", "gradients", "optimizer_state")


def state_vs_plan(runs: Iterable[Mapping[int, Mapping[str, Any]]], config, *, dtype: str | None = None,
                  lora_targets=None):
    """One row per run, rank and component: the bytes the rank measured it owns (record
    "state_bytes", from runs with measure_state) next to distlab.memory.plan_memory's prediction
    for that strategy, world size and rank, in MiB, with their ratio."""
    import pandas as pd

    from .config import LORA_TARGETS
    from .memory import plan_memory

    rows = []
    for results in runs:
        for rank, rec in sorted(results.items()):
            measured = rec.get("state_bytes")
            if not measured:
                raise ValueError(f"run {rec.get('run')} rank {rank}: no state_bytes (run it with measure_state=True)")
            plan = plan_memory(config, strategy=rec["strategy"], world_size=rec["world_size"], rank=rank,
                               dtype=dtype, lora_r=rec.get("lora_r") if rec["mode"] == "lora" else None,
                               lora_targets=lora_targets or LORA_TARGETS)
            for part in STATE_PARTS:
                m, p = measured[part], getattr(plan, part)
                rows.append({"strategy": rec["strategy"], "mode": rec["mode"], "world_size": rec["world_size"],
                             "rank": rank, "component": part, "measured_mib": m / 2**20, "planned_mib": p / 2**20,
                             "planned / measured": (p / m) if m else (1.0 if p == 0 else float("inf"))})
    return pd.DataFrame(rows)


def loss_agreement(runs: Iterable[Mapping[int, Mapping[str, Any]]], reference: str = "ddp"):
    """Per run: the largest relative difference of its loss curve from the reference strategy's run
    of the same mode (rank 0's records; the loss is all-reduced, the same on every rank)."""
    import pandas as pd

    recs = [r[min(r)] for r in runs]
    refs = {rec["mode"]: rec for rec in recs if rec["strategy"] == reference}
    rows = []
    for rec in recs:
        ref = refs.get(rec["mode"])
        if ref is None:
            raise ValueError(f"no {reference} run of mode {rec['mode']} to compare {rec['run']} with")
        if rec["steps"] != ref["steps"]:
            raise ValueError(f"{rec['run']} logged steps {rec['steps']}, {ref['run']} logged {ref['steps']}")
        diff = max(abs(a - b) / abs(b) for a, b in zip(rec["loss"], ref["loss"]))
        rows.append({"run": rec["run"], "strategy": rec["strategy"], "mode": rec["mode"],
                     "world_size": rec["world_size"], "steps": len(rec["steps"]), "final_loss": rec["loss"][-1],
                     f"max rel. diff vs {reference}": diff})
    return pd.DataFrame(rows)
