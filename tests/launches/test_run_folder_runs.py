"""A run's output folder on a shared machine, with real training runs: a second run into a running one's folder is
refused, and a disk that fills up costs the checkpoint being written, never the one before it (too little space
found before writing). Real processes, a real (small) tmpfs that really fills. The folder lock itself:
tests/unit/test_run_folder.py."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distlab import checkpoint
from distlab.folder_lock import LOCK_NAME
from distlab.metrics import read_log
from distlab.paths import REPO_ROOT

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
