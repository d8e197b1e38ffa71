"""Provenance names the commit of the inputs: regenerated outputs do not make the tree dirty, a
changed input does; and reading it never takes git's index lock."""

import os
import re
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


# ------------------------------------------------------------------ no index lock

class _Created:
    """The names created in one folder while the block runs, from the kernel's inotify queue (Linux):
    a lock file that lives for a millisecond is still seen, which no polling loop can promise."""

    IN_CREATE, IN_MOVED_TO = 0x100, 0x80

    def __init__(self, folder):
        import ctypes
        import ctypes.util

        self.libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        assert self.fd >= 0, "inotify_init1 failed"
        wd = self.libc.inotify_add_watch(self.fd, str(folder).encode(), self.IN_CREATE | self.IN_MOVED_TO)
        assert wd >= 0, "inotify_add_watch failed"
        self.names: list[str] = []

    def read(self) -> list[str]:
        import struct

        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return self.names
            i = 0
            while i < len(buf):
                _wd, _mask, _cookie, size = struct.unpack_from("iIII", buf, i)
                self.names.append(buf[i + 16:i + 16 + size].rstrip(b"\0").decode())
                i += 16 + size

    def close(self):
        os.close(self.fd)


def _repo_with_a_touched_file(root):
    """A repository whose one tracked file has a newer mtime than the index records (same content): the
    state in which `git status` rewrites the index, as after any editor save or checkout."""
    _git(root, "init", "-q")
    (root / "code.py").write_text("x = 1\n")
    _git(root, "add", ".")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    st = (root / "code.py").stat()
    os.utime(root / "code.py", ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))


def test_provenance_never_takes_the_index_lock(tmp_path):
    _repo_with_a_touched_file(tmp_path)
    index = tmp_path / ".git" / "index"
    before = index.read_bytes()
    watch = _Created(tmp_path / ".git")
    try:
        commit = git_commit(root=tmp_path)
        assert commit != "unknown" and not commit.endswith("+dirty")
        assert "index.lock" not in watch.read(), "git_commit created .git/index.lock"
        assert index.read_bytes() == before
        # The control: the plain command takes the lock and rewrites the index in this same state, so the
        # two assertions above can fail (this is what every training rank did before).
        _git(tmp_path, "status", "--porcelain")
        assert "index.lock" in watch.read() and index.read_bytes() != before
    finally:
        watch.close()


def test_provenance_works_while_the_user_holds_the_index_lock(tmp_path):
    _repo_with_a_touched_file(tmp_path)
    lock = tmp_path / ".git" / "index.lock"
    lock.write_bytes(b"held by the user's git add\n")
    os.utime(lock, ns=(1_000_000_000, 1_000_000_000))
    (tmp_path / "code.py").write_text("x = 2\n")
    commit = git_commit(root=tmp_path)
    assert commit.endswith("+dirty") and commit != "unknown"
    assert lock.read_bytes() == b"held by the user's git add\n" and lock.stat().st_mtime_ns == 1_000_000_000


def test_every_git_call_in_the_library_goes_through_run_git():
    """A new `subprocess.run(["git", ...])` elsewhere would take the lock again: only run_git starts git."""
    from pathlib import Path

    lib = Path(__file__).resolve().parents[2] / "lib" / "distlab"
    offenders = [str(p.relative_to(lib)) for p in lib.rglob("*.py")
                 if re.search(r"""\[\s*["']git["']""", p.read_text()) and p.name != "provenance.py"]
    assert offenders == []
