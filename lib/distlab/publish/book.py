"""Build the tutorial's Jupyter Book offline from the executed notebooks, and check it: the command.

    python -m distlab.publish.book [--source book] [--out book/_build] [--check] [--strict] [--fetch-mathjax]

The work is done by the modules below it: book_staging (the build input in OUT/src: the pages, the
executed notebooks, the figures and tables, the generated `_toc.yml` and `results.md`), book_build
(the Sphinx build into OUT/html, failing on warnings that mean a broken page; `--strict` on every
warning), mathjax (a local MathJax, so pages with math render offline; `--fetch-mathjax` installs it
from npm once) and site_check (`--check`: every page visited in headless chromium, screenshots in
OUT/screenshots).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from distlab import paths
from distlab.cli import finite_float, run_main
from distlab.publish.book_build import BUILD_TIMEOUT_S, build
from distlab.publish.book_staging import BookBuildError
from distlab.publish.mathjax import MATHJAX_NPM_DIR, MATHJAX_VERSION, fetch_mathjax, find_mathjax
from distlab.publish.site_check import check_site, ensure_chromium, external_references


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
    ap.add_argument("--timeout-s", type=finite_float, default=BUILD_TIMEOUT_S)
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
