"""Provenance names the commit of the inputs: regenerated outputs do not make the tree dirty, a
changed input does."""

import subprocess

from distlab.publish.provenance import OUTPUT_PATHS, git_commit


def _git(root, *args):
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


def test_dirty_means_a_changed_input_not_a_regenerated_output(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / OUTPUT_PATHS[0]).mkdir()
    (tmp_path / OUTPUT_PATHS[0] / "plot.csv").write_text("a\n1\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "inputs and outputs")
    clean = git_commit(root=tmp_path)
    assert clean and not clean.endswith("+dirty") and clean != "unknown"

    (tmp_path / OUTPUT_PATHS[0] / "plot.csv").write_text("a\n2\n")  # what a book build does
    assert git_commit(root=tmp_path) == clean

    (tmp_path / "code.py").write_text("x = 2\n")  # an input changed: the outputs no longer follow the commit
    assert git_commit(root=tmp_path) == clean + "+dirty"
