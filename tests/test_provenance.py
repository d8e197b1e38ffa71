"""Provenance names the commit of the inputs: regenerated outputs do not make the tree dirty, a
changed input does."""

import subprocess

from distlab.provenance import OUTPUT_PATHS, git_commit


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


def test_the_figure_stamp_sits_below_everything_drawn(tmp_path):
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    from distlab.provenance import save_figure

    stamp = {"device": "CPU", "model": "m", "world_size": 1, "commit": "abc1234", "date": "2026-01-01 00:00 UTC"}
    pyplot_fig, _ = plt.subplots()
    for i, fig in enumerate((Figure(figsize=(4, 3)), pyplot_fig)):  # a bare Figure has no pyplot canvas
        ax = fig.axes[0] if fig.axes else fig.add_subplot()
        ax.plot([0, 1])
        ax.set_xlabel("optimizer step")
        path = save_figure(fig, tmp_path / f"f{i}.png", stamp)
        label = ax.xaxis.label.get_window_extent()
        text = next(t for t in fig.texts if "abc1234" in t.get_text()).get_window_extent()
        assert text.y1 < label.y0, "the provenance line overlaps the x-axis label"
        assert json.loads(path.with_name(path.name + ".provenance.json").read_text())["commit"] == "abc1234"
    plt.close(pyplot_fig)
