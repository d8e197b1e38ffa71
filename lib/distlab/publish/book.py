"""Build the tutorial's Jupyter Book (1.x, Sphinx) offline from the executed notebooks, and check it.

    python -m distlab.publish.book [--source book] [--out book/_build] [--check] [--strict]

The build input is assembled in OUT/src from the hand-written pages of SOURCE (`_config.yml`,
`intro.md`, ...), the executed notebooks in SOURCE/notebooks (written there by
`python -m distlab.publish.regenerate`), and the figures and tables of `figures/`. Two files are generated
there: `_toc.yml` (intro, one page per notebook in numeric order, results) and `results.md` (every
figure with the provenance line from its `*.provenance.json` sidecar, and every table). Jupyter Book
renders the notebooks as they are (`execute_notebooks: off`); the HTML lands in OUT/html.

The build fails on Sphinx errors and on the warnings that mean a broken page (a missing image,
download or include, an unknown document or reference, an unknown directive or role); `--strict`
fails on every warning. `--check` then serves the site on 127.0.0.1 and visits every page with
Playwright and Debian's chromium (`check_site`): every image must decode, every same-origin link must
answer 200, nothing may be fetched from another host, and each page is screenshotted to
OUT/screenshots.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import yaml

from distlab import paths
from distlab.cli import run_main
from distlab.launch import runner

NOTEBOOK_RE = re.compile(r"^(\d+)_.+\.ipynb$")
FIGURE_EXTS = (".png", ".svg", ".jpg", ".jpeg")
TABLE_EXTS = (".csv", ".md")
PROVENANCE_SUFFIX = ".provenance.json"
CSV_INLINE_MAX_ROWS = 40
CSV_INLINE_MAX_COLS = 12
BUILD_TIMEOUT_S = 900.0
GENERATED = ("_toc.yml", "results.md")

CHROMIUM = Path(os.environ.get("DISTLAB_CHROMIUM", "/usr/bin/chromium"))
ENSURE_PACKAGES = paths.REPO_ROOT / "tools" / "ensure_debian_packages.sh"
# The closed network here refuses chromium's background connections unless they are switched off.
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]

# Sphinx/docutils warnings that mean a page is broken (the rest are reported, not fatal).
FATAL_WARNING_PATTERNS = [
    r"image file not readable",
    r"download file not readable",
    r"file not found",
    r"problems with \S+ directive path",
    r"toctree contains reference to (nonexisting|excluded) document",
    r"unknown document",
    r"undefined label",
    r"reference target not found",
    r"unknown target name",
    r"unknown directive type",
    r"unknown interpreted text role",
    r"unknown role",
    r"include file .* not found",
    r"could not (open|read|find)",
    r"failed to (import|read|load)",
    r"not readable",
    r"\[myst\.xref_missing\]",
    r"\[myst\.directive_unknown\]",
    r"\[myst\.role_unknown\]",
]
_FATAL_RE = re.compile("|".join(FATAL_WARNING_PATTERNS), re.IGNORECASE)
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_DIAG_RE = re.compile(r"\b(WARNING|ERROR|CRITICAL|SEVERE):\s")

# build_sphinx through Jupyter Book's own API, in a subprocess (runner.run: killable, timed out).
_SPHINX_SNIPPET = """\
import json, sys
from jupyter_book.sphinx import build_sphinx
from sphinx.util.console import nocolor
nocolor()
src, html, config, toc, strict, extra = sys.argv[1:7]
overrides = {"external_toc_path": toc, "latex_individualpages": False, **json.loads(extra)}
code = build_sphinx(src, html, use_external_toc=True, noconfig=True, path_config=config,
                    confoverrides=overrides,
                    builder="html", freshenv=True,
                    warningiserror=strict == "1", keep_going=True)
if not isinstance(code, int):
    print(f"jupyter-book build failed: {type(code).__name__}: {code}", file=sys.stderr)
    code = 1
sys.exit(code)
"""


class BookBuildError(RuntimeError):
    pass


# ----------------------------------------------------------------------------- build input


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


def write_toc(src_dir: str | Path, chapters: Sequence[Chapter]) -> Path:
    """`_toc.yml` (jb-book): the intro as root, one chapter per notebook, then the results page."""

    entries = [{"file": c.docname, "title": c.title} for c in chapters]
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
    text = value if isinstance(value, str) else json.dumps(value, default=str)
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

    toc = write_toc(src_dir, chapters)
    (src_dir / "results.md").write_text(results_markdown(figures, tables, chapters, summary))
    return {"src": src_dir, "toc": toc, "config": src_dir / "_config.yml", "chapters": chapters,
            "notebooks_dir": notebooks_dir, "figures_dir": figures_dir,
            "figures": figures, "tables": tables, "notes": notes}


# ----------------------------------------------------------------------------- MathJax

MATHJAX_VERSION = "3.2.2"
MATHJAX_CDN = "cdn.jsdelivr.net/npm/mathjax"
MATHJAX_NPM_DIR = paths.BUILD_DIR / "mathjax"
# Parts of MathJax's es5 folder a page never loads with the tex-mml-chtml bundle.
_MATHJAX_SKIP = ("sre", "node-main.js", "tex-chtml-full-speech.js", "tex-chtml-full.js", "tex-svg-full.js",
                 "tex-svg.js", "tex-mml-svg.js", "mml-svg.js")


def find_mathjax() -> Path | None:
    """A local MathJax 3 (the folder holding tex-mml-chtml.js): $DISTLAB_MATHJAX, else the copy
    that `fetch_mathjax` installs under build/mathjax. None when there is none."""
    candidates = []
    if os.environ.get("DISTLAB_MATHJAX"):
        env = Path(os.environ["DISTLAB_MATHJAX"])
        candidates += [env, env / "es5", env / "node_modules" / "mathjax" / "es5"]
    candidates.append(MATHJAX_NPM_DIR / "node_modules" / "mathjax" / "es5")
    return next((c for c in candidates if (c / "tex-mml-chtml.js").is_file()), None)


def fetch_mathjax(dest: str | Path = MATHJAX_NPM_DIR, version: str = MATHJAX_VERSION) -> Path | None:
    """Install MathJax from npm into `dest` (build/mathjax) so pages with math render offline."""
    if shutil.which("npm") is None:
        return None
    runner.run(["npm", "install", "--prefix", str(dest), "--no-audit", "--no-fund", "--fetch-retries=0",
                "--fetch-timeout=30000", f"mathjax@{version}"], timeout_s=120, echo=False, check=False)
    es5 = Path(dest) / "node_modules" / "mathjax" / "es5"
    return es5 if (es5 / "tex-mml-chtml.js").is_file() else None


def _install_mathjax(es5: Path, html_dir: Path) -> None:
    target = html_dir / "_static" / "mathjax"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(es5, target, ignore=lambda d, names: [n for n in names if n in _MATHJAX_SKIP])


# ----------------------------------------------------------------------------- build


@dataclass
class BuildResult:
    html_dir: Path
    src_dir: Path
    chapters: list[str]
    figures: int
    tables: int
    warnings: list[str] = field(default_factory=list)  # every WARNING/ERROR line
    fatal: list[str] = field(default_factory=list)  # the ones that fail the build
    notes: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0


def build(source: str | Path | None = None, out: str | Path | None = None, *,
          figures_dir: str | Path | None = None, notebooks_dir: str | Path | None = None,
          summary_path: str | Path | None = None, strict: bool = False, mathjax: str | Path | None = "auto",
          timeout_s: float = BUILD_TIMEOUT_S, echo: bool | Callable[[str], None] = False) -> BuildResult:
    """Stage the input and build the HTML site (OUT/html). Raises BookBuildError when Sphinx fails
    or warns about something broken (any warning with `strict`).

    `mathjax`: "auto" serves a local MathJax (find_mathjax) from _static when there is one, a path
    names one, None keeps Sphinx's default (MathJax from a CDN on pages with math)."""
    source = Path(source or paths.BOOK_DIR).resolve()
    out = Path(out or source / "_build").resolve()
    t0 = time.monotonic()
    staged = stage(source, out / "src", figures_dir=figures_dir, notebooks_dir=notebooks_dir,
                   summary_path=summary_path, exclude=[out])
    html = out / "html"
    for stale in (html, out / ".doctrees"):
        if stale.exists():
            shutil.rmtree(stale)

    lines: list[str] = []
    # Messages name the staged copies; point them at the files one edits instead.
    renames = [(str(staged["src"] / "notebooks") + "/", str(staged["notebooks_dir"]) + "/"),
               (str(staged["src"] / "figures") + "/", str(staged["figures_dir"]) + "/"),
               (str(staged["src"]) + "/", str(source) + "/")]

    def collect(line: str) -> None:
        line = _ANSI_RE.sub("", line)
        for old, new in renames:
            line = line.replace(old, new)
        lines.append(line)
        if callable(echo):
            echo(line)
        elif echo:
            print(line, flush=True)

    es5 = find_mathjax() if mathjax == "auto" else (Path(mathjax) if mathjax else None)
    overrides = {"mathjax_path": "mathjax/tex-mml-chtml.js"} if es5 else {}
    cmd = [sys.executable, "-c", _SPHINX_SNIPPET, str(staged["src"]), str(html), str(staged["config"]),
           str(staged["toc"]), "1" if strict else "0", json.dumps(overrides)]
    res = runner.run(cmd, timeout_s=timeout_s, log_path=out / "build.log", echo=collect, check=False,
                     tail_lines=400, env={"PYDEVD_DISABLE_FILE_VALIDATION": "1", "NO_COLOR": "1"})
    warnings = [ln for ln in lines if _DIAG_RE.search(ln)]
    fatal = [ln for ln in warnings
             if strict or re.search(r"\b(ERROR|CRITICAL|SEVERE):", ln) or _FATAL_RE.search(ln)]
    result = BuildResult(html_dir=html, src_dir=staged["src"], chapters=[c.docname for c in staged["chapters"]],
                         figures=len(staged["figures"]), tables=len(staged["tables"]), warnings=warnings,
                         fatal=fatal, notes=staged["notes"], elapsed_s=time.monotonic() - t0)
    problems = []
    if not res.ok:
        problems.append("the Sphinx build timed out" if res.timed_out
                        else f"the Sphinx build exited with code {res.returncode}")
    if fatal:
        problems.append(f"{len(fatal)} warning(s) that break pages:")
        problems += [f"  {ln}" for ln in fatal[:40]]
    if res.ok and not (html / "index.html").exists() and not (html / "intro.html").exists():
        problems.append(f"no index.html or intro.html in {html}")
    if es5 and html.is_dir():
        _install_mathjax(es5, html)
    elif html.is_dir() and any(MATHJAX_CDN in p.read_text(errors="replace") for p in html_pages(html)):
        result.notes.append("pages with math load MathJax from a CDN and will not render it offline: "
                            "run `python -m distlab.publish.book --fetch-mathjax` once (npm) or set DISTLAB_MATHJAX")
    if problems:
        tail = [f"    | {ln}" for ln in res.tail[-25:]] if not res.ok and not fatal else []
        raise BookBuildError("book build failed: " + "\n".join(problems + tail)
                             + f"\n  full log: {out / 'build.log'}")
    return result


# ----------------------------------------------------------------------------- checking the site


@dataclass
class SiteReport:
    html_dir: Path
    base_url: str = ""
    pages: list[str] = field(default_factory=list)
    images_checked: int = 0
    links_checked: int = 0
    broken_images: list[tuple[str, str]] = field(default_factory=list)  # (page, src)
    broken_links: list[tuple[str, str, str]] = field(default_factory=list)  # (page, url, status)
    failed_resources: list[tuple[str, str, str]] = field(default_factory=list)  # (page, url, why)
    external_requests: list[tuple[str, str]] = field(default_factory=list)  # (page, url): blocked
    page_errors: list[tuple[str, str]] = field(default_factory=list)  # uncaught JS exceptions
    console_errors: list[tuple[str, str]] = field(default_factory=list)
    screenshots: list[Path] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems()

    def problems(self) -> list[str]:
        out = [f"{p}: image does not render: {s}" for p, s in self.broken_images]
        out += [f"{p}: link {u} -> {st}" for p, u, st in self.broken_links]
        seen = set()
        for p, u, why in self.failed_resources:
            if (p, u) not in seen:
                seen.add((p, u))
                out.append(f"{p}: resource {u} failed ({why})")
        out += [f"{p}: needs {u} from another host (blocked: pages must render offline)"
                for p, u in self.external_requests]
        out += [f"{p}: JavaScript error: {e}" for p, e in self.page_errors]
        if not self.pages:
            out.append(f"no HTML pages in {self.html_dir}")
        return out

    def summary(self) -> str:
        head = (f"checked {len(self.pages)} pages, {self.images_checked} images, "
                f"{self.links_checked} internal links; {len(self.screenshots)} screenshots")
        probs = self.problems()
        if not probs:
            return head + ": all good"
        return head + f": {len(probs)} problem(s)\n" + "\n".join(f"  {p}" for p in probs[:60])


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(directory: str | Path, host: str = "127.0.0.1", timeout_s: float = 15.0) -> Iterator[str]:
    """Serve `directory` with `python -m http.server` on a free port; yield its base URL; always
    stop the server (it runs in a session of its own and is killed as a group)."""
    directory = Path(directory).resolve()
    for _attempt in range(5):
        port = free_port(host)
        proc = subprocess.Popen(
            [sys.executable, "-m", "http.server", str(port), "--bind", host, "--directory", str(directory)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + timeout_s
            up = False
            while time.monotonic() < deadline and proc.poll() is None:
                with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
                    up = True
                    break
                time.sleep(0.05)
            if up:
                yield f"http://{host}:{port}"
                return
        finally:
            runner.kill_group(proc.pid, grace_s=2.0)
            proc.wait()
    raise RuntimeError(f"could not start an HTTP server for {directory}")


def ensure_chromium(executable: str | Path = CHROMIUM, script: str | Path = ENSURE_PACKAGES) -> tuple[Path | None, str]:
    """Debian's chromium, installing it with tools/ensure_debian_packages.sh when missing.
    Returns (path, "") or (None, why it is not available)."""
    executable = Path(executable)
    if executable.exists():
        return executable, ""
    script = Path(script)
    if not script.exists():
        return None, f"{executable} is missing and {script} does not exist"
    res = runner.run(["bash", str(script), f"{executable}:chromium"], timeout_s=900, echo=False, check=False)
    if executable.exists():
        return executable, ""
    last = "; ".join(ln for ln in res.tail[-5:] if ln.strip())
    return None, f"{executable} is missing and {script} could not install it (exit {res.returncode}: {last})"


_IMAGES_JS = """
async () => {
  const imgs = Array.from(document.images);
  for (const img of imgs) { if (img.loading === 'lazy') img.loading = 'eager'; }
  await Promise.all(imgs.map(img => img.complete ? null : new Promise(done => {
    img.addEventListener('load', done, {once: true});
    img.addEventListener('error', done, {once: true});
    setTimeout(done, 10000);
  })));
  return imgs.map(img => ({src: img.currentSrc || img.src || img.getAttribute('src') || '',
                           width: img.naturalWidth}));
}
"""
_LINKS_JS = "() => Array.from(document.querySelectorAll('a[href]')).map(a => a.href)"


def html_pages(html_dir: str | Path) -> list[Path]:
    """Every built page. The top-level folders starting with "_" hold assets, not pages
    (`_static/webpack-macros.html` is an unrendered Jinja fragment of the theme)."""
    html_dir = Path(html_dir)
    return sorted(p for p in html_dir.rglob("*.html")
                  if p.is_file() and not p.relative_to(html_dir).parts[0].startswith("_"))


def check_site(html_dir: str | Path, *, screenshots_dir: str | Path | None = None,
               chromium: str | Path | None = None, viewport: tuple[int, int] = (1280, 900),
               page_timeout_s: float = 30.0) -> SiteReport:
    """Serve a built site and visit every HTML page in headless chromium (Playwright, the system
    browser: Playwright's own download is never used). Every <img> must have decoded
    (naturalWidth > 0), every same-origin link must answer HTTP 200, no request may leave the
    origin (such requests are blocked and reported), no uncaught JavaScript error. A screenshot of
    each page goes to `screenshots_dir` (default: next to the html folder, `screenshots/`)."""
    from playwright.sync_api import Error as PlaywrightError  # deferred: only the site check needs a browser
    from playwright.sync_api import sync_playwright  # deferred: only the site check needs a browser

    html_dir = Path(html_dir).resolve()
    shots = Path(screenshots_dir) if screenshots_dir else html_dir.parent / "screenshots"
    if shots.exists():
        shutil.rmtree(shots)
    shots.mkdir(parents=True)
    exe = Path(chromium or CHROMIUM)
    if not exe.exists():
        raise FileNotFoundError(f"{exe} is missing (run tools/ensure_debian_packages.sh)")
    report = SiteReport(html_dir=html_dir)
    pages = html_pages(html_dir)
    links: dict[str, str] = {}  # url -> first page linking it

    with serve(html_dir) as base, sync_playwright() as pw:
        report.base_url = base
        origin = urllib.parse.urlsplit(base)[:2]
        browser = pw.chromium.launch(executable_path=str(exe), headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]},
                                          service_workers="block")
            current = {"page": ""}

            def route(r) -> None:
                url = r.request.url
                if url.startswith(("data:", "blob:", "about:")) or urllib.parse.urlsplit(url)[:2] == origin:
                    r.continue_()
                else:
                    report.external_requests.append((current["page"], url))
                    r.abort()

            context.route("**/*", route)
            page = context.new_page()
            page.on("pageerror", lambda e: report.page_errors.append((current["page"], str(e))))
            page.on("console", lambda m: report.console_errors.append((current["page"], m.text))
                    if m.type == "error" else None)
            page.on("response", lambda resp: report.failed_resources.append(
                (current["page"], resp.url, f"HTTP {resp.status}"))
                if resp.status >= 400 and urllib.parse.urlsplit(resp.url)[:2] == origin else None)
            aborted: list[tuple[str, str]] = []

            def request_failed(req) -> None:
                if urllib.parse.urlsplit(req.url)[:2] != origin:
                    return
                if "ERR_ABORTED" in (req.failure or ""):
                    # Chromium aborts what a page still loads when the next navigation starts (a
                    # redirect page, a lazy font): re-fetched below, reported only if it is broken.
                    aborted.append((current["page"], req.url))
                else:
                    report.failed_resources.append((current["page"], req.url, req.failure or "failed"))

            page.on("requestfailed", request_failed)

            for path in pages:
                rel = path.relative_to(html_dir).as_posix()
                current["page"] = rel
                report.pages.append(rel)
                try:
                    resp = page.goto(f"{base}/{urllib.parse.quote(rel)}", wait_until="load",
                                     timeout=page_timeout_s * 1000)
                except PlaywrightError as exc:
                    report.broken_links.append((rel, rel, f"did not load: {str(exc).splitlines()[0]}"))
                    continue
                if resp is None or resp.status != 200:
                    report.broken_links.append((rel, rel, f"HTTP {resp.status if resp else 'no response'}"))
                    continue
                for img in _evaluate(page, _IMAGES_JS):
                    report.images_checked += 1
                    if not img["width"]:
                        report.broken_images.append((rel, img["src"]))
                if page.url.split("#")[0] != f"{base}/{urllib.parse.quote(rel)}":
                    current["page"] = f"{rel} -> {page.url.removeprefix(base + '/')}"  # a redirect
                for href in _evaluate(page, _LINKS_JS):
                    parts = urllib.parse.urlsplit(href)
                    if parts.scheme in ("http", "https") and parts[:2] == origin:
                        links.setdefault(urllib.parse.urlunsplit(parts._replace(fragment="")), rel)
                shot = shots / (rel.replace("/", "__").removesuffix(".html") + ".png")
                page.screenshot(path=str(shot))
                report.screenshots.append(shot)
                _settle(page, page_timeout_s)
        finally:
            browser.close()

        for page_rel, url in aborted:
            status = _http_status(url)
            if status != 200:
                report.failed_resources.append((page_rel, url, f"aborted, then {status}"))

        for url, first_page in sorted(links.items()):
            report.links_checked += 1
            status = _http_status(url)
            if status != 200:
                report.broken_links.append((first_page, url, str(status)))
    return report


def _evaluate(page, script: str, attempts: int = 5):
    """page.evaluate that survives a navigation under way (a redirect page such as index.html)."""
    from playwright.sync_api import Error  # deferred: only the site check needs a browser

    for i in range(attempts):
        try:
            return page.evaluate(script)
        except Error as exc:
            if "context was destroyed" not in str(exc) or i == attempts - 1:
                raise
            page.wait_for_load_state("load")
    return None


def _settle(page, timeout_s: float) -> None:
    """Let a page finish what it loads after `load` (MathJax, web fonts) before the next visit."""
    from playwright.sync_api import Error  # deferred: only the site check needs a browser

    try:
        page.wait_for_load_state("networkidle", timeout=timeout_s * 1000)
    except Error:
        pass  # a page that never goes idle is not broken; anything it lost is re-fetched later


def _http_status(url: str, timeout_s: float = 10.0) -> int | str:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            resp.read(1)
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError) as exc:
        return f"error {exc}"


def external_references(html_dir: str | Path) -> dict[str, list[str]]:
    """Static scan: absolute http(s) URLs that pages load as scripts, styles, images or fonts
    (not plain links), by page. Empty when the site is self-contained."""
    pat = re.compile(r"<(?:script|link|img|iframe|source)\b[^>]*?\b(?:src|href)=[\"'](https?:)?//([^\"']+)[\"']",
                     re.IGNORECASE)
    found: dict[str, list[str]] = {}
    for p in html_pages(html_dir):
        text = p.read_text(encoding="utf-8", errors="replace")
        for m in pat.finditer(text):
            tag = m.group(0)
            loads = re.search(r"rel=[\"'](stylesheet|preload|icon|modulepreload)", tag, re.I)
            if re.match(r"<link\b", tag, re.I) and not loads:
                continue  # <link rel="canonical"> and the like load nothing
            found.setdefault(p.relative_to(html_dir).as_posix(), []).append("//" + m.group(2))
    return found


# ----------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m distlab.publish.book",
                                 description="Build the Jupyter Book site offline from the executed notebooks.")
    ap.add_argument("--source", type=Path, default=paths.BOOK_DIR,
                    help="book source: _config.yml, intro.md, notebooks/ (default %(default)s)")
    ap.add_argument("--out", type=Path, default=None,
                    help="build folder: src/ (staged input), html/, screenshots/ (default SOURCE/_build)")
    ap.add_argument("--notebooks-dir", type=Path, default=None,
                    help="executed notebooks (default SOURCE/notebooks)")
    ap.add_argument("--figures-dir", type=Path, default=None, help=f"figures and tables (default {paths.FIGURES_DIR})")
    ap.add_argument("--summary", type=Path, default=None,
                    help="regenerate's summary.json (default build/regenerate/summary.json)")
    ap.add_argument("--strict", action="store_true", help="fail on every Sphinx warning (-W --keep-going)")
    ap.add_argument("--check", action="store_true",
                    help="after building, visit every page in headless chromium (check_site)")
    ap.add_argument("--no-build", action="store_true", help="only check the site already built in OUT/html")
    ap.add_argument("--fetch-mathjax", action="store_true",
                    help=f"first install MathJax {MATHJAX_VERSION} from npm into {MATHJAX_NPM_DIR} "
                         "(once; pages with math then render offline)")
    ap.add_argument("--timeout-s", type=float, default=BUILD_TIMEOUT_S)
    ap.add_argument("-v", "--verbose", action="store_true", help="stream the Sphinx output")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = (args.out or args.source / "_build").resolve()
    html = out / "html"
    if args.fetch_mathjax and find_mathjax() is None:
        print("MathJax:", fetch_mathjax() or "could not be installed with npm (pages with math need the internet)")
    if not args.no_build:
        try:
            res = build(args.source, out, figures_dir=args.figures_dir, notebooks_dir=args.notebooks_dir,
                        summary_path=args.summary, strict=args.strict, timeout_s=args.timeout_s,
                        echo=args.verbose)
        except BookBuildError as exc:
            print(exc, file=sys.stderr)
            return 1
        for note in res.notes:
            print(f"note: {note}")
        others = [w for w in res.warnings if w not in res.fatal]
        if others:
            print(f"{len(others)} Sphinx warning(s) (not fatal; --strict makes them so):")
            for w in others[:20]:
                print(f"  {w}")
        print(f"built {len(res.chapters)} chapter(s), {res.figures} figure(s), {res.tables} table(s) "
              f"in {res.elapsed_s:.1f}s: {html / 'index.html'}")
        ext = external_references(html)
        if ext:
            print("warning: pages load resources from other hosts (they will not render offline):")
            for page, urls in sorted(ext.items())[:10]:
                print(f"  {page}: {', '.join(sorted(set(urls)))}")
    if args.check or args.no_build:
        exe, why = ensure_chromium()
        if exe is None:
            print(f"warning: site check skipped: {why}", file=sys.stderr)
            return 0
        report = check_site(html)
        print(report.summary())
        if not report.ok:
            return 1
    return 0


if __name__ == "__main__":
    run_main(main)
