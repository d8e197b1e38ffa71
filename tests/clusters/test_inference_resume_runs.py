"""Inference that survives a lost stage, for real: a 2-stage pipeline whose last stage is SIGKILLed after N
micro-batches, under torchrun, and as a resumable Slurm job (--requeue, logs appended, a stable output folder) on a
one-machine cluster, finished by `scontrol requeue` and then submitted again: answers token-identical to an
uninterrupted run, every prompt answered once. Both share that uninterrupted run, so they stay in one module. The
completion log's rules and the resumable job script: tests/unit/test_inference_resume.py.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from distlab.inference import outputs, resume
from distlab.inference.run import main as run_inference
from distlab.launch import process
from distlab.launch.sbatch import SlurmSpec, write_files
from distlab.paths import DEMO_PROMPTS, REPO_ROOT

HAVE_SLURM = all(shutil.which(t) for t in ("slurmctld", "slurmd", "munged", "sbatch", "sacct", "scontrol"))
SLURM_CTLD_PORT = 28817  # the `cluster` fixture's ports (conftest): 28817-28819, this module's own
# 8 demo prompts in 4 micro-batches of 2, two in flight: the last stage writes micro-batches 0 and 1, then dies
ARGS = ["--max-new-tokens", "6", "--batch-size", "2", "--in-flight", "2"]
KILL_AFTER = 2
KILL = {"DISTLAB_KILL_AFTER_MICRO_BATCHES": str(KILL_AFTER), "DISTLAB_KILL_RANK": "1"}


# ---------------------------------------------------------------------- a real pipeline, a real kill


@pytest.fixture(scope="module")
def model_dir():
    from distlab.inference.stage_weights import random_checkpoint  # deferred: writes a checkpoint (transformers)

    return random_checkpoint("test-tiny")


@pytest.fixture(scope="module")
def uninterrupted(model_dir, tmp_path_factory):
    """One stage in this process, never interrupted: the answers every resumed run must reproduce."""
    out = tmp_path_factory.mktemp("uninterrupted")
    threads = str(torch.get_num_threads())  # main() sets the count for the whole process: keep pytest's
    assert run_inference(["--model", str(model_dir), *ARGS, "--threads", threads, "--out-dir", str(out)]) == 0
    got = outputs.completions(out)
    assert len(got) == len(DEMO_PROMPTS.read_text().splitlines()) == 8
    return got


def check_finished(out: Path, reference: list[dict]) -> dict:
    """The whole prompt list answered once each, token for token as the uninterrupted run."""
    ids = [json.loads(line)["id"] for line in (out / resume.COMPLETIONS).read_text().splitlines()]
    assert len(ids) == len(set(ids)) == len(reference), f"answered twice or missing: {ids}"
    assert outputs.token_mismatches(outputs.completions(out), reference) == []
    return json.loads((out / "summary.json").read_text())


def test_torchrun_stage_killed_then_resumed(model_dir, uninterrupted, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "distlab.inference", "--model", str(model_dir), *ARGS, "--out-dir", str(tmp_path), "--resume"]
    lost = process.run(cmd, timeout_s=120, env=KILL, log_path=tmp_path / "lost.log", echo=False, check=False)
    # torchrun names rank 1 as killed by SIGKILL (then stops rank 0 with SIGTERM: -15, when it is still running)
    assert not lost.ok and lost.failed_ranks.get(1) == -9, lost.tail[-20:]
    assert "rank 1: SIGKILL after 2 finished micro-batches" in (tmp_path / "lost.log").read_text()
    kept = outputs.completions(tmp_path)
    assert [r["micro_batch"] for r in kept] == [0, 0, 1, 1] and not (tmp_path / "summary.json").exists()
    with open(tmp_path / resume.COMPLETIONS, "ab") as f:
        f.write(json.dumps(uninterrupted[-1]).encode()[:25])  # as if the crash had cut a write in half
    again = process.run(cmd, timeout_s=120, log_path=tmp_path / "again.log", echo=False)
    assert again.ok
    log = (tmp_path / "again.log").read_text()
    assert log.count("dropped a truncated last line (25 bytes") == 1
    assert "resuming: 4 of 8 prompts already answered, 2 of 4 micro-batches left" in log
    summary = check_finished(tmp_path, uninterrupted)
    assert (summary["answered_before"], summary["answered_now"], summary["micro_batches_run"]) == (4, 4, 2)
    rank1 = (tmp_path / "rank1.log").read_text()  # --resume appends: the killed attempt's lines stay above
    assert rank1.count("generating:") == 2 and rank1.index("generating: 8") < rank1.index("resuming: 4 of 8")


def job_story(cluster, job_id: int, logs: Path) -> str:
    """What a failed attempt left: every completion record of the job and the tail of each of its logs."""
    from distlab.slurm import submit  # deferred: only with Slurm installed

    parts = [f"records: {submit.sacct(cluster, [job_id])}"]
    parts += [f"--- {log.name}\n{log.read_text()[-2000:]}" for log in sorted(logs.glob(f"*-{job_id}*"))]
    daemon_log = cluster.root / "log" / "slurmctld.log"
    parts.append(f"--- slurmctld.log\n{daemon_log.read_text()[-3000:] if daemon_log.exists() else '(none)'}")
    return "\n".join(parts)


needs_slurm = pytest.mark.skipif(not HAVE_SLURM, reason="slurm-wlm and munge are not installed "
                                 "(tools/ensure_debian_packages.sh installs them)")


@needs_slurm
def test_slurm_job_loses_a_stage_then_requeue_and_sbatch_finish_it(cluster, model_dir, uninterrupted, tmp_path):
    from distlab.slurm import submit  # deferred: only with Slurm installed

    spec = SlurmSpec("rs", args=ARGS, model_dir=str(model_dir), out_dir=str(tmp_path / "out"),
                     log_dir=str(tmp_path / "logs"), time="00:02:00", script_dir=str(tmp_path / "job"),
                     resumable=True)
    write_files(spec, "/")
    (tmp_path / "logs").mkdir()
    env = {"PYTHON": sys.executable}
    job_id = submit.submit(cluster, tmp_path / "job" / "submit.sbatch", env={**env, **KILL}, cwd=REPO_ROOT)
    rec = submit.wait(cluster, job_id, timeout_s=120)
    out, job_log = tmp_path / "out" / "rs", tmp_path / "logs" / f"rs-{job_id}.out"
    assert rec["State"] == "FAILED", job_story(cluster, job_id, tmp_path / "logs")
    assert "task 1: Killed" in job_log.read_text()
    rank1_log = tmp_path / "logs" / f"rs-{job_id}-rank1.log"
    assert "rank 1: SIGKILL after 2 finished micro-batches" in rank1_log.read_text()
    assert len(outputs.completions(out)) == KILL_AFTER * 2 and not (out / "summary.json").exists()

    rec = submit.requeue(cluster, job_id, timeout_s=120)  # same job id; SLURM_RESTART_COUNT=1 disarms the kill
    assert rec["State"] == "COMPLETED", job_story(cluster, job_id, tmp_path / "logs")
    summary = check_finished(out, uninterrupted)
    assert (summary["answered_before"], summary["answered_now"], summary["slurm_restart_count"]) == (4, 4, 1)
    # --open-mode=append: the lost attempt's lines are still above the requeued one's
    assert "task 1: Killed" in job_log.read_text() and job_log.read_text().count(f"job {job_id}:") == 2
    rank1 = rank1_log.read_text()
    assert rank1.index("SIGKILL after 2") < rank1.index("resuming: 4 of 8")

    again_id = submit.submit(cluster, tmp_path / "job" / "submit.sbatch", env=env, cwd=REPO_ROOT)
    rec = submit.wait(cluster, again_id, timeout_s=120)
    assert rec["State"] == "COMPLETED" and again_id != job_id, rec
    summary = check_finished(out, uninterrupted)  # idempotent: nothing left, nothing answered twice
    assert (summary["answered_before"], summary["answered_now"], summary["micro_batches_run"]) == (8, 0, 0)
    assert submit.queue(cluster) == [] and os.environ.get("DISTLAB_KILL_AFTER_MICRO_BATCHES") is None
