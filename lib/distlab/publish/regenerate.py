"""Re-run every tutorial notebook with papermill, in order, and collect the executed copies.

    python -m distlab.publish.regenerate [--profile cpu|gpu|quick] [--only NN ...]

Each `notebooks/NN_*.ipynb` runs in its own subprocess through `distlab.launch.process.run` (own process
session, hard timeout, killed as a group), with parameters from `notebooks/profiles.yaml`:

    cpu:                      # the default profile; notebook defaults already target a 2-core CPU
      "*": {}
    gpu:
      "*": {device: cuda}     # every notebook
      "02": {nproc: 8}        # notebook 02 only (a full stem such as "02_ddp_scaling" works too)

An executed copy that ran clean goes to the book's input (`book/notebooks/`); one that failed is kept
at `build/regenerate/failed/` and the command ends non-zero naming the notebook and the failing cell.
`build/regenerate/summary.json` records every notebook's status, time and failing cell, and
`build/regenerate/logs/` the full papermill output (cell outputs included).

Papermill runs under a small "subreaper" shim (`python -m distlab.publish.regenerate --reap -- CMD`, which
is `distlab.launch.process.reap_and_run`): the Jupyter kernel starts in a session of its own, and a job that a
notebook launches through `distlab.launch.process` gets yet another one, so when the kernel exits such a job
would be re-parented to init and outlive the run. Marked as child subreaper, the shim inherits these orphans
and kills them when papermill ends (or when the runner's timeout terminates it).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import re
import shutil
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TextIO

import nbformat
import yaml

from distlab import paths
from distlab.cli import finite_float, run_main
from distlab.folder_lock import FolderLock
from distlab.jsonio import strict_json
from distlab.launch import process
from distlab.provenance import git_commit
from distlab.publish.freshness import ChapterCache, chapter_inputs
from distlab.publish.profiles import DEFAULT_PROFILE, NOTEBOOK_RE, ProfileError, discover, load_profiles, parameters_for

# per notebook, then killed as a group: chapter 01's real-base run took 44 minutes to its last scoring cell on the
# 2-core CI VM (chapter 01 about 50 in all): under an hour, by a margin a slower machine would not keep
DEFAULT_TIMEOUT_S = 5400.0
DEFAULT_KERNEL = "python3"
HEARTBEAT_S = 60.0  # a "still running" line this often while a notebook runs

# papermill tags: the cell it injects with the parameters, and the two cells it adds on an error.
INJECTED_TAG = "injected-parameters"
ERROR_MARKER_TAG = "papermill-error-cell-tag"

_CELL_START_RE = re.compile(r"^Executing Cell (\d+)-*\s*$")
_UNKNOWN_PARAM_RE = re.compile(r"Passed unknown parameter: (\S+)")


# ----------------------------------------------------------------------------- data


@dataclass
class CellFailure:
    """Where a notebook stopped: the cell as numbered in the *source* notebook (0-based)."""

    index: int  # 0-based index among the source notebook's cells (papermill's own cells skipped)
    execution_count: int | None  # the "In [n]" of the executed copy
    first_line: str  # first non-blank line of the cell's source
    ename: str = ""  # exception class name ("" when the cell was still running: a timeout)
    evalue: str = ""
    status: str = "failed"  # "failed" or "running" (killed while it ran)

    def where(self) -> str:
        text = f"cell {self.index}"
        return text + (f" (In [{self.execution_count}])" if self.execution_count is not None else "")

    def what(self) -> str:
        return f"raised {self.ename}: {self.evalue}" if self.ename else "was still running"

    def describe(self) -> str:
        """Two lines: "cell 3 (In [4]) raised RuntimeError: boom" and "> <first source line>"."""
        return f"{self.where()} {self.what()}\n    > {self.first_line}"


@dataclass
class NotebookResult:
    name: str  # file stem, e.g. "01_single_device_baseline"
    source: str
    status: str  # ok | failed | timeout | error
    elapsed_s: float
    executed: str | None  # where the executed copy is now (book input, or the failed/ folder)
    log: str
    parameters: dict[str, Any] = field(default_factory=dict)
    ignored_parameters: list[str] = field(default_factory=list)
    failing_cell: CellFailure | None = None
    message: str = ""
    inputs: str = ""  # the chapter's inputs digest (distlab.publish.freshness.chapter_inputs)
    cached: bool = False  # True: the inputs matched the last execution, which was reused

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# ----------------------------------------------------------------------------- failures


def find_failing_cell(executed: str | Path) -> CellFailure | None:
    """Parse an executed (or partly executed) copy for the cell that failed or was still running.

    papermill marks a cell's metadata.papermill.status ("running" until it ends, "failed" on an
    exception) and records the exception as an "error" output; it also inserts its own cells (the
    injected parameters, two error banners), which are skipped so the index is the source's."""
    try:
        nb = nbformat.read(str(executed), as_version=4)
    except Exception:  # missing, or cut off mid-write by a kill
        return None
    index = -1
    running: CellFailure | None = None
    for cell in nb.cells:
        tags = cell.get("metadata", {}).get("tags", [])
        if INJECTED_TAG in tags or ERROR_MARKER_TAG in tags:
            continue
        index += 1
        if cell.get("cell_type") != "code":
            continue
        pm = cell.get("metadata", {}).get("papermill", {})
        first = next((ln.strip() for ln in cell.source.splitlines() if ln.strip()), "")
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                if out.get("ename") == "SystemExit" and str(out.get("evalue", "")) in ("", "0"):
                    continue
                return CellFailure(index, cell.get("execution_count"), first, out.get("ename", ""),
                                   _first_line(out.get("evalue", "")), "failed")
        if pm.get("exception") is True or pm.get("status") == "failed":
            return CellFailure(index, cell.get("execution_count"), first, "CellExecutionError", "", "failed")
        if pm.get("status") == "running" and running is None:
            running = CellFailure(index, cell.get("execution_count"), first, "", "", "running")
    return running


def _first_line(text: str, limit: int = 300) -> str:
    line = next((ln for ln in str(text).splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


# ----------------------------------------------------------------------------- running


class _Progress:
    """Turns papermill's log lines into a terse progress display (the log file gets everything):
    one line per notebook, plus a "still running" line every HEARTBEAT_S while it runs."""

    def __init__(self, label: str, stream: TextIO, verbose: bool, heartbeat_s: float = HEARTBEAT_S,
                 cell_name: Callable[[int], str] = lambda i: f"cell {i}"):
        self.label, self.stream, self.verbose, self.heartbeat_s = label, stream, verbose, heartbeat_s
        self.cell_name = cell_name
        self.start = time.monotonic()
        self.cell: int | None = None
        self.line_open = False
        self.ignored: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True)

    def open(self) -> None:
        with self._lock:
            self.stream.write(f"{self.label} ...")
            self.stream.flush()
            self.line_open = True
        self._beat.start()

    def __call__(self, line: str) -> None:
        if (m := _CELL_START_RE.match(line)):
            self.cell = int(m.group(1)) - 1  # papermill counts from 1 in the executed copy
        if (m := _UNKNOWN_PARAM_RE.search(line)) and m.group(1) not in self.ignored:
            self.ignored.append(m.group(1))
        if self.verbose:
            with self._lock:
                self._break_line()
                self.stream.write(f"    | {line}\n")
                self.stream.flush()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            with self._lock:
                self._break_line()
                where = self.cell_name(self.cell) if self.cell is not None else "starting the kernel"
                self.stream.write(f"      ... {self.label.split('] ', 1)[-1]}: {where}, "
                                  f"{time.monotonic() - self.start:.0f}s\n")
                self.stream.flush()

    def _break_line(self) -> None:
        if self.line_open:
            self.stream.write("\n")
            self.line_open = False

    def close(self, verdict: str) -> None:
        self._stop.set()
        with self._lock:
            if self.line_open:
                self.stream.write(f" {verdict}\n")
            else:
                self.stream.write(f"{self.label} ... {verdict}\n")
            self.stream.flush()
            self.line_open = False


def source_cell_namer(notebook: str | Path, parameters: dict[str, Any] | None) -> Callable[[int], str]:
    """Map a cell index of the executed copy to a name in the source notebook's numbering
    (papermill inserts its parameters cell after the one tagged "parameters", or first)."""
    try:
        cells = nbformat.read(str(notebook), as_version=4).cells
    except Exception:
        return lambda i: f"cell {i}"
    injected = None
    if parameters:
        tagged = [i for i, c in enumerate(cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
        injected = tagged[0] + 1 if tagged else 0

    def name(i: int) -> str:
        if injected is not None and i == injected:
            return "the injected parameters"
        src = i - 1 if injected is not None and i > injected else i
        return f"cell {src} (of {len(cells)})"

    return name


def papermill_cmd(notebook: Path, output: Path, *, params_file: Path | None, cwd: Path,
                  kernel: str | None = DEFAULT_KERNEL) -> list[str]:
    """The papermill command line for one notebook (without the reaper shim)."""
    cmd = [sys.executable, "-m", "papermill", str(notebook), str(output),
           "--cwd", str(cwd), "--log-output", "--no-progress-bar", "--log-level", "INFO"]
    if params_file is not None:
        cmd += ["-f", str(params_file)]
    if kernel:
        cmd += ["--kernel", kernel]
    return cmd


def run_notebook(
    notebook: str | Path,
    executed: str | Path,
    *,
    parameters: dict[str, Any] | None = None,
    cwd: str | Path | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    log_path: str | Path | None = None,
    env: dict[str, str] | None = None,
    kernel: str | None = DEFAULT_KERNEL,
    echo: bool | Callable[[str], None] = False,
    params_dir: str | Path | None = None,
) -> tuple[process.RunResult, CellFailure | None]:
    """Execute one notebook with papermill in a killable subprocess; return the run and, when it
    did not succeed, the failing (or still running) cell parsed from the executed copy."""

    notebook, executed = Path(notebook), Path(executed)
    executed.parent.mkdir(parents=True, exist_ok=True)
    executed.unlink(missing_ok=True)
    params_file = None
    if parameters:
        params_file = Path(params_dir or executed.parent) / f"{notebook.stem}.params.yaml"
        params_file.parent.mkdir(parents=True, exist_ok=True)
        params_file.write_text(yaml.safe_dump(parameters, sort_keys=True))
    cmd = [sys.executable, "-m", "distlab.publish.regenerate", "--reap", "--",
           *papermill_cmd(notebook, executed, params_file=params_file,
                          cwd=Path(cwd or notebook.parent), kernel=kernel)]
    result = process.run(cmd, timeout_s=timeout_s, log_path=log_path, env=env, echo=echo, check=False)
    failure = None if result.ok else find_failing_cell(executed)
    return result, failure


def regenerate(
    *,
    profile: str = DEFAULT_PROFILE,
    only: Iterable[str] | None = None,
    notebooks_dir: str | Path | None = None,
    out_dir: str | Path | None = None,
    work_dir: str | Path | None = None,
    profiles_file: str | Path | None = None,
    figures_dir: str | Path | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    kernel: str | None = DEFAULT_KERNEL,
    verbose: bool = False,
    stream: TextIO | None = None,
    force: bool = False,
    cache_dir: str | Path | None = None,
) -> list[NotebookResult]:
    """Run the notebooks in order; return one NotebookResult each (failures do not stop the rest).

    Executed copies that succeeded go to `out_dir` (default book/notebooks); failed ones to
    `work_dir`/failed (default build/regenerate/failed), with logs and summary.json in `work_dir`.
    `figures_dir` (exported as DISTLAB_FIGURES to the notebooks) redirects figures and tables.

    Incremental: a chapter whose inputs digest (notebook code cells, library, data, lock, profile
    parameters) matches its last successful execution in `cache_dir` (default build/notebook_cache) is
    not executed again: its executed copy gets the notebook's current prose and its outputs are restored
    where they differ. `force` executes every selected chapter."""
    stream = stream or sys.stdout
    notebooks_dir = Path(notebooks_dir or paths.NOTEBOOKS_DIR).resolve()
    out_dir = Path(out_dir or paths.BOOK_DIR / "notebooks").resolve()
    work_dir = Path(work_dir or paths.BUILD_DIR / "regenerate").resolve()
    # One run per work folder: two `make book`s at once would execute into the same executing/ copies and
    # overwrite each other's figures (distlab.folder_lock; a dead run's lock is taken over, said so).
    with FolderLock(work_dir, "notebook run (make book)") as lock:
        if lock.took_over:
            stream.write(lock.describe_takeover() + "\n")
        if profiles_file is None:
            profiles_file = notebooks_dir / "profiles.yaml"
        profiles = load_profiles(profiles_file)
        if profile not in profiles and profile != DEFAULT_PROFILE:
            raise ProfileError(f"unknown profile {profile!r} in {profiles_file} "
                           f"(have: {', '.join(profiles) or 'none'})")
        selected = only is not None
        notebooks = discover(notebooks_dir, only)

        for sub in ("executing", "failed", "logs", "params"):
            (work_dir / sub).mkdir(parents=True, exist_ok=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        if not selected:  # a full run: drop executed copies whose source notebook is gone
            names = {p.name for p in notebooks}
            for stale in out_dir.glob("*.ipynb"):
                if NOTEBOOK_RE.match(stale.name) and stale.name not in names:
                    stale.unlink()
                    stream.write(f"removed {stale} (no such notebook any more)\n")

        env = {"DISTLAB_PROFILE": profile}
        if figures_dir is not None:
            env["DISTLAB_FIGURES"] = str(Path(figures_dir).resolve())
        outputs_dir = Path(figures_dir or paths.FIGURES_DIR).resolve()
        cache = ChapterCache(cache_dir)
        started = _dt.datetime.now(_dt.timezone.utc)
        t0 = time.monotonic()
        if not notebooks:
            stream.write(f"no NN_*.ipynb notebooks in {notebooks_dir}: nothing to run\n")
        results: list[NotebookResult] = []
        for i, nb in enumerate(notebooks, 1):
            params = parameters_for(profiles, profile, nb)
            digest = chapter_inputs(nb, profile, params)
            executing = work_dir / "executing" / nb.name
            log_path = work_dir / "logs" / f"{nb.stem}.log"
            failed_copy = work_dir / "failed" / nb.name
            book_copy = out_dir / nb.name
            if not force and cache.lookup(nb.stem, digest):
                restored = cache.restore(nb.stem, nb, book_copy, outputs_dir)
                failed_copy.unlink(missing_ok=True)
                results.append(NotebookResult(name=nb.stem, source=str(nb), status="ok", elapsed_s=0.0,
                                              executed=str(book_copy), log=str(log_path), parameters=params,
                                              inputs=digest, cached=True))
                stream.write(f"[{i}/{len(notebooks)}] {nb.stem} ... unchanged inputs {digest}: not executed "
                             f"({len(restored)} output(s) restored from the cache)\n")
                continue
            progress = _Progress(f"[{i}/{len(notebooks)}] {nb.stem}", stream, verbose,
                                 cell_name=source_cell_namer(nb, params))
            progress.open()
            before = cache.watch(outputs_dir)
            try:
                run, failure = run_notebook(
                    nb, executing, parameters=params, cwd=notebooks_dir, timeout_s=timeout_s, log_path=log_path,
                    env={**env, "DISTLAB_CHAPTER": nb.name.split("_", 1)[0], "DISTLAB_INPUTS": digest},
                    kernel=kernel, echo=progress, params_dir=work_dir / "params",
                )
            except BaseException:
                progress.close("interrupted")
                raise
            res = NotebookResult(
                name=nb.stem, source=str(nb), status="ok", elapsed_s=round(run.elapsed_s, 1),
                executed=None, log=str(log_path), parameters=params,
                ignored_parameters=list(progress.ignored), failing_cell=failure, inputs=digest,
            )
            if run.ok:
                cache.store(nb.stem, digest, profile, executing, outputs_dir, before)
                shutil.move(executing, book_copy)
                failed_copy.unlink(missing_ok=True)
                res.executed = str(book_copy)
                note = f" (ignored parameters: {', '.join(res.ignored_parameters)})" if res.ignored_parameters else ""
                progress.close(f"ok {run.elapsed_s:.1f}s{note}")
            else:
                if run.timed_out:
                    res.status = "timeout"
                    head = f"timed out after {run.elapsed_s:.0f}s (limit {timeout_s:g}s) and was killed"
                elif failure is not None:
                    res.status = "failed"
                    head = f"failed (exit code {run.returncode})"
                else:
                    res.status = "error"
                    head = f"papermill exited with code {run.returncode} before a cell failed"
                if executing.exists():
                    shutil.move(executing, failed_copy)
                    res.executed = str(failed_copy)
                if book_copy.exists():  # an older successful copy would show stale results
                    book_copy.unlink()
                lines = [f"{nb.name} {head}"]
                if failure is not None:
                    lines.append(f"  {failure.describe()}")
                else:
                    lines.append("  last output:")
                    lines += [f"    | {ln}" for ln in [t for t in run.tail if t.strip()][-12:]]
                if res.executed:
                    lines.append(f"  executed copy: {res.executed}")
                lines.append(f"  log: {log_path}")
                res.message = "\n".join(lines)
                progress.close(f"{res.status.upper()} {run.elapsed_s:.1f}s"
                               + (f": {failure.where()} {failure.what()}" if failure else ""))
            results.append(res)

        write_summary(work_dir / "summary.json", results, profile=profile, started=started,
                      elapsed_s=time.monotonic() - t0, notebooks_dir=notebooks_dir, out_dir=out_dir)
        return results


def write_summary(path: Path, results: list[NotebookResult], **meta: Any) -> Path:
    doc = {
        "profile": meta.get("profile"),
        "started": meta["started"].strftime("%Y-%m-%d %H:%M:%S UTC"),
        "elapsed_s": round(meta.get("elapsed_s", 0.0), 1),
        "commit": git_commit(),
        "notebooks_dir": str(meta.get("notebooks_dir")),
        "out_dir": str(meta.get("out_dir")),
        "ok": all(r.ok for r in results),
        "notebooks": [asdict(r) for r in results],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(strict_json(doc, indent=2) + "\n")
    return path


# ----------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m distlab.publish.regenerate",
        description="Execute every notebooks/NN_*.ipynb with papermill (in order, each in a killable "
                    "subprocess) and put the executed copies into the book's input.")
    ap.add_argument("--profile", default=os.environ.get("DISTLAB_PROFILE", DEFAULT_PROFILE),
                    help="parameter profile from profiles.yaml: cpu (default), gpu, quick")
    ap.add_argument("--only", nargs="+", metavar="NN", help="run only these notebooks (number or stem)")
    ap.add_argument("--notebooks-dir", type=Path, default=None, help=f"default {paths.NOTEBOOKS_DIR}")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help=f"where executed copies go (default {paths.BOOK_DIR / 'notebooks'})")
    ap.add_argument("--work-dir", type=Path, default=None,
                    help=f"logs, failed copies, summary.json (default {paths.BUILD_DIR / 'regenerate'})")
    ap.add_argument("--profiles", type=Path, default=None, dest="profiles_file",
                    help="profiles file (default NOTEBOOKS_DIR/profiles.yaml)")
    ap.add_argument("--figures-dir", type=Path, default=None,
                    help="where the notebooks write figures/tables (exported as DISTLAB_FIGURES)")
    ap.add_argument("--timeout-s", type=finite_float, default=DEFAULT_TIMEOUT_S,
                    help=f"per-notebook time limit in seconds (default {DEFAULT_TIMEOUT_S:g})")
    ap.add_argument("--kernel", default=DEFAULT_KERNEL,
                    help="Jupyter kernel name (default python3, this virtual environment's)")
    ap.add_argument("--force", action="store_true",
                    help="execute every selected notebook, even those whose inputs match the last execution")
    ap.add_argument("--cache-dir", type=Path, default=None,
                    help=f"the incremental build's cache (default {paths.BUILD_DIR / 'notebook_cache'})")
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="stream papermill's output (cell outputs included) instead of progress lines")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--reap"]:
        cmd = argv[2:] if argv[1:2] == ["--"] else argv[1:]
        return process.reap_and_run(cmd)
    args = _parser().parse_args(argv)
    # bad input (an unknown profile or notebook) and Ctrl-C (the running notebook is killed as a group on the
    # way out) end in run_main: one line, exit 2 or 130, like every other command
    results = regenerate(
        profile=args.profile, only=args.only, notebooks_dir=args.notebooks_dir,
        out_dir=args.out_dir, work_dir=args.work_dir, profiles_file=args.profiles_file,
        figures_dir=args.figures_dir, timeout_s=args.timeout_s, kernel=args.kernel or None,
        verbose=args.verbose, force=args.force, cache_dir=args.cache_dir,
    )
    bad = [r for r in results if not r.ok]
    total = sum(r.elapsed_s for r in results)
    cached = sum(r.cached for r in results)
    print(f"regenerate: {len(results) - len(bad)} ok ({len(results) - len(bad) - cached} executed, {cached} "
          f"unchanged), {len(bad)} not ok (profile {args.profile}, {total:.1f}s)", flush=True)
    if bad:
        for r in bad:
            print(f"\n{r.status.upper()}: {r.message}", file=sys.stderr)
        print("\nThe failed notebooks were left out of the book input.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run_main(main, sigterm_exits=True)  # a SIGTERM kills the launched process groups too
