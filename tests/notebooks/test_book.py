"""python -m distlab.publish.book: the Jupyter Book builds offline and every page of the site renders.

A small book input is prepared in a temporary folder (the repo's _config.yml, intro and workshop pages, one
fixture notebook executed by regenerate that draws a matplotlib figure and saves a figure and a table
with provenance sidecars into a temporary figures folder), built, served on 127.0.0.1 and visited
page by page in Debian's chromium through Playwright (distlab.publish.site_check.check_site).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from distlab.publish import book_build, book_staging, regenerate, site_check

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "notebooks"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def chromium() -> Path:
    exe, why = site_check.ensure_chromium()
    if exe is None:
        print(f"site checks skipped: {why}")
        pytest.skip(why)
    return exe


def _book_source(root: Path) -> Path:
    src = root / "book"
    src.mkdir(parents=True)
    # The intro and the front pages; the appendix pages show the committed benchmark tables, which this
    # small book's figures folder does not hold (tests/notebooks/test_notebooks.py builds the whole book with them).
    for name in ("_config.yml", "intro.md", *(f"{page}.md" for page in book_staging.FRONT_PAGES)):
        shutil.copy(REPO / "book" / name, src / name)
    return src


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """One executed fixture notebook + its figure and table, built into a site once per module."""
    root = tmp_path_factory.mktemp("book")
    src = _book_source(root)
    nbdir = root / "notebooks"
    nbdir.mkdir()
    shutil.copy(FIXTURES / "04_figure.ipynb", nbdir / "04_figure.ipynb")
    figures = root / "figures"
    results = regenerate.regenerate(notebooks_dir=nbdir, out_dir=src / "notebooks", work_dir=root / "work",
                                    figures_dir=figures, timeout_s=120)
    assert [r.status for r in results] == ["ok"], results[0].message
    assert (figures / "fixture_squares.png.provenance.json").exists()
    res = book_build.build(src, root / "out", figures_dir=figures, summary_path=root / "work" / "summary.json")
    return {"root": root, "src": src, "figures": figures, "result": res, "html": res.html_dir}


def test_build_has_chapters_results_and_provenance(built):
    html = built["html"]
    res = built["result"]
    assert res.chapters == ["notebooks/04_figure"]
    assert (res.figures, res.tables) == (1, 1)
    assert not res.fatal
    toc = (res.src_dir / "_toc.yml").read_text()
    assert toc.index("notebooks/04_figure") < toc.index("results")
    assert (html / "intro.html").exists() and (html / "notebooks" / "04_figure.html").exists()
    results = (html / "results.html").read_text()
    # The figure is on the results page with the provenance line from its sidecar, and the table
    # is linked (download) and shown.
    assert "fixture_squares.png" in results
    assert "fixture CPU | model none | world size 1" in results
    assert "fixture_squares.csv" in results and "<table" in results
    assert "Latest regeneration" in results
    # Nothing loaded from another host: the theme's assets are bundled.
    assert site_check.external_references(html) == {}
    # No launch buttons or repository links.
    intro = (html / "intro.html").read_text()
    assert "binder" not in intro.lower() and "github.com" not in intro


def test_every_page_renders_offline(built, chromium):
    html = built["html"]
    report = site_check.check_site(html, chromium=chromium)
    print(report.summary())
    assert report.ok, report.summary()
    assert {"intro.html", "results.html", "notebooks/04_figure.html"} <= set(report.pages)
    assert set(report.pages) == {p.relative_to(html).as_posix() for p in book_build.html_pages(html)}
    assert report.images_checked >= 2  # the notebook's inline figure and the results page's
    assert report.links_checked > 0
    assert len(report.screenshots) == len(report.pages)
    for shot in report.screenshots:
        data = shot.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 2000, shot
    # The HTTP server check_site started is gone.
    me = psutil.Process()
    servers = [p for p in me.children(recursive=True) if "http.server" in " ".join(p.cmdline())]
    assert not servers


def test_check_site_reports_broken_images_and_links(built, chromium, tmp_path):
    broken = tmp_path / "html"
    shutil.copytree(built["html"], broken)
    for img in (broken / "_images").iterdir():
        img.write_bytes(b"not an image")
    page = broken / "intro.html"
    page.write_text(page.read_text().replace("</article>", '<a href="missing-page.html">x</a></article>', 1))
    report = site_check.check_site(broken, chromium=chromium, screenshots_dir=tmp_path / "shots")
    assert not report.ok
    assert report.broken_images, report.summary()
    assert any(url.endswith("missing-page.html") for _, url, _ in report.broken_links), report.summary()


def test_empty_book_builds_and_says_so(tmp_path):
    src = _book_source(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "distlab.publish.book", "--source", str(src), "--out", str(tmp_path / "out"),
         "--figures-dir", str(tmp_path / "no_figures"), "--summary", str(tmp_path / "none.json")],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no executed notebooks" in proc.stdout
    html = tmp_path / "out" / "html"
    assert (html / "intro.html").exists() and (html / "index.html").exists()
    assert "No executed notebooks were found" in (html / "results.html").read_text()


def test_broken_page_fails_the_build(tmp_path):
    src = _book_source(tmp_path)
    intro = src / "intro.md"
    intro.write_text(intro.read_text() + "\n![a figure that does not exist](figures/nowhere.png)\n")
    with pytest.raises(book_staging.BookBuildError, match="nowhere.png"):
        book_build.build(src, tmp_path / "out", figures_dir=tmp_path / "no_figures",
                         summary_path=tmp_path / "none.json")
