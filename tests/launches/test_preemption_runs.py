"""A scheduler's notice (SIGTERM, SIGUSR1) costs no work: the run finishes its step, every rank saves that
step's checkpoint together, the run exits 143, and the resumed run is bitwise the uninterrupted one.
Real signals to real processes: one rank signalled (DISTLAB_SIGNAL_AT_STEP), or torchrun itself (what
Kubernetes' eviction does to a pod's first process), on one process, DDP and FSDP over gloo; and Slurm's
SIGUSR1 before the time limit on a one-machine cluster (it shares the uninterrupted DDP run, so it stays here).
The grace periods and the signal handlers in one process: tests/unit/test_preemption.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from distlab import checkpoint, preemption
from distlab.launch.local import launch_training
from distlab.metrics import read_log
from distlab.paths import REPO_ROOT

CONFIG = REPO_ROOT / "lib/distlab/configs/tiny_lora.yaml"
SETTINGS = {"max_steps": 10, "global_batch_size": 4, "micro_batch_size": 2, "seq_len": 128, "logging_steps": 1,
            "lora_dropout": 0.0, "eval_at_start": False, "eval_file": None, "checkpoint_steps": 4,
            "warmup_steps": 2, "progress": False}


def losses(log: Path) -> dict[int, float]:
    steps = read_log(log)
    assert len({r["step"] for r in steps}) == len(steps), "a step logged twice"
    return {r["step"]: r["loss"] for r in steps}


def _train_cli(out: Path, env: dict[str, str] | None = None, **settings) -> subprocess.CompletedProcess:
    sets = [w for k, v in {**SETTINGS, **settings, "output_dir": str(out)}.items()
            for w in ("--set", f"{k}={'null' if v is None else v}")]
    return subprocess.run([sys.executable, "-m", "distlab.train", "--config", str(CONFIG), *sets],
                          capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.fixture(scope="module")
def ddp_clean(tmp_path_factory):
    """The uninterrupted 2-rank DDP run every stopped DDP run is compared with (run once for the module)."""
    return launch_training("p_clean", 2, DDP, runs_dir=tmp_path_factory.mktemp("clean"), echo=False)


DDP = {**SETTINGS, "strategy": "ddp"}


def test_one_process_saves_the_signalled_step_and_resumes_bitwise(tmp_path):
    sig = "USR1"  # SIGTERM: the multi-rank tests below
    clean = _train_cli(tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr
    out = tmp_path / "stopped"
    stopped = _train_cli(out, env={"DISTLAB_SIGNAL_AT_STEP": "6", "DISTLAB_KILL_RANK": "0", "DISTLAB_SIGNAL": sig})
    assert stopped.returncode == preemption.PREEMPTED_EXIT, stopped.stderr
    assert f"stopped on SIG{sig}: saved the checkpoint of step 6" in stopped.stdout
    # the periodic checkpoint at 4 and the one the signal asked for at 6: two steps not lost
    assert [p.name for p in checkpoint.complete_checkpoints(out)] == ["step-00000004", "step-00000006"]
    saves = read_log(out / "train_log.jsonl", event="checkpoint")
    assert saves[-1]["step"] == 6 and saves[-1]["stopped_on"] == f"SIG{sig}" and saves[-1]["save_s"] > 0
    resumed = _train_cli(out)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "step-00000006" in resumed.stdout
    assert losses(out / "train_log.jsonl") == losses(tmp_path / "clean" / "train_log.jsonl")  # bitwise
    a = (tmp_path / "clean" / "model" / "adapter_model.safetensors").read_bytes()
    assert (out / "model" / "adapter_model.safetensors").read_bytes() == a


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_signalled_rank_stops_every_rank_at_that_step(tmp_path, strategy, request):
    """Only rank 1 gets SIGTERM, during step 6: both ranks finish step 6, agree, save it, exit 143; the
    relaunch resumes at 6 and ends bitwise where the uninterrupted run ends."""
    settings = {**SETTINGS, "strategy": strategy}
    clean = (request.getfixturevalue("ddp_clean") if strategy == "ddp" else
             launch_training("p_clean", 2, settings, runs_dir=tmp_path, echo=False))
    stopped = launch_training("p_stopped", 2, settings, runs_dir=tmp_path, echo=False, check=False,
                              env={"DISTLAB_SIGNAL_AT_STEP": "6", "DISTLAB_KILL_RANK": "1"})
    console = "\n".join(stopped.result.tail)
    assert stopped.result.returncode != 0
    assert "rank 1: SIGTERM during step 6" in console
    assert "stopped on SIGTERM: saved the checkpoint of step 6" in console
    assert checkpoint.latest(stopped.output_dir).name == "step-00000006"
    again = launch_training("p_stopped", 2, settings, runs_dir=tmp_path, echo=False, fresh=False)
    assert any("resumed from" in line and "step-00000006" in line for line in again.result.tail)
    assert losses(again.log) == losses(clean.log)  # bitwise: the same floats, every step once
    a = (clean.output_dir / "model" / "adapter_model.safetensors").read_bytes()
    assert (again.output_dir / "model" / "adapter_model.safetensors").read_bytes() == a


def _torchrun_of(launcher: subprocess.Popen, timeout_s: float = 120) -> psutil.Process:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in psutil.Process(launcher.pid).children(recursive=True):
            try:
                if "torch.distributed.run" in " ".join(p.cmdline()):
                    return p
            except psutil.Error:
                pass
        time.sleep(0.2)
    raise AssertionError("torchrun never started")


def test_sigterm_to_torchrun_is_forwarded_and_saves_the_step_in_progress(tmp_path, ddp_clean):
    """What an eviction does to a pod: SIGTERM to torchrun (its first process), which forwards it to the ranks
    and waits its shutdown timeout. Whatever step the signal lands in is saved, and the resume is bitwise."""
    settings, clean = DDP, ddp_clean
    from distlab.launch.local import training_spec  # deferred: with this test's hand-made launch only
    from distlab.launch.torchrun import write_scripts

    spec = training_spec("e_evicted", 2, settings, CONFIG, 0, None, 600, tmp_path)
    script = write_scripts(spec, tmp_path / "scripts", "e_evicted")[0]
    out = tmp_path / "e_evicted"
    launcher = subprocess.Popen(["bash", str(script)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHON": sys.executable})
    try:
        torchrun = _torchrun_of(launcher)
        log = out / "train_log.jsonl"
        deadline = time.monotonic() + 300
        while not (log.exists() and any(r["step"] >= 5 for r in read_log(log))):
            assert time.monotonic() < deadline and launcher.poll() is None, "no step 5"
            time.sleep(0.1)
        seen = max(r["step"] for r in read_log(log))
        torchrun.send_signal(signal.SIGTERM)
        console, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    saved = checkpoint.latest(out)
    assert saved is not None, console
    step = int(saved.name.split("-")[1])
    # the step in progress when the signal came (or the next, had it just finished), not the periodic one at 4
    assert seen <= step < 10 and f"stopped on SIGTERM: saved the checkpoint of step {step}" in console
    again = launch_training("e_evicted", 2, settings, runs_dir=tmp_path, echo=False, fresh=False)
    assert any("resumed from" in line for line in again.result.tail)
    assert losses(again.log) == losses(clean.log)


# ---------------------------------------------------------------------- Slurm: the warning before the time limit

SLURM_CTLD_PORT = 27817  # the `cluster` fixture's ports (conftest): 27817-27819, this module's own
HAVE_SLURM = all(shutil.which(t) for t in ("slurmctld", "slurmd", "munged", "sbatch"))


@pytest.mark.skipif(not HAVE_SLURM, reason="slurm-wlm and munge are not installed "
                    "(tools/ensure_debian_packages.sh installs them)")
def test_slurm_usr1_saves_requeues_and_the_requeued_job_resumes_bitwise(cluster, tmp_path, ddp_clean):
    """What `#SBATCH --signal=USR1@<grace>` does near the time limit, sent now with scancel: both tasks finish
    the step, save it, rank 0 asks Slurm to requeue the job, and the next attempt resumes there."""
    from distlab.launch.sbatch import SlurmSpec, write_files
    from distlab.models import resolve_model
    from distlab.slurm import submit

    settings, clean = DDP, ddp_clean
    args = ["--config", str(CONFIG)] + [w for k, v in settings.items()
                                        for w in ("--set", f"{k}={'null' if v is None else v}")]
    spec = SlurmSpec("preempt-train", module="distlab.train", args=args, nodes=2, tasks_per_node=1,
                     model_dir=resolve_model(None), out_dir=str(tmp_path / "out"), log_dir=str(tmp_path / "logs"),
                     script_dir=str(tmp_path / "job"), time="00:05:00", resumable=True,
                     stop_s=preemption.measured_stop_s(clean.output_dir))  # its checkpoints at 4 and 8, timed
    write_files(spec, "/")
    grace = preemption.grace_seconds(spec.stop_s)
    assert f"#SBATCH --signal=USR1@{grace}\n" in (tmp_path / "job" / "submit.sbatch").read_text()
    (tmp_path / "logs").mkdir()
    job = submit.submit(cluster, tmp_path / "job" / "submit.sbatch", env={"PYTHON": sys.executable}, cwd=REPO_ROOT)
    out = tmp_path / "out" / "preempt-train"
    log = out / "train_log.jsonl"
    deadline = time.monotonic() + 240
    while not (log.exists() and any(r["step"] >= 3 for r in read_log(log))):
        assert time.monotonic() < deadline, f"job {job}: no step 3 ({submit.queue(cluster)})"
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", str(job)], env=cluster.client_env(), check=True, timeout=15)
    # rank 0 requeued the job; Slurm holds a requeued job ~2 minutes (credential expiry): moved up, as in requeue()
    deadline = time.monotonic() + 120
    while "PENDING" not in " ".join(submit.queue(cluster)):
        assert time.monotonic() < deadline, f"job {job} was not requeued: {submit.queue(cluster)}"
        time.sleep(0.2)
    subprocess.run(["scontrol", "update", f"JobId={job}", f"StartTime=now+{submit.REQUEUE_DELAY_S}"],
                   env=cluster.client_env(), check=True, timeout=15)
    record = submit.wait(cluster, job, timeout_s=300)
    assert record["State"] == "COMPLETED", record
    first = (tmp_path / "logs" / f"preempt-train-{job}-rank0.log").read_text()
    assert "stopped on SIGUSR1: saved the checkpoint of step" in first
    assert f"asked Slurm to requeue job {job}" in first and "resumed from" in first
    assert losses(log) == losses(clean.log)  # bitwise: srun's ranks, stopped and requeued, and torchrun's
