"""Every committed figure and table names the clean commit and the exact inputs that drew it; the
incremental build reuses a chapter only while those inputs are unchanged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
import pytest

from distlab import paths
from distlab.publish import freshness
from distlab.publish.profiles import load_profiles, parameters_for


def test_every_committed_output_was_drawn_from_the_trees_inputs_at_a_clean_commit():
    problems = freshness.stale_outputs(paths.FIGURES_DIR, paths.NOTEBOOKS_DIR)
    assert not problems, ("run `make book` from a clean commit and commit figures/:\n"
                          + "\n".join(map(str, problems)))


def _chapter(tmp_path: Path, stem: str = "01_single_device_baseline") -> tuple[Path, Path, Path]:
    notebooks, figures = tmp_path / "notebooks", tmp_path / "figures"
    notebooks.mkdir()
    figures.mkdir()
    nb = notebooks / f"{stem}.ipynb"
    shutil.copy(paths.NOTEBOOKS_DIR / nb.name, nb)
    shutil.copy(paths.NOTEBOOKS_DIR / "profiles.yaml", notebooks / "profiles.yaml")
    params = parameters_for(load_profiles(notebooks / "profiles.yaml"), "cpu", nb)
    (figures / "01_x.csv").write_text("a\n1\n")
    (figures / "01_x.csv.provenance.json").write_text(json.dumps(
        {"commit": "abc1234", "chapter": "01", "profile": "cpu",
         "inputs": freshness.chapter_inputs(nb, "cpu", params)}))
    return nb, notebooks, figures


def _edit(nb: Path, cell_type: str) -> None:
    doc = nbformat.read(str(nb), as_version=4)
    cell = next(c for c in doc.cells if c.cell_type == cell_type)
    cell.source += "\n# an edit" if cell_type == "code" else "\n\nAn edit."
    nbformat.write(doc, str(nb))


def test_a_code_edit_makes_the_chapters_outputs_stale_and_a_prose_edit_does_not(tmp_path):
    nb, notebooks, figures = _chapter(tmp_path)
    assert freshness.stale_outputs(figures, notebooks) == []
    _edit(nb, "markdown")
    assert freshness.stale_outputs(figures, notebooks) == []
    _edit(nb, "code")
    (problem,) = freshness.stale_outputs(figures, notebooks)
    assert problem.output == "01_x.csv" and "stale" in problem.problem


@pytest.mark.parametrize("sidecar, words", [
    ({"commit": "abc1234+dirty"}, "uncommitted tree"),
    ({"commit": "abc1234"}, "no chapter/profile/inputs"),
    (None, "no provenance sidecar"),
])
def test_unclean_or_unrecorded_outputs_are_reported(tmp_path, sidecar, words):
    _, notebooks, figures = _chapter(tmp_path)
    side = figures / "01_x.csv.provenance.json"
    if sidecar is None:
        side.unlink()
    else:
        side.write_text(json.dumps({**json.loads(side.read_text()), **sidecar}
                                   if "+dirty" in sidecar["commit"] else sidecar))
    problems = freshness.stale_outputs(figures, notebooks)
    assert any(words in p.problem for p in problems), problems


def test_the_digest_covers_library_data_and_profile_but_not_untracked_files(tmp_path):
    nb = paths.NOTEBOOKS_DIR / "02_ddp_scaling.ipynb"
    base = freshness.chapter_inputs(nb, "cpu", {})
    assert freshness.chapter_inputs(nb, "cpu", {}) == base
    assert freshness.chapter_inputs(nb, "quick", {}) != base
    assert freshness.chapter_inputs(nb, "cpu", {"max_steps": 3}) != base
    tracked = freshness._tracked(paths.REPO_ROOT, freshness.SHARED_INPUTS)
    assert any(p.suffix == ".py" and "distlab" in p.parts for p in tracked)
    assert any("data" in p.relative_to(paths.REPO_ROOT).parts[:1] for p in tracked)
    assert not any("__pycache__" in p.parts for p in tracked)


def test_the_cache_reuses_a_clean_execution_with_current_prose_and_restores_outputs(tmp_path, monkeypatch):
    nb, _, figures = _chapter(tmp_path)
    cache = freshness.ChapterCache(tmp_path / "cache")
    before = cache.watch(figures)
    (figures / "01_new.png").write_bytes(b"png")
    monkeypatch.setattr(freshness, "git_commit", lambda: "abc1234")
    cache.store(nb.stem, "d1", "cpu", nb, figures, before)
    assert cache.lookup(nb.stem, "d2") is None
    assert cache.lookup(nb.stem, "d1")["outputs"] == ["01_new.png"]
    (figures / "01_new.png").write_bytes(b"changed")
    _edit(nb, "markdown")
    out = tmp_path / "out" / nb.name
    assert cache.restore(nb.stem, nb, out, figures) == ["01_new.png"]
    assert (figures / "01_new.png").read_bytes() == b"png"
    assert "An edit." in "".join(c.source for c in nbformat.read(str(out), as_version=4).cells)
    monkeypatch.setattr(freshness, "git_commit", lambda: "abc1234+dirty")
    cache.store(nb.stem, "d1", "cpu", nb, figures, before)
    assert cache.lookup(nb.stem, "d1") is None  # a dirty tree's outputs are never reused


def test_a_restored_copy_takes_new_cells_and_metadata_from_the_source_and_keeps_the_outputs(tmp_path, monkeypatch):
    nb, _, figures = _chapter(tmp_path)
    cache = freshness.ChapterCache(tmp_path / "cache")
    monkeypatch.setattr(freshness, "git_commit", lambda: "abc1234")
    doc = nbformat.read(str(nb), as_version=4)
    code = next(c for c in doc.cells if c.cell_type == "code" and "parameters" not in c.metadata.get("tags", []))
    code.outputs = [nbformat.v4.new_output("stream", text="an executed output\n")]
    params = next(i for i, c in enumerate(doc.cells) if "parameters" in c.metadata.get("tags", []))
    doc.cells.insert(params + 1, nbformat.v4.new_code_cell("max_steps = 3", metadata={"tags": ["injected-parameters"]}))
    executed = tmp_path / "executed.ipynb"
    nbformat.write(doc, str(executed))
    cache.store(nb.stem, "d1", "cpu", executed, figures, cache.watch(figures))
    source = nbformat.read(str(nb), as_version=4)  # the prose grows an answer, a code cell is collapsed
    source.cells.insert(len(source.cells), nbformat.v4.new_markdown_cell(":::{dropdown} Answer\nNew.\n:::"))
    collapsed = next(c for c in source.cells if c.get("id") == code["id"])
    collapsed.metadata["jupyter"] = {"source_hidden": True}
    nbformat.write(source, str(nb))
    out = tmp_path / "out" / nb.name
    cache.restore(nb.stem, nb, out, figures)
    cells = nbformat.read(str(out), as_version=4).cells
    assert [c.source for c in cells if c.cell_type == "markdown"] == [c.source for c in source.cells
                                                                       if c.cell_type == "markdown"]
    again = next(c for c in cells if c.get("id") == code["id"])
    assert again.outputs[0]["text"] == "an executed output\n" and again.metadata["jupyter"] == {"source_hidden": True}
    assert "injected-parameters" in cells[params + 1].metadata.get("tags", [])


def test_check_on_folders_with_nothing_to_compare_is_an_error_not_a_pass(tmp_path):
    _, notebooks, figures = _chapter(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(freshness.NothingToCheck, match="no outputs"):
        freshness.stale_outputs(empty, notebooks)
    with pytest.raises(freshness.NothingToCheck, match="no NN_\\*.ipynb notebooks"):
        freshness.stale_outputs(figures, empty)


def test_a_binary_sidecar_is_a_problem_naming_it(tmp_path):
    _, notebooks, figures = _chapter(tmp_path)
    (figures / "01_x.csv.provenance.json").write_bytes(b"\x00\xff\xfe binary")
    (problem,) = freshness.stale_outputs(figures, notebooks)
    assert problem.output == "01_x.csv" and "01_x.csv.provenance.json is not JSON text" in problem.problem
