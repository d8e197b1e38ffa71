"""Completions that survive a lost stage: an append-only JSONL log written one micro-batch at a time, and
what a resubmitted job still has to do.

The last stage appends a finished micro-batch's rows with ONE write() on a file opened O_APPEND, then
fsync()s it before the next micro-batch can finish: after a crash (a SIGKILL, a lost node) the file holds
whole lines for every micro-batch written before, and at most one torn line at its very end, the write
that was cut. Reading it back, only complete lines (ending in a newline) are completions; an unfinished
LAST line is dropped, named in one line, and cut off the file before anything is appended again. A
broken line anywhere else, or one prompt id twice, is not a crash artefact: reading refuses the file.

A resumed run must answer the remaining prompts exactly as the first run would have: the same prompts
in the same micro-batches (a prompt's greedy tokens can depend on its neighbours' padding; a sampled
micro-batch's random generator is seeded by its index). So the micro-batches are rebuilt from the whole
prompt list as before and only those whose every prompt is answered are skipped; a micro-batch with a
row missing (the torn line) runs again and only its missing rows are appended. The settings that decide
the tokens are kept beside the log (run_settings.json) and a resubmission with other settings is refused
rather than mixed into the same file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from distlab.jsonio import strict_json

COMPLETIONS = "completions.jsonl"
SETTINGS = "run_settings.json"


class CompletionLogError(ValueError):
    """The completion log cannot be trusted or does not belong to this run (one line, naming the file)."""


@dataclass
class LogState:
    """What a completion log holds: its complete rows, and the torn last line dropped from it, if any."""

    rows: list[dict] = field(default_factory=list)
    valid_bytes: int = 0          # the file's length up to the end of its last complete line
    dropped: bytes = b""          # the unfinished last line (never a completion)

    @property
    def ids(self) -> set[str]:
        return {r["id"] for r in self.rows}

    def dropped_note(self, path: Path) -> str | None:
        """One line saying what was dropped, or None when the file ended cleanly."""
        if not self.dropped:
            return None
        head = self.dropped[:40].decode("utf-8", errors="replace")
        return (f"{path}: dropped a truncated last line ({len(self.dropped)} bytes, {head!r}...): "
                "not a completion, its prompt is answered again")


def read_log(path: str | Path) -> LogState:
    """The complete rows of a completion log (none when it does not exist); see the module docstring."""
    path = Path(path)
    if not path.is_file():
        return LogState()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1           # 0 when there is no complete line at all
    state = LogState(valid_bytes=end, dropped=data[end:])
    seen: set[str] = set()
    for number, line in enumerate(data[:end].splitlines(), 1):
        try:
            row = json.loads(line)
            pid = row["id"]
        except (ValueError, TypeError, KeyError):
            raise CompletionLogError(f"{path}:{number}: not a completion row (a complete line that does not "
                                     "parse: the file was edited or written by two jobs; refusing to resume)"
                                     ) from None
        if pid in seen:
            raise CompletionLogError(f"{path}:{number}: prompt {pid!r} answered twice")
        seen.add(pid)
        state.rows.append(row)
    return state


def repair(path: str | Path, state: LogState) -> None:
    """Cut the torn last line off the file, so the next append starts on a line of its own."""
    if state.dropped:
        os.truncate(path, state.valid_bytes)
        state.dropped = b""


def append_rows(path: str | Path, rows: list[dict]) -> None:
    """Append rows as whole lines in one write, durable when this returns (fsync; the folder too when the
    file is new, so the name itself survives a crash)."""
    if not rows:
        return
    path = Path(path)
    data = "".join(strict_json(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    new = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:                       # a regular file takes it all at once; a short write is finished
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    if new:
        _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_settings(out_dir: str | Path, settings: dict) -> None:
    """run_settings.json, written to a temporary file and renamed into place (never half written)."""
    path = Path(out_dir) / SETTINGS
    tmp = path.with_name(f".{SETTINGS}.tmp")
    tmp.write_text(strict_json(settings, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def start(out_dir: str | Path, settings: dict, resume: bool) -> tuple[LogState, str | None]:
    """Open a run's completion log for writing; returns what is already answered and the dropped-line note.

    Not resuming: a fresh, empty log. Resuming: the log as it is (torn last line cut off), refused when it
    was written with other settings."""
    out_dir = Path(out_dir)
    path = out_dir / COMPLETIONS
    if not resume:
        path.unlink(missing_ok=True)
        write_settings(out_dir, settings)
        return LogState(), None
    state = read_log(path)
    note = state.dropped_note(path)
    if state.rows or state.dropped:
        before_path = out_dir / SETTINGS
        if not before_path.is_file():
            raise CompletionLogError(f"{path}: has completions but no {SETTINGS} beside it: cannot tell whether "
                                     "they answer this run's settings; start a new --out-dir")
        before = json.loads(before_path.read_text())
        changed = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
        if changed:
            raise CompletionLogError(f"{path}: written with other settings ({', '.join(changed)} differ); "
                                     "resuming would mix answers of two runs; start a new --out-dir")
    repair(path, state)
    write_settings(out_dir, settings)
    return state, note


def remaining(batches: list, done: set[str]) -> list:
    """The micro-batches with at least one prompt not answered yet (indices and rows unchanged)."""
    return [mb for mb in batches if not set(mb.ids) <= done]
