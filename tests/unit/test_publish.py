"""make publish: the built site goes to a gh-pages branch through ghp-import, never from stale or
dirty figures. Published here to a local bare repository, and the pages read back from it."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from distlab import paths
from distlab.publish import freshness, pages


def _git(*args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


@pytest.fixture
def project(tmp_path, monkeypatch):
    for var, value in (("GIT_AUTHOR_NAME", "t"), ("GIT_AUTHOR_EMAIL", "t@example.invalid"),
                       ("GIT_COMMITTER_NAME", "t"), ("GIT_COMMITTER_EMAIL", "t@example.invalid")):
        monkeypatch.setenv(var, value)
    repo = tmp_path / "repo"
    (repo / "notebooks").mkdir(parents=True)
    (repo / "figures").mkdir()
    nb = repo / "notebooks" / "01_single_device_baseline.ipynb"
    shutil.copy(paths.NOTEBOOKS_DIR / nb.name, nb)
    (repo / "notebooks" / "profiles.yaml").write_text("cpu:\n  '*': {}\n")
    (repo / "lib").mkdir()
    (repo / "lib" / "code.py").write_text("x = 1\n")
    _git("init", "-q", "-b", "main", cwd=repo)
    _git("add", ".", cwd=repo)
    _git("commit", "-qm", "init", cwd=repo)
    (repo / "figures" / "01_x.csv").write_text("a\n1\n")
    (repo / "figures" / "01_x.csv.provenance.json").write_text(json.dumps(
        {"commit": _git("rev-parse", "--short", "HEAD", cwd=repo).strip(), "chapter": "01", "profile": "cpu",
         "inputs": freshness.chapter_inputs(nb, "cpu", {}, root=repo)}))
    html = tmp_path / "html"
    (html / "_static").mkdir(parents=True)
    (html / "index.html").write_text("<html><body>distlab book</body></html>")
    (html / "_static" / "style.css").write_text("body {}")
    bare = tmp_path / "pages.git"
    _git("init", "-q", "--bare", str(bare), cwd=tmp_path)
    return repo, html, bare


def _publish(repo, html, bare):
    return pages.publish(str(bare), html, repo=repo, figures_dir=repo / "figures",
                         notebooks_dir=repo / "notebooks")


def test_publish_pushes_the_site_to_gh_pages_of_a_bare_repository(project):
    repo, html, bare = project
    message = _publish(repo, html, bare)
    files = set(_git("ls-tree", "-r", "--name-only", "gh-pages", cwd=bare).split())
    assert files == {"index.html", "_static/style.css", ".nojekyll"}
    assert "distlab book" in _git("show", "gh-pages:index.html", cwd=bare)
    assert _git("log", "-1", "--format=%s", "gh-pages", cwd=bare).strip() == message
    (html / "index.html").write_text("<html><body>second build</body></html>")  # a second publish replaces it
    _publish(repo, html, bare)
    assert "second build" in _git("show", "gh-pages:index.html", cwd=bare)


def test_publish_refuses_stale_figures_and_pushes_nothing(project):
    repo, html, bare = project
    (repo / "lib" / "code.py").write_text("x = 2\n")  # the inputs change after the figure was drawn
    _git("commit", "-qam", "change", cwd=repo)
    with pytest.raises(pages.PublishRefused, match="stale"):
        _publish(repo, html, bare)
    assert _git("branch", "--list", cwd=bare).strip() == ""


def test_publish_refuses_a_dirty_tree_and_a_missing_build(project, tmp_path):
    repo, html, bare = project
    with pytest.raises(pages.PublishRefused, match="index.html"):
        pages.publish(str(bare), tmp_path / "nothing", repo=repo, figures_dir=repo / "figures",
                      notebooks_dir=repo / "notebooks")
    (repo / "notebooks" / "profiles.yaml").write_text("cpu:\n  '*': {}\n# edited\n")
    with pytest.raises(pages.PublishRefused, match="uncommitted"):
        _publish(repo, html, bare)
