"""Result records read back from logs alone, strictly: the other side of distlab.results.recorder.

`extract_results` reads the START/END blocks from any log: torchrun's console (`--tee` prefixes each
line with `[defaultN]:`, and ranks interleave), per-rank files, `kubectl logs --timestamps` output. It
never skips anything silently: a START without END (a truncated log), JSON that does not parse, a rank
reported twice, an END without START and a rank that is missing are errors naming the log and the
line. `collect_run` reads a run folder (its console.log, or torchrun's per-rank logs).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_START_RE = re.compile(r"=== DISTLAB_RESULT_START rank=(\d+) ===")
_END_RE = re.compile(r"=== DISTLAB_RESULT_END rank=(\d+) ===")
# Decorations in front of a log line: a timestamp (kubectl logs --timestamps, RFC 3339) and
# torchrun's --tee prefix, which also says which rank's stream the line belongs to.
_TIMESTAMP_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)?\s")
_STREAM_RE = re.compile(r"^\[(?:default|rank)\d+\]:")


class ResultLogError(ValueError):
    """A log whose result markers cannot be trusted; the message names the log and line."""


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
            if isinstance(record.get("rank_summary"), dict):
                # Strict JSON has no NaN: a number the rank could not measure was written as null.
                record["rank_summary"] = {k: math.nan if v is None else v for k, v in record["rank_summary"].items()}
            if isinstance(record.get("loss"), list):
                # Every logged step has a loss, so a null in the list is one that was not finite (diverged).
                record["loss"] = [math.nan if v is None else v for v in record["loss"]]
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
    """Results of one launched run: from `<run>/console.log` (what distlab.launch.local.launch_training saves),
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


def collect_sweep(launch_dir: str | Path, world_size: int) -> dict[str, dict[int, dict[str, Any]]]:
    """Results of every run of one distlab.launch.local.launch_sweep, {run name: {rank: record}}, from the
    launch's console log: every rank prints one result per run, in run order, so the i-th result of each
    rank's stream (torchrun's `[defaultN]:` prefix) belongs to the i-th run."""
    console = Path(launch_dir) / "console.log"
    streams: dict[int, list[list[str]]] = {}
    for line in console.read_text(encoding="utf-8", errors="replace").splitlines():
        m = re.match(r"^\[default(\d+)\]:", line)
        if m:
            chunks = streams.setdefault(int(m.group(1)), [[]])
            chunks[-1].append(line)
            if "DISTLAB_RESULT_END" in line:
                chunks.append([])
    out = {}
    for i in range(len(streams.get(0, [[]])) - 1):
        text = "\n".join(x for r in range(world_size) for x in streams[r][i]) + "\n"
        results = extract_results(text, world_size, name=f"{console} (run {i + 1})")
        out[results[0]["run"]] = results
    return out
