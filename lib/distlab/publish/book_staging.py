"""The Jupyter Book's build input: the book folder's pages, the executed notebooks and the figures and
tables, staged in one folder, with the generated `_toc.yml` and `results.md`.

`stage(SOURCE, OUT/src)` copies the hand-written pages of SOURCE (`_config.yml`, `intro.md`, ...), the
executed notebooks of SOURCE/notebooks (written there by `python -m distlab.publish.regenerate`) and
the figures and tables of `figures/` with their `*.provenance.json` sidecars, then writes `_toc.yml`
(intro, the front pages such as the workshop guide and the case studies, one page per notebook in numeric
order, the appendix pages `appendix_*.md`, results) and `results.md` (every figure with the provenance line
from its sidecar, and every table). The workshop guide's run-times marker becomes a table of each chapter's
Run All time, read from the executed notebook's own papermill record, beside the agenda's slot for it.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

from distlab import paths
from distlab.jsonio import strict_json

NOTEBOOK_RE = re.compile(r"^(\d+)_.+\.ipynb$")
FIGURE_EXTS = (".png", ".svg", ".jpg", ".jpeg")
TABLE_EXTS = (".csv", ".md")
PROVENANCE_SUFFIX = ".provenance.json"
CSV_INLINE_MAX_ROWS = 40
CSV_INLINE_MAX_COLS = 12
GENERATED = ("_toc.yml", "results.md")
FRONT_PAGES = ("workshop", "case_studies")  # hand-written pages between the intro and the chapters, in this order
# Subfolders of figures/ holding dated measurements from machines CI has not got (figures/gpu: a lent GPU,
# with the commit, device, driver and CUDA in each sidecar). The freshness check reads figures/ alone.
RECORDED_ELSEWHERE = ("gpu",)
APPENDIX_GLOB = "appendix_*.md"  # hand-written pages after the chapters, in name order
# Where the workshop guide shows each chapter's Run All time, as measured by the executions this book shows.
RUN_TIMES_MARKER = "<!-- distlab: run times -->"
AGENDA_ROW = re.compile(r"^\|\s*(\d+):(\d\d)\s*\|(.*)$")


class BookBuildError(RuntimeError):
    pass


@dataclass
class Chapter:
    path: Path  # the executed notebook, as staged (OUT/src/notebooks/NN_x.ipynb)
    docname: str  # "notebooks/NN_x"
    title: str


def notebooks_in(notebooks_dir: str | Path) -> list[Path]:
    """The executed `NN_*.ipynb` notebooks of the book input, in numeric order."""
    d = Path(notebooks_dir)
    if not d.is_dir():
        return []
    return sorted((p for p in d.glob("*.ipynb") if NOTEBOOK_RE.match(p.name)),
                  key=lambda p: (int(NOTEBOOK_RE.match(p.name).group(1)), p.name))


def notebook_title(path: str | Path) -> str:
    """The first Markdown heading of a notebook, else a title made from its file name."""
    try:
        nb = json.loads(Path(path).read_text(encoding="utf-8"))
        for cell in nb.get("cells", []):
            if cell.get("cell_type") != "markdown":
                continue
            src = cell.get("source", "")
            src = "".join(src) if isinstance(src, list) else src
            for line in src.splitlines():
                m = re.match(r"^\s{0,3}#{1,6}\s+(.+?)\s*#*\s*$", line)
                if m:
                    return m.group(1).strip()
    except (OSError, ValueError):
        pass
    stem = Path(path).stem
    number, _, rest = stem.partition("_")
    return f"{number} {rest.replace('_', ' ')}".strip()


def page_title(path: Path) -> str:
    """The first Markdown heading of a page, else its file name."""
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        m = re.match(r"^#\s+(.+?)\s*$", line)
        if m:
            return m.group(1)
    return path.stem.replace("_", " ")


def extra_pages(src_dir: str | Path) -> tuple[list[Path], list[Path]]:
    """The hand-written pages the table of contents lists besides the intro: (front pages, appendices)."""
    src = Path(src_dir)
    front = [src / f"{name}.md" for name in FRONT_PAGES if (src / f"{name}.md").is_file()]
    return front, sorted(src.glob(APPENDIX_GLOB))


def run_seconds(notebook: Path) -> tuple[float | None, str]:
    """How long papermill took to execute a notebook, and when it finished (its own metadata)."""
    try:
        meta = json.loads(notebook.read_text(encoding="utf-8")).get("metadata", {}).get("papermill", {})
    except (OSError, ValueError):
        return None, ""
    return meta.get("duration"), str(meta.get("end_time") or "")[:16].replace("T", " ")


def agenda_slots(page_text: str) -> dict[str, float]:
    """Minutes the agenda tables give each chapter ("Chapter NN" in a row; the slot lasts until the next
    row's start time), the first row naming a chapter counting."""
    rows = []
    for line in page_text.splitlines():
        m = AGENDA_ROW.match(line)
        if m:
            rows.append((int(m.group(1)) * 60 + int(m.group(2)), m.group(3)))
        elif rows and not line.startswith("|"):
            rows.append((None, ""))  # the end of a table
    slots: dict[str, float] = {}
    for (start, text), (end, _) in zip(rows, rows[1:]):
        for number in re.findall(r"Chapter (\d\d)\b", text):
            if start is not None and end is not None and end > start:
                slots.setdefault(number, end - start)
    return slots


def run_times_markdown(chapters: Sequence[Chapter], page_text: str) -> tuple[str, list[str]]:
    """The workshop guide's table: each chapter's Run All time in this build beside its agenda slot; and a
    note for every chapter whose run takes longer than its slot."""
    slots, notes = agenda_slots(page_text), []
    out = ["| chapter | Run All in this build | finished | agenda slot |", "|---|---|---|---|"]
    for c in chapters:
        number = NOTEBOOK_RE.match(c.path.name).group(1)
        seconds, finished = run_seconds(c.path)
        slot = slots.get(number)
        shown = f"{seconds / 60:.1f} min" if seconds is not None else "not recorded"
        out.append(f"| {c.title.split(':')[0]} | {shown} | {finished or '-'} UTC | "
                   + (f"{slot:.0f} min |" if slot else "demo or homework |"))
        if seconds is not None and slot and seconds / 60 > slot:
            notes.append(f"workshop.md: chapter {number} runs {seconds / 60:.1f} min, longer than its "
                         f"{slot:.0f}-minute slot")
    return "\n".join(out), notes


def write_toc(src_dir: str | Path, chapters: Sequence[Chapter]) -> Path:
    """`_toc.yml` (jb-book): the intro as root, the front pages (the workshop guide, the case studies), one
    chapter per notebook, the appendix pages, then the results page."""

    front, appendices = extra_pages(src_dir)
    entries = [{"file": p.stem, "title": page_title(p)} for p in front]
    entries += [{"file": c.docname, "title": c.title} for c in chapters]
    entries += [{"file": p.stem, "title": page_title(p)} for p in appendices]
    entries.append({"file": "results", "title": "Results"})
    toc = {"format": "jb-book", "root": "intro", "chapters": entries}
    path = Path(src_dir) / "_toc.yml"
    path.write_text("# Generated by python -m distlab.publish.book: do not edit.\n"
                    + yaml.safe_dump(toc, sort_keys=False, allow_unicode=True))
    return path


def provenance_line(rec: dict[str, Any] | None) -> str:
    """One line from a provenance sidecar: device | model | world size | commit | date | extras."""
    if not rec:
        return "**no provenance recorded** (no `.provenance.json` sidecar next to this file)"
    parts = [str(rec.get("device", "unknown device")), f"model {rec.get('model', '?')}",
             f"world size {rec.get('world_size', '?')}", f"commit {rec.get('commit', '?')}",
             str(rec.get("date", "undated"))]
    known = {"device", "model", "world_size", "commit", "date"}
    extras = [f"{k} {_short(v)}" for k, v in sorted(rec.items()) if k not in known]
    return " | ".join(parts + extras)


def _short(value: Any, limit: int = 60) -> str:
    text = value if isinstance(value, str) else strict_json(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_sidecar(path: Path) -> dict[str, Any] | None:
    side = path.with_name(path.name + PROVENANCE_SUFFIX)
    try:
        data = json.loads(side.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def _csv_shape(path: Path) -> tuple[int, int]:
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
        return len(rows), max((len(r) for r in rows), default=0)
    except (OSError, csv.Error, UnicodeDecodeError):
        return 0, 0


def results_markdown(figures: Sequence[Path], tables: Sequence[Path], chapters: Sequence[Chapter],
                     summary: dict[str, Any] | None = None, figures_rel: str = "figures") -> str:
    """The results page: the latest regeneration, then every figure and table with provenance.

    `figures`/`tables` are the staged files; links are written relative to the page as
    `figures_rel/NAME`."""
    out = ["# Results", "",
           "Every figure and table the notebooks produced in this build, each with its provenance: "
           "the device, model, world size, git commit and date of the run that made it.", ""]
    if not chapters:
        out += [":::{note}",
                "No executed notebooks were found in the book input (`book/notebooks/`), so this "
                "book has no chapters yet. Run `make notebooks` (or `python -m distlab.publish.regenerate`) "
                "and build again.", ":::", ""]
    if summary and summary.get("notebooks"):
        out += ["## Latest regeneration", "",
                f"Profile `{summary.get('profile')}`, started {summary.get('started')}, "
                f"commit `{summary.get('commit')}`.", "",
                "| Notebook | Status | Time (s) |", "|---|---|---|"]
        for nb in summary["notebooks"]:
            status = nb.get("status", "?")
            cell = nb.get("failing_cell")
            if status != "ok" and cell:
                status += f" in cell {cell.get('index')}"
            out.append(f"| `{nb.get('name')}` | {status} | {nb.get('elapsed_s', '')} |")
        out.append("")
        if any(nb.get("status") != "ok" for nb in summary["notebooks"]):
            out += ["Notebooks that did not run to the end are left out of this book.", ""]

    out += ["## Figures", ""]
    if not figures:
        out += ["No figures yet.", ""]
    for fig in figures:
        rec = read_sidecar(fig)
        title = (rec or {}).get("title") or fig.stem.replace("_", " ")
        out += [f"### {title}", "",
                f"```{{figure}} {figures_rel}/{fig.name}", f":alt: {fig.stem}", ":width: 100%", "",
                f"`{fig.name}`: {provenance_line(rec)}", "```", ""]

    out += ["## Tables", ""]
    if not tables:
        out += ["No tables yet.", ""]
    for tab in tables:
        rec = read_sidecar(tab)
        out += [f"### {tab.name}", ""]
        if tab.suffix == ".md":
            # A Markdown table from provenance.save_table carries its provenance line itself.
            out += [f"```{{include}} {figures_rel}/{tab.name}", "```", ""]
            if rec and "_Provenance:" not in tab.read_text(encoding="utf-8", errors="replace"):
                out += [f"_Provenance: {provenance_line(rec)}_", ""]
        else:
            rows, cols = _csv_shape(tab)
            out += [f"{{download}}`{tab.name} <{figures_rel}/{tab.name}>` ({max(rows - 1, 0)} rows): "
                    f"{provenance_line(rec)}", ""]
            if 1 < rows <= CSV_INLINE_MAX_ROWS + 1 and cols <= CSV_INLINE_MAX_COLS:
                out += ["```{csv-table}", f":file: {figures_rel}/{tab.name}", ":header-rows: 1", "```", ""]
    return "\n".join(out).rstrip() + "\n"


def stage(source: str | Path, src_dir: str | Path, *, figures_dir: str | Path | None = None,
          notebooks_dir: str | Path | None = None, summary_path: str | Path | None = None,
          exclude: Sequence[Path] = ()) -> dict[str, Any]:
    """Assemble the build input in `src_dir` (emptied first); return what it holds."""
    source, src_dir = Path(source).resolve(), Path(src_dir).resolve()
    notebooks_dir = Path(notebooks_dir or source / "notebooks").resolve()
    figures_dir = Path(figures_dir or paths.FIGURES_DIR).resolve()
    skip = {p.resolve() for p in exclude} | {src_dir, notebooks_dir, (source / "_build").resolve()}
    notes: list[str] = []

    if src_dir.exists():
        shutil.rmtree(src_dir)
    src_dir.mkdir(parents=True)
    for item in sorted(source.iterdir()):
        if item.resolve() in skip or item.name.startswith(".") or item.name in GENERATED:
            if item.name in GENERATED:
                notes.append(f"{item} is ignored: the build generates its own {item.name}")
            continue
        if item.is_dir():
            shutil.copytree(item, src_dir / item.name,
                            ignore=lambda d, names: [n for n in names if (Path(d) / n).resolve() in skip])
        else:
            shutil.copy2(item, src_dir / item.name)
    if not (src_dir / "_config.yml").exists():
        raise BookBuildError(f"{source}/_config.yml is missing")
    if not (src_dir / "intro.md").exists():
        raise BookBuildError(f"{source}/intro.md is missing (the book's root page)")

    chapters = []
    (src_dir / "notebooks").mkdir(exist_ok=True)
    for nb in notebooks_in(notebooks_dir):
        shutil.copy2(nb, src_dir / "notebooks" / nb.name)
        chapters.append(Chapter(src_dir / "notebooks" / nb.name, f"notebooks/{nb.stem}", notebook_title(nb)))
    if not chapters:
        notes.append(f"no executed notebooks in {notebooks_dir}: the book has only the intro and "
                     "results pages (run python -m distlab.publish.regenerate first)")

    staged_figs = src_dir / "figures"
    staged_figs.mkdir(exist_ok=True)
    figures, tables = [], []
    if figures_dir.is_dir():
        for f in sorted(figures_dir.iterdir()):
            if not f.is_file() or f.name.startswith("."):
                continue
            if f.suffix.lower() in FIGURE_EXTS + TABLE_EXTS or f.name.endswith(PROVENANCE_SUFFIX):
                shutil.copy2(f, staged_figs / f.name)
            if f.suffix.lower() in FIGURE_EXTS:
                figures.append(staged_figs / f.name)
            elif f.suffix.lower() in TABLE_EXTS:
                tables.append(staged_figs / f.name)
    for folder in RECORDED_ELSEWHERE:  # shown by the appendix pages as they are; no build here redraws them
        if (figures_dir / folder).is_dir():
            shutil.copytree(figures_dir / folder, staged_figs / folder, dirs_exist_ok=True)
    for f in figures + tables:
        if read_sidecar(f) is None:
            notes.append(f"{f.name} has no provenance sidecar ({f.name}{PROVENANCE_SUFFIX})")

    summary = None
    summary_path = Path(summary_path) if summary_path else paths.BUILD_DIR / "regenerate" / "summary.json"
    try:
        summary = json.loads(summary_path.read_text())
        if Path(summary.get("out_dir", "")).resolve() != notebooks_dir:
            summary = None  # a run that filled another book input
    except (OSError, ValueError):
        summary = None

    front, appendices = extra_pages(src_dir)
    listed = {"intro.md", *(p.name for p in front + appendices)}
    for page in sorted(src_dir.glob("*.md")):
        if page.name not in listed and page.name not in GENERATED:
            notes.append(f"{page.name} is in no table of contents: name it appendix_*.md or add it to FRONT_PAGES")
    workshop = src_dir / "workshop.md"
    text = workshop.read_text(encoding="utf-8") if workshop.is_file() else ""
    if RUN_TIMES_MARKER in text:
        table, late = run_times_markdown(chapters, text)
        workshop.write_text(text.replace(RUN_TIMES_MARKER, table), encoding="utf-8")
        notes += late
    toc = write_toc(src_dir, chapters)
    (src_dir / "results.md").write_text(results_markdown(figures, tables, chapters, summary))
    return {"src": src_dir, "toc": toc, "config": src_dir / "_config.yml", "chapters": chapters,
            "notebooks_dir": notebooks_dir, "figures_dir": figures_dir,
            "figures": figures, "tables": tables, "notes": notes}
