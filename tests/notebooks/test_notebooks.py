"""Every chapter end to end, as a workshop attendee runs it (distlab.publish.attendee: papermill with the quick
profile as a normal user, one core per chapter, no timeout/ip/tc/Slurm/compiler on PATH), then the Jupyter Book
build from those executed chapters, and every page checked in headless Chromium. Writes only to a temporary
folder. The root-only paths of chapters 05, 06 and 08 (emulated hosts, the Slurm cluster) run in `make book`, and
their mechanisms in tests/clusters/ (test_lan*.py, test_slurm_runs.py, test_inference_resume_runs.py) and
tests/launches/test_tp_links_runs.py."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from distlab import paths
from distlab.publish import attendee, book_build, mathjax, site_check


@pytest.fixture(scope="module")
def executed():
    # under /tmp itself: pytest's own temporary folders are closed to other users, and the chapters run as one
    root = Path(tempfile.mkdtemp(prefix="distlab-attendee-"))
    summary = attendee.attend(root)
    print("\n".join(attendee.skipped_lines(root / "notebooks")))
    failed = [f"{n['name']}: cell {n['failing_cell']}: {n['message']}" for n in summary.get("notebooks", [])
              if n["status"] != "ok"]
    logs = "\n".join((root / f"lane{i}.log").read_text()[-3000:] for i in range(2) if (root / f"lane{i}.log").exists())
    assert summary["ok"], "a chapter failed as an attendee runs it:\n" + "\n".join(failed) + "\n" + logs
    yield root, root / "notebooks", root / "figures", root
    shutil.rmtree(root, ignore_errors=True)


def test_every_notebook_executes_and_stays_clean_in_git(executed):
    _, out, _, work = executed
    sources = sorted(p.name for p in paths.NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))
    assert sorted(p.name for p in out.glob("*.ipynb")) == sources
    summary = json.loads((work / "summary.json").read_text())
    assert summary and all(entry["status"] == "ok" for entry in summary["notebooks"])
    # The executed copies carry outputs; the sources in git do not (tests/unit/test_packaging.py).
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
    for sidecar in paths.FIGURES_DIR.glob("*.provenance.json"):  # the appendix's tables: `make benchmarks`, not a
        if "benchmark" in json.loads(sidecar.read_text()):  # notebook, made them: each sidecar names its benchmark
            for made in (sidecar, sidecar.with_name(sidecar.name.removesuffix(".provenance.json"))):
                shutil.copy(made, figures / made.name)
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
