"""A run's output folder on a shared machine: one run at a time (a lock naming its holder, taken over from a
dead run), and a disk that fills up costs the checkpoint being written, never the one before it. Real flock,
real processes, a real (small) tmpfs that really fills."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distlab import checkpoint
from distlab.folder_lock import LOCK_NAME, FolderInUse, FolderLock
from distlab.metrics import read_log

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG = REPO_ROOT / "lib/distlab/configs/tiny_lora.yaml"
SETTINGS = {"max_steps": 8, "global_batch_size": 4, "micro_batch_size": 2, "seq_len": 128, "logging_steps": 1,
            "lora_dropout": 0.0, "eval_at_start": False, "eval_file": None, "warmup_steps": 2, "progress": False}


def _train_cmd(out: Path, **settings) -> list[str]:
    sets = [w for k, v in {**SETTINGS, **settings, "output_dir": str(out)}.items()
            for w in ("--set", f"{k}={'null' if v is None else v}")]
    return [sys.executable, "-m", "distlab.train", "--config", str(CONFIG), *sets]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


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


@pytest.mark.slow
def test_two_runs_into_one_folder_the_second_is_refused(tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen(_train_cmd(out, max_steps=30), cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ((out / LOCK_NAME).exists() and (out / LOCK_NAME).read_text().strip()):
            assert time.monotonic() < deadline and first.poll() is None, "the first run never took its folder"
            time.sleep(0.1)
        second = subprocess.run(_train_cmd(out, max_steps=30), cwd=REPO_ROOT, env=_env(), capture_output=True,
                                text=True, timeout=300)
        assert second.returncode == 2
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr
        assert f"{out}: in use by another training run (pid {first.pid} on host {socket.gethostname()}" in lines[0]
        _, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err
    steps = read_log(out / "train_log.jsonl")
    assert [r["step"] for r in steps] == list(range(1, 31))  # one run's log, every step once
    assert not (out / LOCK_NAME).read_text().strip()  # released on the way out


# ---------------------------------------------------------------------- a full disk

@pytest.fixture
def small_disk(tmp_path):
    """A 24 MiB tmpfs (needs root to mount): room for the run and two checkpoints, and nothing else."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    where = tmp_path / "disk"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.slow
def test_a_disk_that_fills_mid_save_keeps_the_previous_checkpoint(small_disk):
    out = small_disk / "run"
    full = subprocess.run(_train_cmd(out, checkpoint_steps=3), cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300, env=_env(DISTLAB_FILL_DISK_AT_CHECKPOINT="6", DISTLAB_KILL_RANK="0"))
    assert full.returncode == 2, full.stderr
    lines = full.stderr.strip().splitlines()
    assert len(lines) == 1, full.stderr  # one line, no traceback
    assert f"{out}/checkpoints/.tmp-step-00000006: writing the checkpoint of step 6 failed" in lines[0]
    assert ": the file system was full (" in lines[0] and "the checkpoint needs about" in lines[0], lines[0]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000003"]  # the partial one is gone
    # space freed: the same command resumes from step 3 and finishes
    (out / "fill-disk.ballast").unlink()
    again = subprocess.run(_train_cmd(out, checkpoint_steps=3), cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=300, env=_env())
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stdout and "step-00000003" in again.stdout
    assert [r["step"] for r in read_log(out / "train_log.jsonl")] == list(range(1, 9))


@pytest.mark.slow
def test_too_little_space_is_found_before_writing(small_disk):
    out = small_disk / "run"
    out.mkdir()
    ballast = out / "other-data"
    free = shutil.disk_usage(small_disk).free
    with open(ballast, "wb") as fh:  # leave 64 KiB: less than any checkpoint of the run
        fh.write(bytes(free - (64 << 10)))
    short = subprocess.run(_train_cmd(out, checkpoint_steps=3), cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=300, env=_env())
    assert short.returncode == 2, short.stderr
    lines = short.stderr.strip().splitlines()
    assert len(lines) == 1, short.stderr
    assert f"{out}/checkpoints/.tmp-step-00000003: not written" in lines[0] and "the checkpoint needs about" in lines[0]
    assert not any((out / "checkpoints").glob(".tmp-*")) if (out / "checkpoints").exists() else True
    assert checkpoint.latest(out) is None


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
