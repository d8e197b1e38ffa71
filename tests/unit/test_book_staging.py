"""The book's table of contents: the intro, the workshop guide, the chapters in numeric order, the appendix
pages, then the results page; a hand-written page that no table of contents lists is reported, not lost."""

from __future__ import annotations

import json

import yaml

from distlab import paths
from distlab.publish import book_staging


def _notebook(path, title):
    path.write_text(json.dumps({"cells": [{"cell_type": "markdown", "metadata": {}, "source": f"# {title}\n"}],
                                "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))


def test_toc_orders_intro_workshop_chapters_appendices_results(tmp_path):
    source = tmp_path / "book"
    source.mkdir()
    (source / "_config.yml").write_text((paths.BOOK_DIR / "_config.yml").read_text())
    (source / "intro.md").write_text("# Intro\n")
    (source / "workshop.md").write_text("# Workshop guide\n")
    (source / "appendix_kubernetes.md").write_text("# Appendix B · Kubernetes\n")
    (source / "appendix_benchmarks.md").write_text("# Appendix A · Benchmarks\n")
    (source / "stray.md").write_text("# A page nobody lists\n")
    executed = tmp_path / "executed"
    executed.mkdir()
    _notebook(executed / "10_ten.ipynb", "10 · Ten")
    _notebook(executed / "02_two.ipynb", "02 · Two")
    staged = book_staging.stage(source, tmp_path / "src", figures_dir=tmp_path / "nofigures",
                                notebooks_dir=executed)
    toc = yaml.safe_load(staged["toc"].read_text())
    assert toc["root"] == "intro"
    assert [e["file"] for e in toc["chapters"]] == ["workshop", "notebooks/02_two", "notebooks/10_ten",
                                                    "appendix_benchmarks", "appendix_kubernetes", "results"]
    assert toc["chapters"][0]["title"] == "Workshop guide"
    assert any("stray.md is in no table of contents" in note for note in staged["notes"])


def test_the_repository_book_lists_every_page_it_holds():
    front, appendices = book_staging.extra_pages(paths.BOOK_DIR)
    listed = {"intro.md", *(p.name for p in front + appendices)}
    assert {p.name for p in paths.BOOK_DIR.glob("*.md")} <= listed
    assert (paths.BOOK_DIR / "workshop.md") in front


def test_recorded_gpu_measurements_are_staged_beside_the_figures(tmp_path):
    """figures/gpu holds dated GPU records (no build here redraws them): the book gets them as they are."""
    source = tmp_path / "book"
    source.mkdir()
    (source / "_config.yml").write_text((paths.BOOK_DIR / "_config.yml").read_text())
    (source / "intro.md").write_text("# Intro\n")
    figures = tmp_path / "figures"
    (figures / "gpu" / "raw").mkdir(parents=True)
    (figures / "gpu" / "ladder.csv").write_text("rung,tokens_per_s\n0,1311\n")
    (figures / "gpu" / "raw" / "environment.log").write_text("NVIDIA H100\n")
    book_staging.stage(source, tmp_path / "src", figures_dir=figures, notebooks_dir=tmp_path / "none")
    staged = tmp_path / "src" / "figures" / "gpu"
    assert (staged / "ladder.csv").read_text() == "rung,tokens_per_s\n0,1311\n"
    assert (staged / "raw" / "environment.log").exists()


def test_the_workshop_guide_shows_each_chapters_run_time_beside_its_agenda_slot(tmp_path):
    """The run times come from each executed notebook's papermill record; a chapter whose run outlasts its
    agenda slot is reported."""
    source = tmp_path / "book"
    source.mkdir()
    (source / "_config.yml").write_text((paths.BOOK_DIR / "_config.yml").read_text())
    (source / "intro.md").write_text("# Intro\n")
    (source / "workshop.md").write_text(
        "# Workshop guide\n\n| time | what |\n|---|---|\n| 0:00 | Chapter 01, one device |\n"
        "| 0:30 | Chapter 02, DDP |\n| 0:40 | Wrap-up |\n\n" + book_staging.RUN_TIMES_MARKER + "\n")
    executed = tmp_path / "executed"
    executed.mkdir()
    for name, title, seconds in (("01_one", "01 · One: a device", 600.0), ("02_two", "02 · Two", 900.0)):
        _notebook(executed / f"{name}.ipynb", title)
        nb = json.loads((executed / f"{name}.ipynb").read_text())
        nb["metadata"]["papermill"] = {"duration": seconds, "end_time": "2026-11-29T11:11:16.27+00:00"}
        (executed / f"{name}.ipynb").write_text(json.dumps(nb))
    staged = book_staging.stage(source, tmp_path / "src", figures_dir=tmp_path / "nofigures", notebooks_dir=executed)
    page = (tmp_path / "src" / "workshop.md").read_text()
    assert book_staging.RUN_TIMES_MARKER not in page
    assert "| 01 · One | 10.0 min | 2026-11-29 11:11 UTC | 30 min |" in page
    assert "| 02 · Two | 15.0 min | 2026-11-29 11:11 UTC | 10 min |" in page
    assert [n for n in staged["notes"] if "workshop.md" in n] == [
        "workshop.md: chapter 02 runs 15.0 min, longer than its 10-minute slot"]
    assert (source / "workshop.md").read_text().count(book_staging.RUN_TIMES_MARKER) == 1  # the source is kept
