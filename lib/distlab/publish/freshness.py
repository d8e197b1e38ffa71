"""Which code drew a figure, and is it still the code in the tree?

Every chapter's outputs depend on more than the notebook: on the library it calls, the data it reads,
the locked package versions and the profile's parameters. `chapter_inputs` hashes exactly those (the
notebook's *code* cells only: a prose edit changes no number), and regenerate exports the digest to the
kernel (DISTLAB_INPUTS), so `provenance.stamp` writes it into every sidecar beside the commit.

Two users of the one digest:
  - `stale_outputs` (and `python -m distlab.publish.freshness check`, and tests/unit/test_freshness.py): a
    committed output is stale when its recorded digest no longer matches the tree, and unclean when it
    was drawn from a tree with uncommitted inputs ("+dirty") or carries no digest at all. The tables of a
    benchmark command (`make benchmarks`, for the book's appendix) carry `benchmark_inputs` instead: the
    command, its arguments and the same library, data and lock files, without a notebook.
  - `ChapterCache` (regenerate's incremental build): a chapter whose digest matches its last successful
    execution is not executed again; its executed copy gets the notebook's current prose, and the
    figures it wrote are restored from the cache where they differ.

Why not jupyter-cache, which Jupyter Book 1 drives: its key is a notebook's code cells and kernelspec,
so a change to the library or the data would serve old results; it executes through its own nbclient
executor, while the chapters are executed by papermill with injected parameters (the executed copy then
never hashes like its source); and its artifacts are files beside the notebook, while chapters write to
figures/. It could be bent to fit by subclassing its hash; a small manifest keyed on the same digest that
the sidecars carry is simpler, and it makes the cache and the stale check agree by construction.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import nbformat

from distlab import paths
from distlab.cli import run_main
from distlab.jsonio import strict_json
from distlab.provenance import git_commit, run_git
from distlab.publish.profiles import discover, load_profiles, parameters_for

# What every chapter depends on besides its notebook (tracked files only, so a clean clone agrees).
SHARED_INPUTS = ("lib", "data", "requirements.lock")
DIGEST_LENGTH = 16
SIDECAR_SUFFIX = ".provenance.json"


def _tracked(root: Path, roots: Sequence[str]) -> list[Path]:
    """Tracked files under `roots`, sorted; every file under them when `root` is no git checkout."""
    try:
        out = run_git(root, "ls-files", "-z", "--", *roots, timeout=30, check=True, text=False).stdout
        files = [root / name for name in out.decode().split("\0") if name]
    except (OSError, subprocess.SubprocessError):
        files = [p for r in roots for p in (root / r).rglob("*") if p.is_file()] if roots else []
        files += [root / r for r in roots if (root / r).is_file()]
    return sorted(p for p in files if p.is_file() and "__pycache__" not in p.parts)


def code_cells(notebook: str | Path) -> list[str]:
    """The sources of a notebook's code cells, in order: what its outputs can depend on."""
    nb = nbformat.read(str(notebook), as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code"]


def benchmark_inputs(module: str, arguments: dict[str, Any], root: str | Path = paths.REPO_ROOT) -> str:
    """The digest of everything a benchmark command's outputs depend on: its module and arguments, the
    library, the data and the locked versions (no notebook: `make benchmarks` runs it, not a chapter)."""
    root = Path(root)
    h = hashlib.sha256()
    h.update(json.dumps({"benchmark": module, "arguments": arguments}, sort_keys=True, default=str).encode())
    for path in _tracked(root, SHARED_INPUTS):
        h.update(b"\0file\0" + str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:DIGEST_LENGTH]


def benchmark_provenance(module: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """The sidecar fields that tie a benchmark's tables to the tree they were measured from: the command, its
    arguments and benchmark_inputs' digest, so the stale check holds them to the book's rule (measured at a
    clean commit from the inputs in the tree)."""
    return {"benchmark": module, "arguments": arguments, "inputs": benchmark_inputs(module, arguments)}


def chapter_inputs(notebook: str | Path, profile: str, parameters: dict[str, Any],
                   root: str | Path = paths.REPO_ROOT) -> str:
    """The digest of everything one chapter's outputs depend on under one profile."""
    root = Path(root)
    h = hashlib.sha256()
    h.update(json.dumps({"profile": profile, "parameters": parameters}, sort_keys=True, default=str).encode())
    for source in code_cells(notebook):
        h.update(b"\0cell\0" + source.encode())
    for path in _tracked(root, SHARED_INPUTS):
        h.update(b"\0file\0" + str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:DIGEST_LENGTH]


# ----------------------------------------------------------------------------- the stale check


@dataclass
class OutputProblem:
    output: str
    problem: str

    def __str__(self) -> str:
        return f"{self.output}: {self.problem}"


class NothingToCheck(ValueError):
    """`check` pointed at folders with no outputs or no notebooks: "0 problems" would be a pass for nothing."""


def stale_outputs(figures_dir: str | Path = paths.FIGURES_DIR, notebooks_dir: str | Path = paths.NOTEBOOKS_DIR,
                  profiles_file: str | Path | None = None, root: str | Path = paths.REPO_ROOT) -> list[OutputProblem]:
    """Every output in `figures_dir` whose sidecar is missing, names a dirty tree, carries no inputs
    digest, or whose digest no longer matches the chapter's inputs in the tree. NothingToCheck when either
    folder holds nothing to compare (a wrong path must not read as a clean tree)."""
    figures_dir, notebooks_dir = Path(figures_dir), Path(notebooks_dir)
    profiles = load_profiles(profiles_file or notebooks_dir / "profiles.yaml")
    chapters = {nb.name.split("_", 1)[0]: nb for nb in discover(notebooks_dir)}
    if not chapters:
        raise NothingToCheck(f"{notebooks_dir}: no NN_*.ipynb notebooks: nothing to check outputs against")
    if not _outputs(figures_dir):
        raise NothingToCheck(f"{figures_dir}: no outputs (figures or tables) to check")
    digests: dict[tuple[str, str], str] = {}
    problems: list[OutputProblem] = []
    for out in _outputs(figures_dir):
        side = out.with_name(out.name + SIDECAR_SUFFIX)
        if not side.exists():
            problems.append(OutputProblem(out.name, "no provenance sidecar"))
            continue
        try:
            rec = json.loads(side.read_text(encoding="utf-8"))
        except ValueError as e:  # UnicodeDecodeError (a binary file) or JSONDecodeError: named, not a traceback
            problems.append(OutputProblem(out.name, f"sidecar {side.name} is not JSON text: {e}"))
            continue
        if not isinstance(rec, dict):
            problems.append(OutputProblem(out.name, f"sidecar {side.name} is not a JSON object"))
            continue
        if str(rec.get("commit", "")).endswith("+dirty") or rec.get("commit") in (None, "unknown"):
            problems.append(OutputProblem(out.name, f"drawn from an uncommitted tree (commit {rec.get('commit')})"))
        chapter, profile, recorded = rec.get("chapter"), rec.get("profile"), rec.get("inputs")
        if rec.get("benchmark"):  # a benchmark command's output (make benchmarks), not a chapter's
            now = benchmark_inputs(rec["benchmark"], rec.get("arguments") or {}, root)
            if recorded != now:
                problems.append(OutputProblem(out.name, f"stale: measured from inputs {recorded}, the tree's "
                                                        f"{rec['benchmark']} is now {now} (run make benchmarks)"))
            continue
        if not (chapter and profile and recorded):
            problems.append(OutputProblem(out.name, "sidecar records no chapter/profile/inputs digest "
                                                    "(not drawn by python -m distlab.publish.regenerate)"))
            continue
        if chapter not in chapters:
            problems.append(OutputProblem(out.name, f"chapter {chapter} has no notebook any more"))
            continue
        key = (chapter, profile)
        if key not in digests:
            nb = chapters[chapter]
            digests[key] = chapter_inputs(nb, profile, parameters_for(profiles, profile, nb), root)
        if digests[key] != recorded:
            problems.append(OutputProblem(out.name, f"stale: drawn from inputs {recorded}, the tree's chapter "
                                                    f"{chapter} ({profile} profile) is now {digests[key]}"))
    return problems


def _outputs(figures_dir: Path) -> list[Path]:
    """The figures and tables in `figures_dir` (not their sidecars)."""
    return sorted(p for p in figures_dir.iterdir() if p.is_file() and not p.name.endswith(SIDECAR_SUFFIX))


# ----------------------------------------------------------------------------- the incremental build


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    if not folder.exists():
        return {}
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in folder.iterdir() if p.is_file()}


def _same_file(a: Path, b: Path) -> bool:
    return a.exists() and b.exists() and a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes()


class ChapterCache:
    """build/notebook_cache/<stem>/: the last successful execution of each chapter.

        manifest.json   {"inputs": digest, "profile": ..., "commit": ..., "outputs": [names written to figures/]}

    An execution from a dirty tree is stored but never reused: its outputs would keep naming that tree.
        executed.ipynb  the executed copy
        outputs/        those outputs, as the execution wrote them
    """

    def __init__(self, root: str | Path | None = None):
        self.root = Path(root or paths.BUILD_DIR / "notebook_cache")

    def _dir(self, stem: str) -> Path:
        return self.root / stem

    def lookup(self, stem: str, digest: str) -> dict[str, Any] | None:
        manifest = self._dir(stem) / "manifest.json"
        if not manifest.exists():
            return None
        rec = json.loads(manifest.read_text())
        if rec.get("inputs") != digest or not (self._dir(stem) / "executed.ipynb").exists():
            return None
        if str(rec.get("commit", "")).endswith("+dirty"):
            return None  # its outputs name an uncommitted tree: draw them again from a clean one
        if not all((self._dir(stem) / "outputs" / name).exists() for name in rec.get("outputs", [])):
            return None
        return rec

    def watch(self, figures_dir: Path) -> dict[str, tuple[int, int]]:
        """Call before executing: what the figures folder holds now."""
        return _snapshot(figures_dir)

    def store(self, stem: str, digest: str, profile: str, executed: Path, figures_dir: Path,
              before: dict[str, tuple[int, int]]) -> list[str]:
        """After a successful execution: keep the executed copy and every output it wrote or changed."""
        written = sorted(name for name, sig in _snapshot(figures_dir).items() if before.get(name) != sig)
        target = self._dir(stem)
        shutil.rmtree(target, ignore_errors=True)
        (target / "outputs").mkdir(parents=True)
        shutil.copy2(executed, target / "executed.ipynb")
        for name in written:
            shutil.copy2(figures_dir / name, target / "outputs" / name)
        (target / "manifest.json").write_text(strict_json(
            {"inputs": digest, "profile": profile, "commit": git_commit(), "outputs": written}, indent=2) + "\n")
        return written

    def restore(self, stem: str, source_notebook: Path, out_path: Path, figures_dir: Path) -> list[str]:
        """Write the cached executed copy, laid out as the source notebook is now, to `out_path`, and copy back
        each cached output that differs from the figures folder's. Returns the outputs copied.

        The cache is used only while the code cells are unchanged, so each code cell keeps its executed
        outputs; everything else comes from the source: markdown cells (new, moved or edited), and every
        cell's metadata (a solution collapsed in JupyterLab). papermill's injected-parameters cell stays
        after the parameters cell."""
        target = self._dir(stem)
        executed = nbformat.read(str(target / "executed.ipynb"), as_version=4)
        source = nbformat.read(str(source_notebook), as_version=4)
        ran = {c.get("id"): c for c in executed.cells if c.cell_type == "code"}
        injected = [c for c in executed.cells if "injected-parameters" in c.get("metadata", {}).get("tags", [])]
        cells = []
        for cell in source.cells:
            if cell.cell_type == "code" and cell.get("id") in ran:
                done = ran[cell["id"]]
                done.metadata = {**done.metadata, **cell.metadata}
                cells.append(done)
            else:
                cells.append(cell)
            if "parameters" in cell.get("metadata", {}).get("tags", []):
                cells += injected
        executed.cells = cells
        out_path.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(executed, str(out_path))
        rec = json.loads((target / "manifest.json").read_text())
        figures_dir.mkdir(parents=True, exist_ok=True)
        copied = []
        for name in rec.get("outputs", []):
            cached, current = target / "outputs" / name, figures_dir / name
            if not _same_file(cached, current):
                shutil.copy2(cached, current)
                copied.append(name)
        return copied


# ----------------------------------------------------------------------------- CLI


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m distlab.publish.freshness",
                                 description="Check that every committed figure and table was drawn from the "
                                             "tree's current inputs at a clean commit.")
    ap.add_argument("command", choices=["check", "digest"],
                    help="check: list stale or unclean outputs (exit 1 if any); digest: print each chapter's")
    ap.add_argument("--figures-dir", type=Path, default=paths.FIGURES_DIR)
    ap.add_argument("--notebooks-dir", type=Path, default=paths.NOTEBOOKS_DIR)
    ap.add_argument("--profile", default="cpu", help="for digest: the profile (default cpu)")
    args = ap.parse_args(list(argv) if argv is not None else None)
    if args.command == "digest":
        profiles = load_profiles(args.notebooks_dir / "profiles.yaml")
        for nb in discover(args.notebooks_dir):
            print(nb.stem, chapter_inputs(nb, args.profile, parameters_for(profiles, args.profile, nb)))
        return 0
    problems = stale_outputs(args.figures_dir, args.notebooks_dir)
    for p in problems:
        print(p)
    print(f"freshness: {len(_outputs(args.figures_dir))} outputs, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    run_main(main)
