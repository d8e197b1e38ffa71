"""Slurm: the job scripts distlab.launch.sbatch writes (golden files, validation, bash -n, shellcheck,
launch/slurm/ up to date), and a real one-machine cluster (distlab.slurm): up/down idempotent and
leaving nothing running, a 2-node sbatch job of 2-stage pipeline inference end to end with its
completion records read back through sacct, a stage killed mid-generation failing the job in time
with the rank named, and a missing model folder failing before anything starts.

Rewrite the golden files after an intended change with

    DISTLAB_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_slurm.py -k golden
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from distlab.launch.catalog import launch_files
from distlab.launch.generated import check_dir
from distlab.launch.sbatch import Container, SlurmSpec, example_specs, render_files
from distlab.launch.spec import LaunchSpecError
from distlab.paths import LAUNCH_DIR

GOLDEN = Path(__file__).parent / "golden" / "slurm"
UPDATE = os.environ.get("DISTLAB_UPDATE_GOLDEN") == "1"
HAVE_SLURM = all(shutil.which(t) for t in ("slurmctld", "slurmd", "munged", "sbatch", "sacct"))
SLURM_CTLD_PORT = 26817  # the `cluster` fixture's ports (conftest): 26817-26819, this module's own

GOLDEN_SPECS = {s.name: s for s in example_specs()}
GOLDEN_SPECS["quoted-singularity-rocm"] = SlurmSpec(
    "quoted-singularity-rocm", args=["--prompts", "data/prompts/it's here.jsonl", "--batch-size", "4"], nodes=3,
    tasks_per_node=2, gpus_per_task=2, time="1-00:00:00", model_dir="models/my model", env={"HIP_VISIBLE": "0 1"},
    container=Container("img dir/x.sif", runtime="singularity", gpu_flag="--rocm"), script_dir="jobs/quoted")
# a training job: FSDP across 2 nodes, tensor parallelism in pairs inside each (run.sh passes tp_size on)
GOLDEN_SPECS["train-fsdp-tp-2x2"] = SlurmSpec(
    "train-fsdp-tp-2x2", module="distlab.train", nodes=2, tasks_per_node=2, gpus_per_task=1, tp_size=2,
    args=["--config", "lib/distlab/configs/tiny_lora.yaml", "--set", "strategy=fsdp_tp", "--set", "max_steps=20"],
    out_dir="build/runs/slurm train", script_dir="jobs/train-fsdp-tp", description="FSDP x TP, 2 nodes x 2 GPUs")
TRAIN = dict(module="distlab.train", args=["--set", "strategy=fsdp_tp"], nodes=2, tasks_per_node=2)


@pytest.mark.parametrize("name", sorted(GOLDEN_SPECS))
def test_golden(name):
    files = render_files(GOLDEN_SPECS[name])
    for rel, text in files.items():
        path = GOLDEN / name / rel
        if UPDATE:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        assert path.is_file(), f"{path} missing: run with DISTLAB_UPDATE_GOLDEN=1"
        assert text == path.read_text(), f"{name}/{rel} differs from {path}"


def test_scripts_parse_and_pass_shellcheck(tmp_path):
    for name, spec in GOLDEN_SPECS.items():
        for rel, text in render_files(spec).items():
            path = tmp_path / name / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            subprocess.run(["bash", "-n", str(path)], check=True)
            if shutil.which("shellcheck"):
                out = subprocess.run(["shellcheck", "-s", "bash", str(path)], capture_output=True, text=True)
                assert out.returncode == 0, f"{name}/{rel}:\n{out.stdout}"


def test_script_contents():
    cpu = render_files(GOLDEN_SPECS["pipeline-2node-cpu"])
    sb, run = cpu["submit.sbatch"], cpu["run.sh"]
    for expected in ["#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --time=00:10:00",
                     "#SBATCH --output=logs/slurm/%x-%j.out", "set -euo pipefail", "HF_HUB_OFFLINE=1",
                     'scontrol show hostnames "$SLURM_JOB_NODELIST"', "SLURM_JOB_ID % 20000", "--kill-on-bad-exit=1",
                     "rank%t.log", '"$MODEL_DIR/config.json"', "exit 2"]:
        assert expected in sb, expected
    assert "gres" not in sb and "apptainer" not in sb and "pip install" not in sb + run
    assert 'RANK="$SLURM_PROCID" WORLD_SIZE="$SLURM_NTASKS"' in run
    gpu = render_files(GOLDEN_SPECS["pipeline-2node-gpu-apptainer"])["submit.sbatch"]
    assert "#SBATCH --gres=gpu:1" in gpu and "apptainer exec --nv" in gpu
    assert '--bind "$MODEL_DIR:/workspace/model"' in gpu
    # MASTER_ADDR is computed before (outside) the container
    assert gpu.index("MASTER_ADDR=") < gpu.index("apptainer exec")
    quoted = render_files(GOLDEN_SPECS["quoted-singularity-rocm"])
    assert "'data/prompts/it'\"'\"'s here.jsonl'" in quoted["run.sh"] and "'models/my model'" in quoted["submit.sbatch"]
    assert "#SBATCH --gres=gpu:4" in quoted["submit.sbatch"] and "singularity exec --rocm" in quoted["submit.sbatch"]


@pytest.mark.parametrize("field,kwargs", [
    ("name", dict(name="a b")), ("nodes", dict(nodes=0)), ("tasks_per_node", dict(tasks_per_node=True)),
    ("cpus_per_task", dict(cpus_per_task=0)), ("gpus_per_task", dict(gpus_per_task=0)), ("time", dict(time="30")),
    ("time", dict(time="")), ("partition", dict(partition="gpu; rm")), ("env", dict(env={"HF_TOKEN": "x"})),
    ("model_dir", dict(model_dir=" ")), ("container", dict(container=Container("x.sif", runtime="docker"))),
    ("container", dict(container=Container("x.sif", gpu_flag="--gpus"))),
    # a newline or CR would start a line of submit.sbatch of its own: a command run when the job starts
    ("description", dict(description="x\ntouch PWNED")), ("log_dir", dict(log_dir="logs\r\ntouch PWNED")),
    ("script_dir", dict(script_dir="jobs\ntouch PWNED")), ("out_dir", dict(out_dir="o\x00")),
    ("log_dir", dict(log_dir="logs dir")), ("log_dir", dict(log_dir="logs/%j")),  # unquoted in #SBATCH --output
    ("container.image", dict(container=Container("x\n.sif"))),
    # the secret rule of every writer: credential-looking values anywhere, secret names, run.sh's own names
    ("env", dict(env={"X": "hf_" + "a" * 34})), ("args", dict(args=["--token", "hf_" + "a" * 34])),
    ("description", dict(description="token hf_" + "a" * 34)), ("log_dir", dict(log_dir="hf_" + "a" * 34)),
    ("env", dict(env={"RANK": "0"})), ("env", dict(env={"PATH": "/bin"})), ("module", dict(module="a b")),
    # the tensor-parallel size of a training job: an integer that fits the strategy and the world size
    ("tp_size", dict(TRAIN, tp_size=0)), ("tp_size", dict(TRAIN, tp_size="2")), ("tp_size", dict(TRAIN, tp_size=True)),
    ("tp_size", dict(TRAIN, tp_size=3)), ("tp_size", dict(TRAIN, tp_size=4)),  # 4 ranks: one group of 4 is not 2-D
    ("tp_size", dict(TRAIN, args=["--set", "strategy=tp"], tp_size=2)),  # tp splits over all 4 ranks
    ("tp_size", dict(TRAIN, args=["--set", "strategy=ddp"], tp_size=2)), ("tp_size", dict(tp_size=2)),  # inference
    ("tp_size", dict(TRAIN, args=["--set", "strategy=fsdp_tp", "--set", "tp_size=2"])),  # given once, checked
])
def test_invalid_specs_name_the_field(field, kwargs):
    with pytest.raises(LaunchSpecError) as err:
        SlurmSpec(**{"name": "ok", **kwargs})
    assert err.value.field == field and str(err.value).startswith(f"SlurmSpec.{field}: ")
    assert "\n" not in str(err.value) and "\r" not in str(err.value)


def test_a_training_job_passes_its_tp_size_and_says_where_the_groups_sit():
    run = render_files(GOLDEN_SPECS["train-fsdp-tp-2x2"])["run.sh"]
    assert "--set strategy=fsdp_tp" in run and "--set tp_size=2" in run and "--out-dir" not in run
    assert "--set model=build/models/distlab-tiny-base" in run and \
        "OUT_DIR='build/runs/slurm train'/\"$SLURM_JOB_ID\"" in run and '--set "output_dir=$OUT_DIR"' in run
    inside = render_files(GOLDEN_SPECS["train-fsdp-tp-2x2"])["submit.sbatch"]
    assert "# tensor parallelism: groups of 2 ranks, each inside one node (2 tasks per node)" in inside
    across = SlurmSpec("tp-2x1", module="distlab.train", args=["--set", "strategy=tp"], nodes=2, tp_size=2)
    assert "groups of 2 ranks that span nodes" in render_files(across)["submit.sbatch"]
    assert "--set tp_size=2" in render_files(across)["run.sh"]


def test_launch_slurm_is_what_the_generator_writes():
    files = {k[len("slurm/"):]: v for k, v in launch_files().items() if k.startswith("slurm/")}
    assert {"README.md", "pipeline-2node-cpu/submit.sbatch", "pipeline-2node-cpu/run.sh"} <= set(files)
    assert check_dir(LAUNCH_DIR / "slurm", files) == []


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
                         cwd=Path(__file__).resolve().parents[1])
    return job_id, submit.wait(cluster, job_id, timeout_s=150)


@needs_slurm
@pytest.mark.slow
def test_up_is_idempotent_and_status_counts_daemons(cluster):
    before = {p.pid for p in cluster.processes()}
    cluster.up()
    assert {p.pid for p in cluster.processes()} == before
    assert cluster.status()["daemons"] == 4 and cluster.nodes_ready()


@needs_slurm
@pytest.mark.slow
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
@pytest.mark.slow
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
@pytest.mark.slow
def test_missing_model_fails_before_the_job_starts(cluster, tmp_path):
    job_id, rec = _job(cluster, tmp_path, "pi-nomodel", model=tmp_path / "no-such-model")
    assert rec["State"] == "FAILED" and rec["ExitCode"].startswith("2:"), rec
    assert "is missing" in (tmp_path / "logs" / f"pi-nomodel-{job_id}.out").read_text()


@needs_slurm
@pytest.mark.slow
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
