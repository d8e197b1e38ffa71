"""A job as Slurm scripts: `submit.sbatch` (resources, checks, rendezvous, one `srun`) and `run.sh` (what
every task runs), from a typed, validated SlurmSpec.

submit.sbatch runs on the first node, outside any container: it changes to the repository root, fails
loudly when the local model folder is missing (HF_HUB_OFFLINE=1: nothing is ever downloaded), sets
MASTER_ADDR to the first node's address (`scontrol show hostnames "$SLURM_JOB_NODELIST"`, then that
node's NodeAddr) and MASTER_PORT from the job id (two jobs on one node never collide), and starts
one task per rank with `srun --kill-on-bad-exit=1` (a dead rank ends the job, not a hang until the time
limit), each writing its own log (`%t`). run.sh takes RANK/WORLD_SIZE from SLURM_PROCID/SLURM_NTASKS
and runs `python -m <module>`. No pip install inside the job: the environment is prepared before
submission (PYTHON names its interpreter; sbatch passes the submitter's environment).

With `resumable`, the job can be run again and finishes what a lost run left: `#SBATCH --requeue` (Slurm
may requeue it after a node failure, `scontrol requeue <id>` does by hand), `--open-mode=append` for the
job's and every rank's log (a requeued job keeps its id, and the lost attempt's logs stay above the new
ones), the output folder named after the job instead of its id (`<out_dir>/<name>/`, the same for an
`sbatch` of the same script again), and `--resume` given to the module (distlab.inference then skips the
prompts already answered there). Submitting it twice is harmless: the second run finds nothing to do.

A training job (`module="distlab.train"`, its `--config` and `--set strategy=...` in args) gets the model
folder, the output folder and, for `tp` / `fsdp_tp`, `tp_size` as `--set` settings (distlab.train takes
no --model / --out-dir). `tp_size` is checked as LaunchSpec checks it (spec.check_tp_size: `tp` splits
over every rank, `fsdp_tp` needs at least two groups) and given once, never also in args; the header
says whether each tensor-parallel group sits inside one node (srun puts consecutive ranks on a node), as
it should: its all-reduces run every layer (chapter 08, section 4).

With `container` (an image), srun runs `apptainer exec` (or `singularity exec`) with --nv / --rocm and
the Slurm report's binds (code at /app, the workspace, the model at /workspace/model); the model is checked
on the host before the job starts.

Every value is checked and quoted by distlab.launch.shell, as in every other writer: no control
character, no credential, every value that reaches a command line single-quoted; `log_dir` goes
unquoted into `#SBATCH --output`, so it must be a plain word (no whitespace, quotes or `%`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from distlab.launch.generated import GENERATED_MARK, write_file
from distlab.launch.shell import (
    NAME_RE,
    check_env,
    check_fields,
    check_module,
    check_text,
    check_word,
    literal_note,
    quote,
    show,
)
from distlab.launch.spec import LaunchSpecError, check_tp_size, setting_in_args, strategy_in_args
from distlab.preemption import UNMEASURED_STOP_S, grace_seconds

_TIME_RE = re.compile(r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$")
RUNTIMES = ("apptainer", "singularity")
GPU_FLAGS = ("--nv", "--rocm")
APP_DIR, WORKSPACE_DIR, MODEL_MOUNT = "/app", "/tmp/workspace", "/workspace/model"
# run.sh sets these itself (from Slurm's variables, or to keep the job offline): the spec's env must not.
TRAIN_MODULE = "distlab.train"  # reads `--set KEY=VALUE`: run.sh gives it the model, output folder and tp size so
RESERVED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHON", "HF_HUB_OFFLINE",
                "TRANSFORMERS_OFFLINE")


class SlurmSpecError(LaunchSpecError):
    """An invalid SlurmSpec; `.field` names the offending field (a LaunchSpecError, as it always was)."""

    spec = "SlurmSpec"


@dataclass(frozen=True)
class Container:
    image: str
    runtime: str = "apptainer"
    gpu_flag: str | None = "--nv"
    workspace: str = "build/workspace"   # host folder bound at /tmp/workspace


@dataclass
class SlurmSpec:
    name: str
    module: str = "distlab.inference"
    args: list[str] = field(default_factory=list)
    nodes: int = 2
    tasks_per_node: int = 1
    ntasks: int | None = None            # a total instead of per node (3 stages on 2 nodes)
    cpus_per_task: int = 1
    gpus_per_task: int | None = None
    time: str = "00:10:00"
    partition: str | None = None
    model_dir: str = "build/models/distlab-tiny-base"   # local folder, relative to the repository root
    model_arg: str | None = "--model"    # how the module is told the model folder
    out_dir: str = "build/runs/06_slurm"  # the job writes into <out_dir>/<job id>/
    log_dir: str = "logs/slurm"
    env: dict[str, str] = field(default_factory=dict)
    container: Container | None = None
    script_dir: str = "launch/slurm"     # where run.sh lives, relative to the repository root
    description: str = ""
    resumable: bool = False              # requeue-safe: a stable out folder, --resume, logs appended
    tp_size: int | None = None           # distlab.train with --set strategy=tp|fsdp_tp: ranks per TP group
    stop_s: float | None = None          # distlab.train: a stop's measured cost (preemption.measured_stop_s)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        # Every string first (control characters, length, secrets): the checks below may quote a value.
        check_fields(SlurmSpecError, self)
        if not isinstance(self.name, str) or not NAME_RE.match(self.name):
            raise SlurmSpecError("name", f"{show(self.name)}: letters, digits, '_', '.', '-' only")
        check_module(SlurmSpecError, "module", self.module)
        for i, a in enumerate(self.args):
            if not isinstance(a, str):
                raise SlurmSpecError("args", f"args[{i}] = {show(a)} is not a string")
        for attr, low in (("nodes", 1), ("tasks_per_node", 1), ("cpus_per_task", 1)):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise SlurmSpecError(attr, f"{show(value)}: need an integer >= {low}")
        if self.ntasks is not None and (isinstance(self.ntasks, bool) or not isinstance(self.ntasks, int)
                                        or not self.nodes <= self.ntasks):
            raise SlurmSpecError("ntasks", f"{show(self.ntasks)}: None or an integer >= nodes ({self.nodes})")
        if self.gpus_per_task is not None and (isinstance(self.gpus_per_task, bool) or
                                               not isinstance(self.gpus_per_task, int) or self.gpus_per_task < 1):
            raise SlurmSpecError("gpus_per_task", f"{show(self.gpus_per_task)}: None or an integer >= 1")
        if not isinstance(self.time, str) or not _TIME_RE.match(self.time):
            raise SlurmSpecError("time", f"{show(self.time)}: a wall time as HH:MM:SS or D-HH:MM:SS "
                                         "(every job has one)")
        if self.partition is not None and (not isinstance(self.partition, str) or not NAME_RE.match(self.partition)):
            raise SlurmSpecError("partition", f"{show(self.partition)}: not a partition name")
        check_env(SlurmSpecError, "env", self.env, RESERVED_ENV, "is set by run.sh itself")
        for attr in ("model_dir", "out_dir", "script_dir"):
            value = getattr(self, attr)
            check_text(SlurmSpecError, attr, value)
            if not value.strip():
                raise SlurmSpecError(attr, "must not be empty")
        check_word(SlurmSpecError, "log_dir", self.log_dir)  # #SBATCH --output=<log_dir>/...
        if self.model_arg is not None:
            check_text(SlurmSpecError, "model_arg", self.model_arg)
        check_text(SlurmSpecError, "description", self.description, allow_empty=True)
        if not isinstance(self.resumable, bool):
            raise SlurmSpecError("resumable", f"{show(self.resumable)}: True or False")
        if self.stop_s is not None and (isinstance(self.stop_s, bool) or not isinstance(self.stop_s, (int, float))
                                        or not 0 < self.stop_s < 86400):
            raise SlurmSpecError("stop_s", f"{show(self.stop_s)}: None or the seconds a stop takes (> 0)")
        self._validate_tp_size()
        c = self.container
        if c is not None:
            if c.runtime not in RUNTIMES:
                raise SlurmSpecError("container", f"runtime {show(c.runtime)}: one of {RUNTIMES}")
            if c.gpu_flag is not None and c.gpu_flag not in GPU_FLAGS:
                raise SlurmSpecError("container", f"gpu_flag {show(c.gpu_flag)}: one of {GPU_FLAGS} or None")
            check_text(SlurmSpecError, "container.image", c.image)
            check_text(SlurmSpecError, "container.workspace", c.workspace)

    def _validate_tp_size(self) -> None:
        """LaunchSpec's rule (check_tp_size) on the job's world size, for a training job; the size is given
        once, as this field (so that it is checked), never as `--set tp_size` in args."""
        if self.module != TRAIN_MODULE:
            if self.tp_size is not None:
                raise SlurmSpecError("tp_size", f"{show(self.tp_size)}: only for {TRAIN_MODULE} jobs, "
                                                f"not {self.module!r}")
            return
        check_tp_size(SlurmSpecError, self.tp_size, strategy_in_args(self.args), self.world_size)
        in_args = setting_in_args(self.args, "tp_size")
        if in_args is not None:
            raise SlurmSpecError("tp_size", f"--set tp_size={in_args} in args: give it as tp_size, which is "
                                            "checked against the world size and passed on by run.sh")

    @property
    def world_size(self) -> int:
        return self.ntasks or self.nodes * self.tasks_per_node

    def tp_groups_note(self) -> str | None:
        """Where the tensor-parallel groups sit: srun places consecutive ranks on a node, so a group stays
        inside one node when its size divides the tasks per node (chapter 08, section 4: why it should)."""
        strategy = strategy_in_args(self.args)
        if strategy not in ("tp", "fsdp_tp"):
            return None
        size = self.tp_size or (self.world_size if strategy == "tp" else 2)
        if self.ntasks is None and self.tasks_per_node % size == 0:
            return (f"tensor parallelism: groups of {size} ranks, each inside one node "
                    f"({self.tasks_per_node} tasks per node)")
        return (f"tensor parallelism: groups of {size} ranks that span nodes: every layer's all-reduces cross the "
                "network (keep a group inside a node where you can)")


def render_sbatch(spec: SlurmSpec) -> str:
    spec.validate()
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name={spec.name}",
             *([f"#SBATCH --partition={spec.partition}"] if spec.partition else []),
             f"#SBATCH --nodes={spec.nodes}",
             f"#SBATCH --ntasks={spec.ntasks}" if spec.ntasks else f"#SBATCH --ntasks-per-node={spec.tasks_per_node}",
             f"#SBATCH --cpus-per-task={spec.cpus_per_task}",
             *([f"#SBATCH --gres=gpu:{spec.gpus_per_task * spec.tasks_per_node}"] if spec.gpus_per_task else []),
             f"#SBATCH --time={spec.time}",
             f"#SBATCH --output={spec.log_dir}/%x-%j.out",
             *(["#SBATCH --requeue", "#SBATCH --open-mode=append"] if spec.resumable else []),
             *_signal_lines(spec),
             f"# {GENERATED_MARK} from a SlurmSpec (lib/distlab/launch/sbatch.py): do not edit by hand.",
             *([f"# {spec.description}"] if spec.description else []),
             (f"# {spec.ntasks} tasks on {spec.nodes} node(s)" if spec.ntasks else
              f"# {spec.nodes} node(s) x {spec.tasks_per_node} task(s)") + f" = world size {spec.world_size}"
             + (f"; container {spec.container.runtime} (rendered here, not executed)" if spec.container else ""),
             *([f"# {spec.tp_groups_note()}"] if spec.tp_groups_note() else []),
             *([f"# Resumable: writes into {spec.out_dir}/{spec.name}/ and skips what an earlier run answered there; "
                "sbatch it again or `scontrol requeue <id>` after a lost stage"] if spec.resumable else []),
             "# Submit from the repository root (Slurm opens the --output file first, so its folder must exist):",
             f"#   mkdir -p {quote(spec.log_dir)} && sbatch {quote(spec.script_dir + '/submit.sbatch')}",
             *literal_note([spec.model_dir, spec.out_dir, spec.log_dir, spec.script_dir,
                            *((spec.container.image, spec.container.workspace) if spec.container else ())]),
             "set -euo pipefail",
             "",
             'cd "${DISTLAB_ROOT:-${SLURM_SUBMIT_DIR:-.}}"',
             f"MODEL_DIR={quote(spec.model_dir)}",
             'if [[ ! -f "$MODEL_DIR/config.json" ]]; then',
             '  echo "error: model folder $MODEL_DIR (with config.json) is missing on $(hostname);'
             ' stage it before submitting: jobs never download (HF_HUB_OFFLINE=1)" >&2',
             "  exit 2",
             "fi",
             "export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1",
             "# rendezvous: the first node of the allocation, its address as Slurm knows it",
             'MASTER_NODE="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
             'MASTER_ADDR="$(scontrol show node -o "$MASTER_NODE" | grep -o \'NodeAddr=[^ ]*\' | cut -d= -f2)"',
             'MASTER_PORT="$((20000 + SLURM_JOB_ID % 20000))"',
             "export MASTER_ADDR MASTER_PORT",
             f"mkdir -p {quote(spec.log_dir)} {quote(spec.out_dir)}",
             'echo "job $SLURM_JOB_ID: $SLURM_NTASKS tasks on $SLURM_JOB_NODELIST, master $MASTER_ADDR:$MASTER_PORT"',
             ""]
    srun = ["srun", "--kill-on-bad-exit=1", *(["--open-mode=append"] if spec.resumable else []),
            f"--output={spec.log_dir}/%x-%j-rank%t.log"]
    run_sh = f"{spec.script_dir}/run.sh"
    if spec.container is None:
        lines.append(" ".join(quote(w) for w in srun) + " bash " + quote(run_sh))
    else:
        c = spec.container
        lines += [f"WORKSPACE={quote(c.workspace)}", 'mkdir -p "$WORKSPACE"',
                  " ".join(quote(w) for w in srun) + " \\",
                  f"  {c.runtime} exec" + (f" {c.gpu_flag}" if c.gpu_flag else "") + " \\",
                  f'  --bind "$PWD:{APP_DIR}" --bind "$WORKSPACE:{WORKSPACE_DIR}" --bind "$MODEL_DIR:{MODEL_MOUNT}" \\',
                  f"  --pwd {APP_DIR} \\",
                  f"  {quote(c.image)} bash {quote(APP_DIR + '/' + run_sh)}"]
    return "\n".join(lines) + "\n"


def _signal_lines(spec: SlurmSpec) -> list[str]:
    """A training job's warning before its time limit: SIGUSR1 to every task (no `B:`: the tasks, not the batch
    shell), early enough for the step in progress and its checkpoint; distlab.train then saves, and a
    resumable job asks to be requeued (distlab.preemption)."""
    if spec.module != TRAIN_MODULE:
        return []
    lead = grace_seconds(spec.stop_s)
    basis = (f"a stop measured at {spec.stop_s:g} s" if spec.stop_s is not None else
             f"an unmeasured {UNMEASURED_STOP_S:g} s stop budget: measure a run with python -m distlab.preemption")
    return [f"#SBATCH --signal=USR1@{lead}",
            f"# --signal: SIGUSR1 {lead} s before the time limit ({basis}); each rank finishes its step, they save "
            "one checkpoint together" + (" and the job requeues itself to resume from it" if spec.resumable else "")]


def render_run(spec: SlurmSpec) -> str:
    spec.validate()
    model = MODEL_MOUNT if spec.container else spec.model_dir
    out = f"{WORKSPACE_DIR}/outputs" if spec.container else spec.out_dir
    if spec.module == TRAIN_MODULE:  # distlab.train takes settings, not --model / --out-dir
        args = list(spec.args) + ["--set", f"model={model}"] + (
            ["--set", f"tp_size={spec.tp_size}"] if spec.tp_size is not None else [])
    else:
        args = list(spec.args) + ([spec.model_arg, model] if spec.model_arg else []) + (
            ["--resume"] if spec.resumable else [])
    out_flag = '--set "output_dir=$OUT_DIR"' if spec.module == TRAIN_MODULE else '--out-dir "$OUT_DIR"'
    lines = ["#!/bin/bash",
             f"# {GENERATED_MARK} from a SlurmSpec (lib/distlab/launch/sbatch.py): do not edit by hand.",
             "# One task of the job: srun starts it once per rank" + (" inside the container." if spec.container
                                                                     else "."),
             *literal_note([*args, *spec.env.values(), out]),
             "set -euo pipefail",
             "",
             'export RANK="$SLURM_PROCID" WORLD_SIZE="$SLURM_NTASKS" LOCAL_RANK="${SLURM_LOCALID:-0}"',
             'export OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK:-1}"',
             "export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1"]
    lines += [f"export {k}={quote(v)}" for k, v in sorted(spec.env.items())]
    # a resumable job's folder outlives its job id: a resubmission finds what the lost run answered
    lines += [f"OUT_DIR={quote(out + '/' + spec.name)}" if spec.resumable else f'OUT_DIR={quote(out)}/"$SLURM_JOB_ID"',
              'echo "rank $RANK/$WORLD_SIZE on $(hostname) (${SLURMD_NODENAME:-?}), master $MASTER_ADDR:$MASTER_PORT"',
              'exec "${PYTHON:-python3}" -m ' + quote(spec.module) + " \\",
              "  " + " ".join(quote(a) for a in args) + f" {out_flag}" if args else f"  {out_flag}"]
    return "\n".join(lines) + "\n"


def render_files(spec: SlurmSpec) -> dict[str, str]:
    """{'submit.sbatch': ..., 'run.sh': ...} (relative to spec.script_dir)."""
    return {"submit.sbatch": render_sbatch(spec), "run.sh": render_run(spec)}


def write_files(spec: SlurmSpec, root) -> list:
    """Write the job's two files under root/<spec.script_dir>/ (the folder run.sh is expected in), through
    the one generated-file writer (atomic, never through a symbolic link inside that folder)."""
    from pathlib import Path  # deferred: only writing needs paths

    folder = Path(root) / spec.script_dir
    return [write_file(folder / rel, text, root=folder) for rel, text in render_files(spec).items()]


# ---------------------------------------------------------------------- the committed examples

SLURM_DIR = "launch/slurm"
SLURM_IMAGE = "images/distlab-pytorch.sif"  # placeholder: the site's prebuilt PyTorch image (the Slurm report's .sif)


def example_specs() -> list[SlurmSpec]:
    """launch/slurm/: the 2-node CPU job chapter 06 runs, and the Slurm report's GPU + Apptainer shape."""
    common = ["--batch-size", "2", "--max-new-tokens", "32"]
    return [
        SlurmSpec("pipeline-2node-cpu", args=common, nodes=2, tasks_per_node=1, cpus_per_task=1, time="00:10:00",
                  partition="debug", out_dir="build/runs/06_slurm", script_dir=f"{SLURM_DIR}/pipeline-2node-cpu",
                  description="2-stage pipeline inference of the tiny base on the one-machine cluster "
                              "(python -m distlab.slurm up): what chapter 06 runs"),
        SlurmSpec("pipeline-2node-gpu-apptainer", args=common, nodes=2, tasks_per_node=1, cpus_per_task=4,
                  gpus_per_task=1, time="00:30:00", partition="gpu", model_dir="models/open_llama_3b",
                  out_dir="build/runs/06_slurm", env={"NCCL_DEBUG": "WARN"},
                  container=Container(SLURM_IMAGE, runtime="apptainer", gpu_flag="--nv",
                                      workspace="build/workspace"),
                  script_dir=f"{SLURM_DIR}/pipeline-2node-gpu-apptainer",
                  description="The Slurm case study's shape: 2 nodes x 1 GPU, 4 CPUs per task, 30 min, Apptainer "
                              "with --nv (rendered and checked, never executed here)"),
    ]


def _container_label(spec: SlurmSpec) -> str:
    c = spec.container
    return f"{c.runtime} {c.gpu_flag or ''}".strip() if c else "-"


def example_files() -> dict[str, str]:
    """Relative path under launch/slurm/ -> content."""
    files = {}
    for spec in example_specs():
        sub = spec.script_dir[len(SLURM_DIR) + 1:]
        files.update({f"{sub}/{rel}": text for rel, text in render_files(spec).items()})
    files["README.md"] = "\n".join([
        "# Slurm jobs: pipeline inference",
        "",
        f"{GENERATED_MARK} (`python -m distlab.launch regenerate`, from `example_specs` in "
        "`lib/distlab/launch/sbatch.py`): do not edit them by hand.",
        "",
        "| job | nodes x tasks | CPUs/task | GPUs/task | wall time | partition | container |",
        "|---|---|---|---|---|---|---|",
        *(f"| `{s.name}/` | {s.nodes} x {s.tasks_per_node} | {s.cpus_per_task} | {s.gpus_per_task or '-'} | "
          f"{s.time} | {s.partition} | {_container_label(s)} |" for s in example_specs()),
        "",
        "Each job is `submit.sbatch` (resources, the local model check, MASTER_ADDR/MASTER_PORT, one `srun`) and "
        "`run.sh` (one rank: RANK/WORLD_SIZE from SLURM_PROCID/SLURM_NTASKS, then `python -m distlab.inference`). "
        "Submit from the repository root:",
        "",
        "```bash",
        "python -m distlab.slurm up                      # the one-machine cluster (build/slurm/)",
        "export SLURM_CONF=$PWD/build/slurm/slurm.conf PYTHON=$PWD/.venv/bin/python",
        "mkdir -p logs/slurm && sbatch launch/slurm/pipeline-2node-cpu/submit.sbatch",
        "sacct -c --format=JobID,JobName,NNodes,NCPUS,State,ExitCode,Elapsed",
        "python -m distlab.slurm down",
        "```",
        "",
        "The Apptainer variant is rendered, golden-tested and shellchecked only: Apptainer/Singularity are not "
        "installable on the machines that wrote it. Its image and model folder are placeholders "
        f"(`{SLURM_IMAGE}`, `models/open_llama_3b`); nothing is pip-installed inside the job. "
        "Each stage runs where its task is: with `--device auto` (the default) a task that sees a GPU puts its stage "
        "on it (the GPU of its `SLURM_LOCALID`, bf16 weights, NCCL between stages) and one that sees none runs on "
        "CPU (fp32, gloo); `--device cpu` or `--device cuda` forces either. The one-machine cluster has no GPUs, so "
        "the CPU job is the one run there; the GPU job has not been run yet.",
        "",
    ])
    return files
