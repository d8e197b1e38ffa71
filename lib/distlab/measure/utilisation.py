"""A device-utilisation timeline around any run: GPU util % and memory when a vendor tool is
there, otherwise CPU % and RSS of this process and everything it started.

    with UtilizationSampler("build/runs/util.csv", pids="children") as sampler:
        launched = time.time()
        process.run([...torchrun...], timeout_s=60)
    plot_utilization("build/runs/util.csv", "figures/util.png", provenance.stamp(...),
                     spans=[(sampler.since_start(launched), sampler.since_start(time.time()), "the run")])

`spans` (shaded, labelled intervals: the phases of a job) and `events` (labelled instants: a kill, a
restart) are given in the CSV's clock, seconds since the sampler started; `since_start` converts a
wall-clock time.time() reading, such as one a rank logged, into it.

The sampler runs in a background thread, never raises into the caller (problems are kept in
`.errors`) and takes a last sample when it stops.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import pandas as pd
import psutil

from distlab.provenance import save_figure

FIELDS = ["t_s", "source", "id", "label", "util_pct", "mem_mib"]
MAX_ERRORS = 20  # a failing probe repeats every tick; the first few say everything


# ---------------------------------------------------------------- GPUs via the vendor tool

def gpu_tool() -> str | None:
    for tool in ("nvidia-smi", "rocm-smi"):
        if shutil.which(tool):
            return tool
    return None


def _number(text: Any) -> float:
    try:
        return float(str(text).strip().rstrip("%"))
    except ValueError:  # "[N/A]" on some boards
        return math.nan


def query_gpus(tool: str, timeout_s: float = 2.0) -> list[dict[str, Any]]:
    """One reading per GPU: id, label, util_pct, mem_mib (used). [] when the tool fails or hangs."""
    if tool == "nvidia-smi":
        cmd = ["nvidia-smi", "--query-gpu=index,name,utilization.gpu,memory.used",
               "--format=csv,noheader,nounits"]
    else:
        cmd = ["rocm-smi", "--showuse", "--showmeminfo", "vram", "--json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return _parse_nvidia(out) if tool == "nvidia-smi" else _parse_rocm(out)


def _parse_nvidia(out: str) -> list[dict[str, Any]]:
    rows = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4:
            rows.append({"id": parts[0], "label": f"gpu{parts[0]} {parts[1]}",
                         "util_pct": _number(parts[2]), "mem_mib": _number(parts[3])})
    return rows


def _parse_rocm(out: str) -> list[dict[str, Any]]:
    try:
        cards = json.loads(out)
    except json.JSONDecodeError:
        return []
    rows = []
    for card, fields in cards.items():
        if not card.startswith("card") or not isinstance(fields, dict):
            continue
        # Key spellings vary between rocm-smi releases: match on the words that do not.
        lower = {k.lower(): v for k, v in fields.items()}
        util = next((v for k, v in lower.items() if "use (%)" in k), math.nan)
        used = next((v for k, v in lower.items() if "used memory" in k), math.nan)
        rows.append({"id": card[4:], "label": f"gpu{card[4:]}", "util_pct": _number(util),
                     "mem_mib": _number(used) / 2**20})
    return rows


# ---------------------------------------------------------------- processes via psutil

class ProcessTree:
    """CPU % (100 = one core busy) and RSS of root processes and all their descendants.

    `pids=None`: this process and its descendants; 'children': only the descendants; a list:
    those processes and their descendants. Descendants are found through parent links, so ranks
    started by process.run in a session of their own are still found."""

    def __init__(self, pids: None | str | Sequence[int] = None):
        if pids not in (None, "children") and isinstance(pids, str):
            raise ValueError(f"pids={pids!r}: expected None, 'children' or a list of pids")
        self.include_roots = pids != "children"
        self.roots = [os.getpid()] if pids in (None, "children") else list(pids)
        self._last: dict[tuple[int, float], tuple[float, float]] = {}  # (pid, start) -> (time, cpu s)
        self._labels: dict[tuple[int, float], str] = {}

    def processes(self) -> list:
        found = {}
        for pid in self.roots:
            try:
                root = psutil.Process(pid)
                members = ([root] if self.include_roots else []) + root.children(recursive=True)
            except psutil.Error:
                continue
            found.update((p.pid, p) for p in members)
        return list(found.values())

    def sample(self) -> list[dict[str, Any]]:
        rows = []
        for proc in self.processes():
            try:
                with proc.oneshot():
                    key = (proc.pid, proc.create_time())  # a recycled pid is a new process
                    times = proc.cpu_times()
                    rss = proc.memory_info().rss
            except psutil.Error:  # it exited between listing and reading: normal
                continue
            now, cpu = time.time(), times.user + times.system
            # First sight: average since the process started, so short-lived ranks still count.
            t_prev, cpu_prev = self._last.get(key, (key[1], 0.0))
            self._last[key] = (now, cpu)
            rows.append({"id": str(proc.pid), "label": self._label(proc, key),
                         "util_pct": 100.0 * (cpu - cpu_prev) / max(now - t_prev, 1e-3),
                         "mem_mib": rss / 2**20})
        return rows

    def _label(self, proc, key) -> str:
        if key in self._labels:
            return self._labels[key]
        role = _role(proc)
        label = f"{role} (pid {proc.pid})"
        # A process sampled between fork and exec still shows its parent's command line and environment
        # (torchrun's agent is 'python' then, a rank 'torchrun'): only a rank's role is final and remembered.
        if role.startswith("rank "):
            self._labels[key] = label
        return label


def _is_rank(proc) -> bool:
    try:
        env = proc.environ() if proc is not None else {}
    except psutil.Error:
        return False
    return "RANK" in env and "TORCHELASTIC_RUN_ID" in env


def _role(proc) -> str:
    """'rank N' for a torchrun rank (from its RANK variable), else a short program name."""

    if proc.pid == os.getpid():
        return "this process"
    try:
        env = proc.environ()
        if "RANK" in env and "TORCHELASTIC_RUN_ID" in env:  # set by torchrun for its ranks only
            # A rank's own subprocesses (git for the provenance stamp, a compiler) inherit its variables:
            # they are not the rank, and their idle samples must not read as an idle rank.
            if _is_rank(proc.parent()):
                return f"{proc.name()} (child of rank {env['RANK']})"
            return f"rank {env['RANK']}"
        cmdline = proc.cmdline()
    except psutil.Error:
        return "process"
    if any("torch.distributed.run" in c or c.endswith("torchrun") for c in cmdline):
        return "torchrun"
    return proc.name()


# ---------------------------------------------------------------- the sampler

class UtilizationSampler:
    """Context manager that writes a utilisation timeline to `csv_path` every `interval_s`.

    `source`: 'auto' (GPUs when nvidia-smi/rocm-smi answers, else processes), 'gpu' or
    'process'. `pids` selects the processes (see ProcessTree). Columns: t_s (since start),
    source, id, label, util_pct, mem_mib. `started_at` is the wall-clock time (time.time()) of t_s = 0."""

    def __init__(self, csv_path: str | Path, interval_s: float = 0.5,
                 pids: None | str | Sequence[int] = None, source: str = "auto"):
        if source not in ("auto", "gpu", "process"):
            raise ValueError(f"source={source!r}: expected auto, gpu or process")
        self.csv_path = Path(csv_path)
        self.interval_s = interval_s
        self.tree = ProcessTree(pids)
        self.tool = gpu_tool() if source in ("auto", "gpu") else None
        self.source = "gpu" if self.tool else "process"
        self.rows = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self.started_at = 0.0

    def since_start(self, wall_time: float) -> float:
        """A time.time() reading (this process's, or a rank's on this machine) in the CSV's clock, t_s."""
        return wall_time - self.started_at

    def __enter__(self) -> "UtilizationSampler":
        self.start()
        return self

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False  # the caller's exception, if any, goes on

    def start(self) -> None:
        # t_s is counted on the monotonic clock (immune to clock steps); started_at, read at the same
        # moment, maps the wall-clock times that other processes log onto it.
        self._t0, self.started_at = time.monotonic(), time.time()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="UtilizationSampler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                self._note("sampler thread did not stop in time (a GPU query hung?)")

    def _loop(self) -> None:
        try:
            self.csv_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.csv_path, "w", newline="", encoding="utf-8") as f:
                out = csv.DictWriter(f, fieldnames=FIELDS)
                out.writeheader()
                while True:
                    self._tick(out)
                    f.flush()  # a reader (or a crash) sees the timeline so far
                    if self._stop.wait(self.interval_s):
                        break
                self._tick(out)  # the state at the end of the run
        except Exception as e:  # never into the caller: the run matters more than its graph
            self._note(f"sampler stopped: {e!r}")

    def _tick(self, out: csv.DictWriter) -> None:
        t = round(time.monotonic() - self._t0, 3)
        try:
            readings = self._read()
        except Exception as e:
            self._note(repr(e))
            return
        for r in readings:
            out.writerow({"t_s": t, "source": self.source, **r})
        self.rows += len(readings)

    def _read(self) -> list[dict[str, Any]]:
        if self.source == "gpu":
            readings = query_gpus(self.tool, timeout_s=max(2.0, 4 * self.interval_s))
            if readings:
                return readings
            if self.rows == 0:  # a tool without working GPUs: fall back for the whole run
                self._note(f"{self.tool} gave no readings; sampling processes instead")
                self.source = "process"
            else:
                return []
        return self.tree.sample()

    def _note(self, message: str) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(message)


# ---------------------------------------------------------------- the plot

Span = tuple[float, float, str]  # (start, end, label) in the CSV's clock: a phase of the run
Event = tuple[float, str]  # (time, label): an instant, such as a kill or a restart

LABEL_PITCH_IN = 0.17  # horizontal room one rotated label of the phase strip needs, in inches


# the instants `events` marks, in time order: the first red, the second green (chapter 02's fault demo: the
# death of a rank, then the resumed run), told apart by colour as well as by their labels
EVENT_COLOURS = ("crimson", "forestgreen", "darkorange", "purple")


def plot_utilization(csv_path: str | Path, out_png: str | Path, provenance: Mapping[str, Any],
                     title: str | None = None, *, spans: Sequence[Span] = (), events: Sequence[Event] = (),
                     min_mib: float = 0.0):
    """Utilisation (top) and memory (bottom) over time, one line per GPU or process.

    `min_mib` leaves out the processes whose memory never exceeds it: the shell wrappers (bash, `timeout`)
    that only wait for their child would otherwise show as idle lines beside the real work.

    `spans` shades the phases of a run on both plots and `events` draws a dashed line at each instant,
    both in the CSV's clock (seconds since the sampler started: UtilizationSampler.since_start converts
    a time.time() reading). Their labels stand in a strip above the plots, so they cover no line."""
    from matplotlib import colormaps  # deferred: plotting is only needed when drawing
    from matplotlib.figure import Figure

    df = pd.read_csv(csv_path, dtype={"id": str})
    if min_mib:
        df = df[df.groupby(["source", "id"])["mem_mib"].transform("max") > min_mib]
    labels = [s[2] for s in spans] + [e[1] for e in events]
    # upright labels need the strip as tall as the longest one; events alone (no phases) are labelled across
    # a short strip instead, in two alternating rows
    strip_in = 0.45 if not spans else 0.3 + 0.075 * max((len(text) for text in labels), default=0)
    fig = Figure(figsize=(7, 5 + (strip_in if labels else 0)))
    if labels:
        ax_strip, ax_util, ax_mem = fig.subplots(3, 1, sharex=True, height_ratios=[strip_in, 2.5, 2.5])
    else:
        ax_strip, (ax_util, ax_mem) = None, fig.subplots(2, 1, sharex=True)
    for (source, ident), g in df.groupby(["source", "id"], sort=False):
        # The most frequent label: not one read before exec ('python') or while exiting ('process').
        ax_util.plot(g["t_s"], g["util_pct"], ".-", label=g["label"].mode().iloc[0])
        ax_mem.plot(g["t_s"], g["mem_mib"], ".-")
    is_gpu = (df["source"] == "gpu").any()
    ax_util.set_ylabel("GPU util %" if is_gpu else "CPU % (100 = 1 core)")
    ax_mem.set_ylabel("GPU memory MiB" if is_gpu else "RSS MiB")
    ax_mem.set_xlabel("seconds since the sampler started")
    (ax_strip or ax_util).set_title(title or f"utilisation timeline ({Path(csv_path).name})", fontsize=10)
    if df.empty:
        ax_util.text(0.5, 0.5, "no samples", transform=ax_util.transAxes, ha="center")
    else:
        ax_util.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    for ax in (ax_util, ax_mem):
        ax.grid(True, alpha=0.3)
    palette = colormaps["Set2"].colors
    marks = []  # (x of the label, label, colour)
    for i, (t0, t1, text) in enumerate(spans):
        colour = palette[i % len(palette)]
        for ax, alpha in ((ax_strip, 0.6), (ax_util, 0.18), (ax_mem, 0.18)):
            ax.axvspan(t0, t1, color=colour, alpha=alpha, lw=0)
        marks.append(((t0 + t1) / 2, text, "black"))
    colour_of = {e: EVENT_COLOURS[i % len(EVENT_COLOURS)] for i, e in enumerate(sorted(events))}
    for t, text in events:
        for ax in (ax_util, ax_mem):  # not in the strip: there the event's label stands at its time
            ax.axvline(t, color=colour_of[t, text], ls="--", lw=1)
        marks.append((t, text, colour_of[t, text]))
    fig.tight_layout()
    if spans:
        _label_strip(fig, ax_strip, marks)
    elif events:
        ax_strip.set_yticks([])
        ax_strip.set_ylim(0, 1)
        lo, hi = ax_strip.get_xlim()
        for i, (t, text) in enumerate(sorted(events)):
            ax_strip.axvline(t, color=colour_of[t, text], ls="--", lw=1)
            right = t > lo + 0.75 * (hi - lo)  # near the right edge the label stands left of its line
            ax_strip.annotate(text, (t, 0.7 if i % 2 == 0 else 0.25), xytext=(-3 if right else 3, 0),
                              textcoords="offset points", ha="right" if right else "left", va="center", fontsize=7,
                              color=colour_of[t, text])
    save_figure(fig, out_png, dict(provenance))
    return fig


def _label_strip(fig, ax, marks: list[tuple[float, str, str]]) -> None:
    """Upright labels in the strip, at their spans' centres or events, pushed right just enough that
    neighbours (a short phase beside another) never overlap."""
    ax.set_yticks([])
    ax.set_ylim(0, 1)
    lo, hi = ax.get_xlim()
    pitch = LABEL_PITCH_IN * (hi - lo) / (ax.get_position().width * fig.get_figwidth())
    placed = -float("inf")
    for x, text, colour in sorted(marks, key=lambda m: m[0]):
        placed = max(x, placed + pitch)
        ax.text(placed, 0.04, text, rotation=90, ha="center", va="bottom", fontsize=7, color=colour,
                clip_on=False)
