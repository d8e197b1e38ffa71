"""Results that survive where only logs do: markers in every rank's log, a strict collector, and
the benchmark table, plots and report (the benchmark-framework seed's pipeline, as a library).

On Kubernetes a finished pod's files are gone; its log is not. So at the end of a run every rank
prints its result as one JSON object between two markers on stdout:

    === DISTLAB_RESULT_START rank=1 ===
    {"schema": "distlab.result/2", "strategy": "fsdp", "rank": 1, ...}
    === DISTLAB_RESULT_END rank=1 ===

`extract_results` reads them back from any log: torchrun's console (`--tee` prefixes each line with
`[defaultN]:`, and ranks interleave), per-rank files, `kubectl logs --timestamps` output. It never
skips anything silently: a START without END (a truncated log), JSON that does not parse, a rank
reported twice, an END without START and a rank that is missing are errors naming the log and
the line. `aggregate` turns runs into one row each (`figures/strategy_metrics.csv`),
`save_plots` draws tokens/s and peak memory per rank (step time and scaling efficiency are tokens/s
restated: they are in the CSV and the report, not drawn again), and
`write_report` writes `figures/BENCHMARK_REPORT.md` with the tables and their provenance.

Every column is one of distlab.results.schema's, computed by schema.summarise from the per-step lists
the records carry (the same function chapter 02 runs on step logs): steady state after
schema.WARMUP_STEPS, the slowest rank's step time, efficiency and communication share as fractions,
peak memory in bytes.
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

from distlab.config import LORA_TARGETS
from distlab.measure.state import STATE_COMPONENTS
from distlab.metrics import read_log
from distlab.planning.plan import plan_memory
from distlab.publish.provenance import (
    device_description,
    git_commit,
    save_figure,
    save_table,
    stamp_text,
    write_sidecar,
)
from distlab.results import schema

# The result record's format (its keys; the columns computed from it are distlab.results.schema's).
# 2: per-step comm_bytes, warmup_steps instead of skip_steps, the rank's own numbers in rank_summary.
SCHEMA = "distlab.result/2"
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


def emit_rank_result(cfg, strategy, log_path, summary, measured_state=None, stream=None):
    """What distlab.train calls on every rank at the end of a run: print this rank's result between
    markers when the run was launched (torchrun, a Kubernetes pod: RANK is set) or when
    DISTLAB_EMIT_RESULT=1; an in-process run (a notebook calling train()) gets its TrainResult instead.
    Returns the record, or None when nothing was printed."""
    if "RANK" not in os.environ and os.environ.get("DISTLAB_EMIT_RESULT") != "1":
        return None
    record = rank_result(cfg, strategy, log_path, summary, measured_state)
    emit_result(record, stream=stream)
    return record


def rank_result(cfg, strategy, log_path: Path | None, summary: Mapping[str, Any],
                measured_state=None) -> dict[str, Any]:
    """This rank's result record, from its own step log (every rank writes one when world > 1).

    The per-step lists (named as in the step log) are what run_metrics summarises over all ranks;
    `rank_summary` holds this rank's own tokens_per_s, step_time_s and comm_share, for a reader of one
    pod's log (NaN for a run no longer than the warm-up). `measured_state`, the MemoryBreakdown the meter
    measured inside a step (with cfg.measure_state; None otherwise), becomes `state_bytes`: the bytes of
    weights, adapters, gradients, optimizer state and buffers this rank owns."""
    steps = read_log(log_path) if log_path is not None and Path(log_path).exists() else []
    dp = strategy.data_parallel_size
    accum = cfg.micro_steps(dp)
    record: dict[str, Any] = {
        "schema": SCHEMA, "run": Path(cfg.output_dir).name, "strategy": strategy.name,
        "mode": "lora" if cfg.lora else "full", "rank": strategy.rank, "world_size": strategy.world_size,
        "data_parallel_size": dp, "model": cfg.model or "distlab-tiny", "device": cfg.device, "dtype": cfg.dtype,
        "micro_batch_size": cfg.micro_batch_size, "grad_accum": accum,
        "global_batch_size": cfg.micro_batch_size * accum * dp, "seq_len": cfg.seq_len, "seed": cfg.seed,
        "lora_r": cfg.lora_r if cfg.lora else None, "warmup_steps": schema.WARMUP_STEPS,
        "steps": [s["step"] for s in steps], "loss": [s["loss"] for s in steps],
        "step_time_s": [s["step_time_s"] for s in steps], "tokens": [s["tokens"] for s in steps],
        "comm_time_s": [s.get("comm_time_s") for s in steps], "comm_bytes": [s.get("comm_bytes") for s in steps],
        "peak_mem_bytes": max([int(summary.get("peak_mem_bytes") or 0)] + [int(s["peak_mem_bytes"]) for s in steps]),
        "final_loss": summary.get("final_loss"), "eval_loss_before": summary.get("eval_loss_before"),
        "eval_loss_after": summary.get("eval_loss_after"),
        "device_name": device_description(), "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    own = schema.summarise({strategy.rank: steps}) if schema.steady(steps) else {}
    record["rank_summary"] = {k: own.get(k, schema.NAN) for k in ("tokens_per_s", "step_time_s", "comm_share")}
    if measured_state is not None:  # activations are not state a rank owns
        record["state_bytes"] = {k: int(getattr(measured_state, k)) for k in STATE_COMPONENTS if k != "activations"}
    return record


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
# pandas, numpy and matplotlib are imported inside the functions that build tables and plots: every
# training rank imports this module to print its result, and on CPU their pages would count in the
# rank's measured peak RSS.

METRICS = ["run", "strategy", "mode", "world_size", "global_batch_size", "steps_averaged", "tokens_per_s",
           "step_time_s", "speedup", "scaling_efficiency", "comm_time_s", "comm_share", "peak_mem_bytes",
           "peak_mem_bytes_per_rank", "mean_loss", "final_loss"]


def _rank_steps(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A rank record's per-step lists as the step records schema.summarise reads."""
    n = len(record["steps"])
    comm = record.get("comm_time_s") or [None] * n
    nbytes = record.get("comm_bytes") or [None] * n
    return [{"step": step, "loss": loss, "tokens": tokens, "step_time_s": seconds, "comm_time_s": c, "comm_bytes": b,
             "peak_mem_bytes": record["peak_mem_bytes"]}
            for step, loss, tokens, seconds, c, b in zip(record["steps"], record["loss"], record["tokens"],
                                                         record["step_time_s"], comm, nbytes)]


def run_metrics(results: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """One run's row from its ranks' records (all ranks must be of the same run): schema.summarise over
    the steps every rank logged. speedup and scaling_efficiency need the other runs (aggregate)."""
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
    summary = schema.summarise({r: _rank_steps(results[r]) for r in ranks}, source=f"run {first.get('run')}")
    return {"run": first.get("run"), "strategy": first["strategy"], "mode": first["mode"],
            "global_batch_size": first.get("global_batch_size"), **summary}


def aggregate(runs: Iterable[Mapping[int, Mapping[str, Any]]]):
    """A DataFrame with one row per run (METRICS columns). scaling_efficiency compares each run with the
    1-rank run of the same mode (LoRA or full) when there is one, else it is NaN."""
    import pandas as pd  # deferred: see the comment above METRICS

    rows = schema.add_scaling([run_metrics(r) for r in runs], same_setup=("mode",))
    return pd.DataFrame(rows, columns=METRICS)


def losses_by_run(runs: Iterable[Mapping[int, Mapping[str, Any]]]):
    """A DataFrame of the training loss per step (rows) and run (columns), from rank 0's records."""
    import pandas as pd  # deferred: see the comment above METRICS

    cols = {}
    for results in runs:
        rec = results[min(results)]
        cols[rec["run"]] = pd.Series(rec["loss"], index=rec["steps"])
    return pd.DataFrame(cols).rename_axis("step")


def save_metrics(df, figures_dir: str | Path, provenance: dict, name: str = "strategy_metrics.csv") -> Path:
    return save_table(df, Path(figures_dir) / name, provenance)


# file names kept from the seed's benchmark framework
PLOTS = {"tokens_per_s": "strategy_tokens_per_sec.png", "peak_mem_bytes_per_rank": "strategy_peak_memory.png"}


def _label(row) -> str:
    return f"{row['strategy']}\nx{row['world_size']}"


def save_plots(df, figures_dir: str | Path, provenance: dict, memory_label: str = "peak memory per rank (MiB)"
               ) -> list[Path]:
    """Throughput and peak memory per rank, one bar per run, grouped by mode (LoRA / full). `memory_label`
    says what the memory is (the process's peak RSS on CPU, the allocator's peak on a GPU)."""
    import matplotlib.pyplot as plt  # deferred: see the comment above METRICS
    import numpy as np  # deferred: see the comment above METRICS

    figures_dir = Path(figures_dir)
    modes = list(dict.fromkeys(df["mode"]))
    out = []
    specs = [("tokens_per_s", "tokens/s (all ranks)", "throughput"),
             ("peak_mem_bytes_per_rank", memory_label, "peak memory per rank")]
    for key, ylabel, title in specs:
        fig, axes = plt.subplots(1, len(modes), figsize=(4.2 * len(modes), 3.3), squeeze=False)
        for ax, mode in zip(axes[0], modes):
            sub = df[df["mode"] == mode].reset_index(drop=True)
            x = np.arange(len(sub))
            if key == "peak_mem_bytes_per_rank":
                per_rank = [[b / 2**20 for b in schema.parse_per_rank(s)] for s in sub[key]]
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
            ax.set_xticks(x, [_label(r) for _, r in sub.iterrows()], fontsize=7)
            ax.set_title(f"{title}: {mode}", fontsize=9)
            ax.set_ylabel(ylabel, fontsize=8)
        fig.tight_layout()
        out.append(save_figure(fig, figures_dir / PLOTS[key], provenance))
        plt.close(fig)
    return out


def _md_table(df, floatfmt: str = ".4g") -> str:
    return df.to_markdown(index=False, floatfmt=floatfmt)


REPORT_COLUMNS = ["strategy", "world_size", "tokens_per_s", "step_time_s", "scaling_efficiency", "comm_share",
                  "peak_mem_bytes", "mean_loss"]


def write_report(df, figures_dir: str | Path, provenance: dict, *, title: str = "Strategy benchmark",
                 sections: Mapping[str, Any] | None = None, notes: Iterable[str] = (),
                 name: str = "BENCHMARK_REPORT.md") -> Path:
    """figures/BENCHMARK_REPORT.md: the metrics per mode, peak memory per rank, extra `sections`
    (title -> DataFrame or Markdown text), the plots' file names, the columns' definitions (from the
    schema) and the provenance. Headings are level 4 so that the report nests under the book's results
    page, which includes it."""
    figures_dir = Path(figures_dir)
    lines = [f"**{title}**", "", f"_Provenance: {stamp_text(provenance)}_", "",
             "Generated by `distlab.results.collect.write_report` from the result JSON every rank printed between "
             "`DISTLAB_RESULT_START`/`END` markers in its log.", ""]
    for mode in dict.fromkeys(df["mode"]):
        sub = df[df["mode"] == mode]
        lines += [f"#### {'LoRA' if mode == 'lora' else 'Full fine-tuning'}: metrics", "",
                  _md_table(sub[REPORT_COLUMNS]), ""]
    lines += ["#### Peak memory per rank (bytes)", "", _md_table(df[["run", "peak_mem_bytes_per_rank"]]), ""]
    for heading, content in (sections or {}).items():
        text = content if isinstance(content, str) else _md_table(content)
        lines += [f"#### {heading}", "", text, ""]
    lines += ["#### Plots", "", ", ".join(f"`{p}`" for p in PLOTS.values()) + " (next to this report).", ""]
    lines += ["#### Definitions", "", f"Steady state: every step after the first {schema.WARMUP_STEPS} "
              "(warm-up) steps of each run.", ""]
    lines += [f"- {col}: {schema.COLUMNS[col]}." for col in REPORT_COLUMNS[2:] + ["peak_mem_bytes_per_rank"]]
    lines += [""] + [f"- {note}" for note in notes]
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
    "state_bytes", from runs with measure_state) next to distlab.planning.plan.plan_memory's prediction
    for that strategy, world size and rank, in MiB, with their ratio."""
    import pandas as pd  # deferred: see the comment above METRICS

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
    import pandas as pd  # deferred: see the comment above METRICS

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
