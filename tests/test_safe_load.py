"""Loading a checkpoint never runs code from it: every file a resume reads is read as tensors and plain data,
and one whose pickle names anything else (here: os.system, touching a marker file) is refused with one line
naming it before anything unpickles it. A run's own checkpoints still resume, through the real CLI.

The crafted files are real: unpickled without the restriction, they run their command (shown below for
torch.load and for torch.distributed.checkpoint)."""

from __future__ import annotations

import os
import pickle
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distlab import checkpoint
from distlab.metrics import read_log
from distlab.paths import REPO_ROOT
from distlab.safe_load import check_dcp, check_deepspeed, load_tensors
from distlab.train import main

CONFIG = REPO_ROOT / "lib" / "distlab" / "configs" / "tiny_lora.yaml"
# 3 steps, one checkpoint kept, written after step 2 (none at the last step): a resume trains step 3 again
SETS = {"max_steps": 3, "checkpoint_steps": 1, "keep_checkpoints": 1, "seq_len": 128, "micro_batch_size": 2,
        "warmup_steps": 1, "logging_steps": 1, "eval_file": "null", "save_model": "false", "progress": "false"}
PROG = "python -m distlab.train"


class RunsCommand:
    """What a crafted checkpoint holds: unpickling it runs `touch <marker>`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def craft(path: Path, marker: Path) -> None:
    torch.save({"step": 2, "payload": RunsCommand(marker)}, path)


def argv(output_dir: Path, **extra) -> list[str]:
    out = ["--config", str(CONFIG)]
    for key, value in {**SETS, "output_dir": output_dir, **extra}.items():
        out += ["--set", f"{key}={value}"]
    return out


def train_cli(output_dir: Path, env: dict | None = None, **extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distlab.train", *argv(output_dir, **extra)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, **(env or {})})


def losses(log: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_log(log)}


def refused_in_one_line(proc: subprocess.CompletedProcess, path: Path) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        f"{PROG}: error: {path}: this checkpoint file holds something other than tensors and plain data "
        f"(posix.system); not loaded, as loading it could run code from it"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 3-step run of tiny_lora.yaml, its checkpoint after step 2; tests copy it before changing it."""
    out = tmp_path_factory.mktemp("safe_load") / "run"
    assert main(argv(out)) == 0
    assert [p.name for p in checkpoint.complete_checkpoints(out)] == ["step-00000002"]
    return out


@pytest.fixture
def run_dir(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


def test_a_runs_own_checkpoint_files_read_as_tensors_and_plain_data(finished):
    ckpt = checkpoint.latest(finished)
    for name in ("trainer.pt", "rng_rank0.pt", "training_state.pt"):
        # our own files, so unrestricted loading is safe here: the restricted read must give the same values
        assert _same(load_tensors(ckpt / name), torch.load(ckpt / name, weights_only=False)), name
    rng = load_tensors(ckpt / "rng_rank0.pt")
    checkpoint.set_rng_state(rng)  # random.getstate()'s tuples come back as tuples
    assert load_tensors(ckpt / "trainer.pt")["batches"] == {"epoch": 0, "step_in_epoch": 2}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_a_crafted_file_runs_its_command_when_unpickled_and_is_refused_here(tmp_path):
    crafted, marker = tmp_path / "trainer.pt", tmp_path / "ran"
    craft(crafted, marker)
    torch.load(crafted, weights_only=False)  # the old loader: the command runs
    assert marker.exists()
    marker.unlink()
    with pytest.raises(ValueError) as info:
        load_tensors(crafted)
    assert str(info.value) == (f"{crafted}: this checkpoint file holds something other than tensors and plain data "
                               f"(posix.system); not loaded, as loading it could run code from it")
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, no group: meant
def test_dcp_metadata_and_entries_are_checked_before_dcp_unpickles_them(tmp_path):
    """torch.distributed.checkpoint reads .metadata with plain pickle and non-tensor entries with
    torch.load(weights_only=False): a crafted entry runs inside dcp.load itself. check_dcp refuses both first."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)  # what FSDPStrategy saves, on one process
    real, marker = tmp_path / "real", tmp_path / "ran"
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(real), no_dist=True)
    check_dcp(real)  # its metadata classes and plain entries (lr, betas, param names) pass

    crafted = tmp_path / "crafted"
    dcp.save({"model": model_sd, "extra": RunsCommand(marker)}, checkpoint_id=str(crafted), no_dist=True)
    with pytest.raises(ValueError, match=r"__0_0\.distcp \(entry extra\): this checkpoint file holds something "
                                         r"other than tensors and plain data \(posix\.system\); not loaded"):
        check_dcp(crafted)
    assert not marker.exists()
    dcp.load({"extra": None}, checkpoint_id=str(crafted), no_dist=True)  # unchecked, DCP runs it (torch 2.13)
    assert marker.exists()
    marker.unlink()

    (real / ".metadata").write_bytes(pickle.dumps(RunsCommand(marker)))
    with pytest.raises(ValueError, match=rf"^{real / '.metadata'}: this checkpoint metadata holds something other "
                                         r"than tensors and plain data \(posix\.system\); not loaded"):
        check_dcp(real)
    assert not marker.exists()


def test_deepspeed_files_holding_code_are_refused(tmp_path):
    crafted, marker = tmp_path / "state" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", tmp_path / "ran"
    crafted.parent.mkdir()
    craft(crafted, marker)
    with pytest.raises(ValueError, match=r"optim_states\.pt: this DeepSpeed checkpoint file holds something other "
                                         r"than tensors and plain data \(posix\.system\)"):
        check_deepspeed(tmp_path)
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["trainer.pt", "rng_rank0.pt", "training_state.pt"])
def test_the_resume_refuses_a_crafted_checkpoint_file_in_one_line(run_dir, tmp_path, name):
    target, marker = checkpoint.latest(run_dir) / name, tmp_path / "ran"
    craft(target, marker)
    refused_in_one_line(train_cli(run_dir), target)
    assert not marker.exists()


@pytest.mark.slow
def test_an_untouched_checkpoint_still_resumes(finished, run_dir):
    proc = train_cli(run_dir)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"resumed from {checkpoint.latest(run_dir)} (step 2)" in proc.stdout
    assert losses(run_dir / "train_log.jsonl") == losses(finished / "train_log.jsonl")  # step 3 recomputed, equal


def _one_rank_env() -> dict[str, str]:
    """A world of one process (no torchrun): what a multi-rank strategy's setup reads."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


@pytest.mark.slow
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
