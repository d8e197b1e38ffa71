"""Loading a checkpoint never runs code from it: every file a resume reads is read as tensors and plain data,
and one whose pickle names anything else (here: os.system, touching a marker file) is refused with one line
naming it before anything unpickles it. The resumes through the real CLI: tests/launches/test_safe_load_runs.py.

The crafted files are real: unpickled without the restriction, they run their command (shown below for
torch.load and for torch.distributed.checkpoint)."""

from __future__ import annotations

import pickle

import pytest
import torch

from distlab import checkpoint
from distlab.safe_load import check_dcp, check_deepspeed, load_tensors
from helpers import RunsCommand, craft


def test_a_runs_own_checkpoint_files_read_as_tensors_and_plain_data(checkpointed_run):
    ckpt = checkpoint.latest(checkpointed_run)
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
