"""The Jupyter Book (1.x, Sphinx) HTML site, built offline from the staged input (book_staging).

Jupyter Book renders the notebooks as they are (`execute_notebooks: off`); the HTML lands in
OUT/html, with a local MathJax in `_static/` when there is one (distlab.publish.mathjax). The build
fails on Sphinx errors and on the warnings that mean a broken page (a missing image, download or
include, an unknown document or reference, an unknown directive or role); `strict` fails on every
warning.
"""

from __future__ import annotations

import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from distlab import paths
from distlab.jsonio import strict_json
from distlab.launch import process
from distlab.publish.book_staging import BookBuildError, stage
from distlab.publish.mathjax import MATHJAX_CDN, find_mathjax, install_mathjax

BUILD_TIMEOUT_S = 900.0

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

# build_sphinx through Jupyter Book's own API, in a subprocess (process.run: killable, timed out).
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
           str(staged["toc"]), "1" if strict else "0", strict_json(overrides)]
    res = process.run(cmd, timeout_s=timeout_s, log_path=out / "build.log", echo=collect, check=False,
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
        install_mathjax(es5, html)
    elif html.is_dir() and any(MATHJAX_CDN in p.read_text(errors="replace") for p in html_pages(html)):
        result.notes.append("pages with math load MathJax from a CDN and will not render it offline: "
                            "run `python -m distlab.publish.book --fetch-mathjax` once (npm) or set DISTLAB_MATHJAX")
    if problems:
        tail = [f"    | {ln}" for ln in res.tail[-25:]] if not res.ok and not fatal else []
        raise BookBuildError("book build failed: " + "\n".join(problems + tail)
                             + f"\n  full log: {out / 'build.log'}")
    return result


def html_pages(html_dir: str | Path) -> list[Path]:
    """Every built page. The top-level folders starting with "_" hold assets, not pages
    (`_static/webpack-macros.html` is an unrendered Jinja fragment of the theme)."""
    html_dir = Path(html_dir)
    return sorted(p for p in html_dir.rglob("*.html")
                  if p.is_file() and not p.relative_to(html_dir).parts[0].startswith("_"))
