"""Slurm: the job scripts distlab.launch.sbatch writes (golden files, validation, bash -n, shellcheck,
launch/slurm/ up to date). A real one-machine cluster running them: tests/clusters/test_slurm_runs.py.

Rewrite the golden files after an intended change with

    DISTLAB_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_slurm.py -k golden
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from distlab.launch.catalog import launch_files
from distlab.launch.generated import check_dir
from distlab.launch.sbatch import Container, SlurmSpec, example_specs, render_files
from distlab.launch.spec import LaunchSpecError
from distlab.paths import LAUNCH_DIR

GOLDEN = Path(__file__).parents[1] / "golden" / "slurm"
UPDATE = os.environ.get("DISTLAB_UPDATE_GOLDEN") == "1"

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
