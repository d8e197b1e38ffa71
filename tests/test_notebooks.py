"""Every chapter end to end, as `make book` runs it: papermill with the quick profile, the Jupyter
Book build, and every page checked in headless Chromium. Writes only to a temporary folder."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from distlab import paths
from distlab.publish import book_build, mathjax, site_check

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    root = tmp_path_factory.mktemp("book")
    out, figures, work = root / "notebooks", root / "figures", root / "work"
    proc = subprocess.run([sys.executable, "-m", "distlab.publish.regenerate", "--profile", "quick",
                           "--out-dir", str(out), "--figures-dir", str(figures), "--work-dir", str(work),
                           "--timeout-s", "900", "--force", "--cache-dir", str(root / "cache")],
                          capture_output=True, text=True, timeout=2400)
    print(proc.stdout[-4000:], proc.stderr[-4000:])
    assert proc.returncode == 0, f"regenerate failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return root, out, figures, work


def test_every_notebook_executes_and_stays_clean_in_git(executed):
    _, out, _, work = executed
    sources = sorted(p.name for p in paths.NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))
    assert sorted(p.name for p in out.glob("*.ipynb")) == sources
    summary = json.loads((work / "summary.json").read_text())
    assert summary and all(entry["status"] == "ok" for entry in summary["notebooks"])
    # The executed copies carry outputs; the sources in git do not (tests/test_packaging.py).
    nb = json.loads((out / sources[0]).read_text())
    assert any(c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")


def test_figures_carry_provenance(executed):
    _, _, figures, _ = executed
    pngs = sorted(figures.glob("*.png"))
    assert len(pngs) >= 6
    for png in pngs:
        side = json.loads(png.with_name(png.name + ".provenance.json").read_text())
        assert {"device", "model", "world_size", "commit", "date"} <= set(side), png.name


def test_book_builds_and_every_page_loads_in_a_browser(executed):
    root, out, figures, work = executed
    chromium, why = site_check.ensure_chromium()
    if chromium is None:
        pytest.fail(f"headless chromium is required for the site check: {why}")
    # Pages with maths must render offline: MathJax comes from npm once (make book does the same).
    assert mathjax.find_mathjax() or mathjax.fetch_mathjax(), "could not install MathJax from npm"
    for table in paths.FIGURES_DIR.glob("bench_*"):  # the appendix's tables: `make benchmarks`, not a notebook
        shutil.copy(table, figures / table.name)
    shutil.copytree(paths.FIGURES_DIR / "gpu", figures / "gpu", dirs_exist_ok=True)  # dated records of a lent GPU
    built = book_build.build(paths.BOOK_DIR, root / "_build", figures_dir=figures, notebooks_dir=out,
                       summary_path=work / "summary.json")
    report = site_check.check_site(built.html_dir, chromium=chromium)
    assert report.ok, report.summary()
    names = {Path(p).name for p in report.pages}
    for nb in out.glob("*.ipynb"):
        assert f"{nb.stem}.html" in names
    assert "results.html" in names and report.images_checked >= 6
    assert all(s.stat().st_size > 0 for s in report.screenshots)
