"""Slurm for real: a one-machine cluster (distlab.slurm): up/down idempotent and leaving nothing running, a 2-node
sbatch job of 2-stage pipeline inference end to end with its completion records read back through sacct, a stage
killed mid-generation failing the job in time with the rank named, and a missing model folder failing before
anything starts. The job scripts distlab.launch.sbatch writes: tests/unit/test_slurm.py.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys

import psutil
import pytest

from distlab.launch.sbatch import SlurmSpec
from distlab.paths import REPO_ROOT

HAVE_SLURM = all(shutil.which(t) for t in ("slurmctld", "slurmd", "munged", "sbatch", "sacct"))
SLURM_CTLD_PORT = 26817  # the `cluster` fixture's ports (conftest): 26817-26819, this module's own


# ---------------------------------------------------------------------- a real cluster

needs_slurm = pytest.mark.skipif(not HAVE_SLURM, reason="slurm-wlm and munge are not installed "
                                 "(tools/ensure_debian_packages.sh installs them)")


def _job(cluster, tmp_path, name, *args, model=None, time="00:02:00"):
    # deferred: these pull in transformers via the checkpoint writer
    from distlab.inference.stage_weights import random_checkpoint
    from distlab.launch.sbatch import write_files
    from distlab.slurm import submit

    model = model or random_checkpoint("test-tiny")
    spec = SlurmSpec(name, args=["--max-new-tokens", "6", "--batch-size", "2", *args], model_dir=str(model),
                     out_dir=str(tmp_path / "out"), log_dir=str(tmp_path / "logs"), time=time,
                     script_dir=str(tmp_path / "job"))
    write_files(spec, "/")
    (tmp_path / "logs").mkdir(exist_ok=True)
    job_id = submit.submit(cluster, tmp_path / "job" / "submit.sbatch", env={"PYTHON": sys.executable},
                         cwd=REPO_ROOT)
    return job_id, submit.wait(cluster, job_id, timeout_s=150)


@needs_slurm
def test_up_is_idempotent_and_status_counts_daemons(cluster):
    before = {p.pid for p in cluster.processes()}
    cluster.up()
    assert {p.pid for p in cluster.processes()} == before
    assert cluster.status()["daemons"] == 4 and cluster.nodes_ready()


@needs_slurm
def test_two_node_pipeline_job_end_to_end(cluster, tmp_path):
    from distlab.slurm import submit  # deferred: with the cluster tests only

    job_id, rec = _job(cluster, tmp_path, "pi-e2e")
    assert rec["State"] == "COMPLETED" and rec["NNodes"] == "2" and rec["ExitCode"] == "0:0", rec
    assert rec["ElapsedRaw"] >= 0 and rec["CPUTimeRaw"] == rec["ElapsedRaw"] * int(rec["NCPUS"])
    out = tmp_path / "out" / str(job_id)
    rows = [json.loads(ln) for ln in (out / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(r["new_tokens"] >= 1 and r["ttft_s"] > 0 for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stages"] == 2 and summary["slurm_job_id"] == str(job_id)
    logs = tmp_path / "logs"
    assert "n1" in (logs / f"pi-e2e-{job_id}-rank0.log").read_text()
    assert "n2" in (logs / f"pi-e2e-{job_id}-rank1.log").read_text()
    assert "COMPLETED" in submit.sacct_table(cluster, [job_id]) and submit.queue(cluster) == []


@needs_slurm
def test_killed_stage_fails_the_job_naming_the_rank(cluster, tmp_path):
    from distlab.slurm import submit  # deferred: with the cluster tests only

    job_id, rec = _job(cluster, tmp_path, "pi-kill", "--kill-rank", "1", "--kill-at-step", "3", time="00:01:00")
    assert rec["State"] == "FAILED", rec
    assert rec["ElapsedRaw"] < 60
    out = (tmp_path / "logs" / f"pi-kill-{job_id}.out").read_text()
    assert "task 1: Killed" in out, out
    assert submit.queue(cluster) == []
    # no task of the job is left: only the cluster's own daemons
    assert {p.name() for p in cluster.processes()} <= {"munged", "slurmctld", "slurmscriptd", "slurmd"}


@needs_slurm
def test_missing_model_fails_before_the_job_starts(cluster, tmp_path):
    job_id, rec = _job(cluster, tmp_path, "pi-nomodel", model=tmp_path / "no-such-model")
    assert rec["State"] == "FAILED" and rec["ExitCode"].startswith("2:"), rec
    assert "is missing" in (tmp_path / "logs" / f"pi-nomodel-{job_id}.out").read_text()


@needs_slurm
def test_down_after_a_crash_leaves_nothing(tmp_path):
    from distlab.slurm.cluster import Cluster  # deferred: with the cluster tests only

    c = Cluster(root=tmp_path / "c", ctld_port=27817, node_ports=(27818, 27819))
    c.up()
    try:
        ctld = [p for p in c.processes() if p.name() == "slurmctld"]
        assert ctld
        ctld[0].send_signal(signal.SIGKILL)  # the controller dies; slurmd and munged are orphans now
        psutil.wait_procs(ctld, timeout=5)
    finally:
        c.down()
    assert c.processes() == [] and c.down() == []
