"""Loading a checkpoint never runs code from it, through the real CLI: a resume refuses a crafted checkpoint file
(one whose pickle names os.system, touching a marker file) in one line naming it before anything unpickles it, FSDP's
and ZeRO's resumes refuse crafted state before their loaders read it, and a run's own checkpoint still resumes. The
checks themselves, on crafted files that really run their command when unpickled: tests/unit/test_safe_load.py."""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from distlab import checkpoint
from distlab.metrics import read_log
from distlab.safe_load import check_dcp, check_deepspeed
from helpers import RunsCommand, checkpointed_run_argv, craft

PROG = "python -m distlab.train"


def train_cli(output_dir: Path, env: dict | None = None, **extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distlab.train", *checkpointed_run_argv(output_dir, **extra)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})


def losses(log: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_log(log)}


def refused_in_one_line(proc: subprocess.CompletedProcess, path: Path) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        f"{PROG}: error: {path}: this checkpoint file holds something other than tensors and plain data "
        f"(posix.system); not loaded, as loading it could run code from it"]




@pytest.fixture
def run_dir(checkpointed_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(checkpointed_run, out)
    return out


@pytest.mark.parametrize("name", ["trainer.pt", "rng_rank0.pt", "training_state.pt"])
def test_the_resume_refuses_a_crafted_checkpoint_file_in_one_line(run_dir, tmp_path, name):
    target, marker = checkpoint.latest(run_dir) / name, tmp_path / "ran"
    craft(target, marker)
    refused_in_one_line(train_cli(run_dir), target)
    assert not marker.exists()


def test_an_untouched_checkpoint_still_resumes(checkpointed_run, run_dir):
    proc = train_cli(run_dir)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"resumed from {checkpoint.latest(run_dir)} (step 2)" in proc.stdout
    # step 3 recomputed, equal
    assert losses(run_dir / "train_log.jsonl") == losses(checkpointed_run / "train_log.jsonl")


def _one_rank_env() -> dict[str, str]:
    """A world of one process (no torchrun): what a multi-rank strategy's setup reads."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def test_fsdp_and_zero_resumes_refuse_crafted_state_before_their_loaders_read_it(tmp_path):
    """Through the real CLI on a world of one: FSDP's DCP metadata, ZeRO-2's optimizer partition. The run's own
    checkpoint passes the checks first (DeepSpeed's loss scaler, stage enum and fragment addresses included)."""
    marker = tmp_path / "ran"
    for strategy in ("fsdp", "zero2"):
        out = tmp_path / strategy
        first = train_cli(out, _one_rank_env(), strategy=strategy)
        assert first.returncode == 0, first.stderr[-2000:]
        ckpt = checkpoint.latest(out)
        if strategy == "fsdp":
            check_dcp(ckpt / "dcp")
            target = ckpt / "dcp" / ".metadata"
            target.write_bytes(pickle.dumps(RunsCommand(marker)))
            what = "checkpoint metadata"
        else:
            check_deepspeed(ckpt / "deepspeed")
            target = ckpt / "deepspeed" / "state" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
            craft(target, marker)
            what = "DeepSpeed checkpoint file"
        proc = train_cli(out, _one_rank_env(), strategy=strategy)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.splitlines() == [
            f"{PROG}: error: {target}: this {what} holds something other than tensors and plain data "
            f"(posix.system); not loaded, as loading it could run code from it"], strategy
        assert not marker.exists(), strategy
