"""DDP under real torchrun (gloo, 2 ranks): same loss as 1 rank, and checkpoint/resume after a SIGKILL."""

from __future__ import annotations

import pytest

from distlab import checkpoint
from distlab.launch.local import launch_training
from distlab.launch.process import RunFailed
from distlab.metrics import read_log
from distlab.results import scaling_table

COMMON = {"strategy": "ddp", "max_steps": 12, "global_batch_size": 8, "micro_batch_size": 4, "seq_len": 256,
          "logging_steps": 1, "lora_dropout": 0.0, "eval_at_start": False}


def losses(log):
    return {r["step"]: r["loss"] for r in read_log(log)}


def test_two_ranks_give_the_one_rank_loss_curve(tmp_path):
    one = launch_training("t_ddp_ws1", 1, {**COMMON, "max_steps": 6, "eval_file": None}, runs_dir=tmp_path, echo=False)
    two = launch_training("t_ddp_ws2", 2, {**COMMON, "max_steps": 6, "eval_file": None, "measure_comm": True},
                          runs_dir=tmp_path, echo=False)
    a, b = losses(one.log), losses(two.log)
    assert list(a) == list(b) == list(range(1, 7))
    assert [a[s] for s in a] == pytest.approx([b[s] for s in b], rel=1e-5)
    steps = read_log(two.log)
    assert all(s["world_size"] == 2 and s["comm_time_s"] > 0 and s["comm_bytes"] > 0 for s in steps)
    # the hook times the wait for the slower rank apart from the transfer (chapter 02's cost model)
    assert all(s["comm_calls"] >= 1 and s["comm_wait_s"] >= 0 and s["comm_transfer_s"] > 0 for s in steps)
    assert all(s["comm_wait_s"] + s["comm_transfer_s"] == pytest.approx(s["comm_time_s"]) for s in steps)
    assert scaling_table.comm_split(two.log)["comm_calls"] >= 1
    assert len(two.rank_logs) == 1  # rank 1 writes its own log


def test_sigkilled_rank_resumes_and_matches_an_uninterrupted_run(tmp_path):
    overrides = {**COMMON, "checkpoint_steps": 4, "keep_checkpoints": 2}
    clean = launch_training("t_clean", 2, overrides, runs_dir=tmp_path, echo=False)
    killed = launch_training("t_killed", 2, overrides, runs_dir=tmp_path, max_restarts=1, echo=False,
                             env={"DISTLAB_KILL_AT_STEP": "7", "DISTLAB_KILL_RANK": "1"})
    console = killed.result.tail
    assert any("SIGKILL after step 7" in line for line in console)
    assert any("resumed from" in line and "step-00000004" in line for line in console)
    assert losses(killed.log) == losses(clean.log)  # bitwise: same floats, every step once
    def evals(log):
        return [r["eval_loss"] for r in read_log(log, event="eval")]

    assert evals(killed.log) == evals(clean.log)
    a = (clean.output_dir / "model" / "adapter_model.safetensors").read_bytes()
    b = (killed.output_dir / "model" / "adapter_model.safetensors").read_bytes()
    assert a == b
    assert [p.name for p in checkpoint.complete_checkpoints(killed.output_dir)] == ["step-00000004", "step-00000008"]


def test_kill_during_checkpoint_write_keeps_the_previous_checkpoint(tmp_path):
    overrides = {**COMMON, "checkpoint_steps": 4, "eval_file": None}
    with pytest.raises(RunFailed) as info:
        launch_training("t_ckpt", 2, overrides, runs_dir=tmp_path, echo=False,
                        env={"DISTLAB_KILL_IN_CHECKPOINT": "8", "DISTLAB_KILL_RANK": "1"})
    assert 1 in info.value.result.failed_ranks
    out = tmp_path / "t_ckpt"
    assert checkpoint.latest(out).name == "step-00000004"
    assert (out / "checkpoints" / ".tmp-step-00000008").exists()  # the half-written one, never renamed
    # A new launch resumes from step 4 and finishes; the partial folder is cleaned up.
    again = launch_training("t_ckpt", 2, overrides, runs_dir=tmp_path, echo=False, fresh=False)
    assert any("resumed from" in line and "step-00000004" in line for line in again.result.tail)
    assert max(losses(again.log)) == 12
    assert not (out / "checkpoints" / ".tmp-step-00000008").exists()


def test_a_sweep_runs_each_variant_as_if_launched_alone(tmp_path):
    """Runs of one launch share the ranks and the process group, nothing else: the same config
    twice in a sweep gives the loss curve of a launch of its own, both times."""
    from distlab.launch.local import launch_sweep

    cfg = {**COMMON, "max_steps": 3, "eval_file": None, "lora_dropout": 0.05}
    alone = launch_training("t_alone", 2, cfg, runs_dir=tmp_path, echo=False)
    swept = launch_sweep("t_sweep", 2, cfg, {"t_first": {}, "t_ga2": {"grad_accum": 2, "global_batch_size": None},
                                             "t_again": {}}, runs_dir=tmp_path, echo=False)
    assert list(swept) == ["t_first", "t_ga2", "t_again"]
    ref = losses(alone.log)
    assert losses(swept["t_first"].log) == ref
    assert losses(swept["t_again"].log) == ref
    assert read_log(swept["t_ga2"].log)[0]["tokens"] > read_log(alone.log)[0]["tokens"]  # its own config
    assert len({job.output_dir for job in swept.values()}) == 3
    assert all((job.output_dir / "run_metadata.json").exists() for job in swept.values())
    script = swept["t_first"].script.read_text()
    assert "3 runs of distlab.train" in script and script.splitlines()[-1].count("--variant") == 3
