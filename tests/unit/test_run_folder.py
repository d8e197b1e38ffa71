"""A run's output folder on a shared machine: one run at a time, a lock naming its holder, taken over from a dead
run (real flock, a real holder process killed), and a second `make book` into the same work folder refused. Two
training runs into one folder, and a disk that fills up: tests/launches/test_run_folder_runs.py."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from distlab.folder_lock import LOCK_NAME, FolderInUse, FolderLock

# ---------------------------------------------------------------------- one run per folder

def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    with FolderLock(tmp_path, "training run"):
        with pytest.raises(FolderInUse) as refused:
            FolderLock(tmp_path, "training run").acquire()
    said = str(refused.value)
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in said and str(tmp_path) in said
    assert "\n" not in said
    with FolderLock(tmp_path) as again:  # released: free again, and nothing stale to report
        assert again.took_over is None


def test_a_dead_holders_lock_is_taken_over_and_said_so(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from distlab.folder_lock import FolderLock; "
                               f"FolderLock({str(tmp_path)!r}).acquire(); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(FolderInUse):
        FolderLock(tmp_path).acquire()
    holder.send_signal(signal.SIGKILL)  # no cleanup: the file still names it
    holder.wait()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == holder.pid
    lock = FolderLock(tmp_path, "training run").acquire()
    try:
        assert lock.took_over["pid"] == holder.pid
        assert f"no longer running (pid {holder.pid} on host" in lock.describe_takeover()
    finally:
        lock.release()


# ---------------------------------------------------------------------- a full disk


def test_a_second_book_run_into_the_same_work_folder_is_refused(tmp_path):
    """`make book` twice at once would execute into one executing/ folder: the second is refused, naming the first."""
    from distlab.publish.regenerate import regenerate  # deferred: papermill and nbformat, for this test only

    work = tmp_path / "work"
    (tmp_path / "notebooks").mkdir()
    with FolderLock(work, "notebook run (make book)"):
        said = f"{work}: in use by another notebook run (make book) (pid {os.getpid()}"
        with pytest.raises(FolderInUse, match=re.escape(said)):
            regenerate(notebooks_dir=tmp_path / "notebooks", out_dir=tmp_path / "out", work_dir=work,
                       profiles_file=tmp_path / "none.yaml", stream=open(os.devnull, "w"))
