"""Launch a training run locally the way a practitioner would on a cluster: write the torchrun
script with distlab.launch, then run it with distlab.launch.process (own process group, timeout, output
streamed into the notebook, every process killed on failure).

    job = launch_training("ddp_ws2", world_size=2, overrides={"strategy": "ddp", "max_steps": 50})
    job.log  # build/runs/ddp_ws2/train_log.jsonl
    jobs = launch_sweep("ga", 2, {"strategy": "ddp"}, {"ga2": {"grad_accum": 2}, "ga4": {"grad_accum": 4}})

Before anything is written or started, a launch whose runs put their ranks on GPUs (device=cuda, or auto on
a machine with CUDA) is refused with one line when it asks for more ranks than there are visible CUDA
devices (check_gpu_ranks): NCCL takes one GPU per rank, and a rank without one would fail only after
torchrun had started every rank.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from distlab.config import PIPELINE_STRATEGIES, load_config
from distlab.launch.process import RunResult, run
from distlab.launch.spec import LaunchSpec
from distlab.launch.torchrun import plural, write_scripts
from distlab.machine import usable_cores
from distlab.paths import BUILD_DIR, REPO_ROOT, RUNS_DIR

TINY_CONFIG = REPO_ROOT / "lib" / "distlab" / "configs" / "tiny_lora.yaml"
SCRIPTS_DIR = BUILD_DIR / "launch"  # where the scripts go unless the caller names a folder (scripts_dir)
# CPU ranks one local launch may start per usable core. Chapter 02's oversubscription demo runs 4 ranks on
# 2 cores (2 per core) and is slow by design; 4 per core leaves room to try more. Beyond that every rank
# (a whole interpreter holding the model) only time-slices with the others, so nothing is measured any
# more, while memory still grows by a model copy per rank: `--world-sizes 1000` is a mistake, not a run.
CPU_RANKS_PER_CORE = 4


def max_local_ranks(device: str = "auto") -> tuple[int, str]:
    """How many ranks one local launch can hold for a config's `device`, and the reason (for the message)."""
    import torch  # deferred: writing and running scripts needs no torch; only this question does


    if device != "cpu" and torch.cuda.is_available():  # NCCL refuses two ranks on one GPU
        n = torch.cuda.device_count()
        return n, f"{n} GPU(s), one rank each"
    cores = usable_cores()
    return cores * CPU_RANKS_PER_CORE, f"{cores} usable CPU core(s) x {CPU_RANKS_PER_CORE} ranks per core"


class GpuRanksError(ValueError):
    """A local launch asks for more GPU ranks than this machine has visible CUDA devices."""


def check_gpu_ranks(ranks: int, device: str, gpus: int | None = None) -> None:
    """Refuse `ranks` local ranks on `device` (a config's: auto, cpu, cuda, cuda:N) when they would run on GPUs
    and there are fewer visible CUDA devices than ranks. `gpus`: how many are visible (None: count them; a
    caller that knows, or a test on a machine without GPUs, passes the number)."""
    if device == "cpu":
        return
    if gpus is None:
        import torch  # deferred: only a launch that may run on GPUs asks torch how many there are

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto" and gpus == 0:
        return  # auto runs its ranks on CPU here
    if gpus == 0:
        raise GpuRanksError(f"{plural(ranks, 'rank')} on device={device}, but this machine has no visible CUDA "
                            "GPU: set device=cpu to run gloo ranks on CPU")
    if ranks > gpus:
        raise GpuRanksError(f"{plural(ranks, 'GPU rank')} per node (device={device}), but this machine has "
                            f"{plural(gpus, 'visible CUDA GPU')}, one per rank: launch at most "
                            f"{plural(gpus, 'rank')}, or set device=cpu to run {ranks} gloo ranks on CPU")


def _check_gpu_ranks_of(world_size: int, config: str | Path, runs: list[Mapping[str, Any]]) -> None:
    """check_gpu_ranks for every run of a launch: its `device` override, else the config file's."""
    devices = {str(run["device"]) for run in runs if run.get("device") is not None}
    if any(run.get("device") is None for run in runs):
        devices.add(load_config(config).device)
    for device in sorted(devices):
        check_gpu_ranks(world_size, device)


@dataclass
class TrainJob:
    name: str
    script: Path
    output_dir: Path
    result: RunResult

    @property
    def log(self) -> Path:
        return self.output_dir / "train_log.jsonl"

    @property
    def rank_logs(self) -> list[Path]:
        return sorted(self.output_dir.glob("train_log.rank*.jsonl"))


def _yaml_value(value: Any) -> str:
    """`--set key=value` text that distlab.config.parse_override reads back as the same value."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text[:-4].strip() if text.endswith("\n...") or text.endswith(" ...") else text


def training_spec(name: str, world_size: int, overrides: Mapping[str, Any], config: str | Path = TINY_CONFIG,
                  max_restarts: int = 0, env: Mapping[str, str] | None = None, timeout_s: int = 900,
                  runs_dir: Path = RUNS_DIR, variants: Mapping[str, Mapping[str, Any]] | None = None) -> LaunchSpec:
    """The torchrun launch of one run, or of a sweep: with `variants` ({run name: overrides}),
    one launch runs them back to back, each into runs_dir/<run name>."""
    output_dir = Path(runs_dir) / name
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    args = ["--config", str(config)]
    # A sweep's variants name their own output folders; a single run writes to output_dir.
    own_output = {} if variants else {"output_dir": str(output_dir)}
    common = {**overrides, **own_output, "progress": False}
    for key, value in common.items():
        args += ["--set", f"{key}={_yaml_value(value)}"]
    for run_name, extra in (variants or {}).items():
        args += ["--variant", _yaml_value({**extra, "output_dir": str(Path(runs_dir) / run_name)})]
    runs = [{**overrides, **extra} for extra in variants.values()] if variants else [dict(overrides)]
    # Pipeline strategies: the launcher checks the stage count (default: one stage per rank).
    stage_counts = {(r.get("pipeline_stages") or world_size) for r in runs if r.get("strategy") in PIPELINE_STRATEGIES}
    if len(stage_counts) > 1:
        raise ValueError(f"{name}: the runs of one launch must use one pipeline stage count, "
                         f"got {sorted(stage_counts)}")
    tp_sizes = {r.get("tp_size") for r in runs if r.get("strategy") == "fsdp_tp"}
    if len(tp_sizes) > 1:
        raise ValueError(f"{name}: the runs of one launch must use one tp_size, got {sorted(tp_sizes, key=str)}")
    what = f"{len(variants)} runs of distlab.train" if variants else "distlab.train"
    return LaunchSpec(module="distlab.train", args=args, nproc_per_node=world_size, max_restarts=max_restarts,
                      pipeline_stages=stage_counts.pop() if stage_counts else None,
                      tp_size=tp_sizes.pop() if tp_sizes else None,
                      sequence_parallel=any(r.get("sequence_parallel") for r in runs),
                      env=env, log_dir=str(output_dir / "torchrun"), timeout_s=timeout_s, kill_after_s=45,
                      python=sys.executable, description=f"{name}: {what} on {world_size} local rank(s)")


def launch_training(name: str, world_size: int, overrides: Mapping[str, Any] | None = None, *,
                    config: str | Path = TINY_CONFIG, max_restarts: int = 0, env: Mapping[str, str] | None = None,
                    timeout_s: int = 900, runs_dir: Path = RUNS_DIR, echo: bool = True, check: bool = True,
                    fresh: bool = True, scripts_dir: Path = SCRIPTS_DIR) -> TrainJob:
    """Write <scripts_dir>/<name>.sh (build/launch/ by default) and run it. `fresh` clears the run folder
    first (a resume test passes fresh=False to keep the checkpoints)."""
    _check_gpu_ranks_of(world_size, config, [overrides or {}])
    spec = training_spec(name, world_size, overrides or {}, config, max_restarts, env, timeout_s, runs_dir)
    return _launch(spec, name, [name], timeout_s, runs_dir, echo, check, fresh, scripts_dir)[name]


def launch_sweep(name: str, world_size: int, overrides: Mapping[str, Any], variants: Mapping[str, Mapping[str, Any]],
                 *, config: str | Path = TINY_CONFIG, env: Mapping[str, str] | None = None, timeout_s: int = 900,
                 runs_dir: Path = RUNS_DIR, echo: bool = True, check: bool = True,
                 scripts_dir: Path = SCRIPTS_DIR) -> dict[str, TrainJob]:
    """Several runs ({run name: overrides on top of `overrides`}) in one torchrun launch, back to
    back in the same ranks and process group: one interpreter start, import and rendezvous
    instead of one per run. Each run gets its own folder and step log; they share the launch's
    script, console log and wall time (`.result`). Returns {run name: TrainJob}, in order."""
    if not variants:
        raise ValueError(f"{name}: a sweep needs at least one variant")
    _check_gpu_ranks_of(world_size, config, [{**overrides, **extra} for extra in variants.values()])
    spec = training_spec(name, world_size, overrides, config, 0, env, timeout_s, runs_dir, variants=variants)
    return _launch(spec, name, list(variants), timeout_s, runs_dir, echo, check, True, scripts_dir)


def _launch(spec: LaunchSpec, name: str, run_names: list[str], timeout_s: int, runs_dir: Path, echo: bool,
            check: bool, fresh: bool, scripts_dir: Path = SCRIPTS_DIR) -> dict[str, TrainJob]:
    launch_dir = Path(runs_dir) / name
    if fresh:
        for run_name in {name, *run_names}:
            shutil.rmtree(Path(runs_dir) / run_name, ignore_errors=True)
    script = write_scripts(spec, Path(scripts_dir), name)[0]
    # The script's own limit (distlab.launch.watchdog) fires first; the runner's limit is the backstop.
    result = run(["bash", str(script)], timeout_s=timeout_s + 60, log_path=launch_dir / "console.log",
                 env={"PYTHON": sys.executable}, echo=echo, check=check, cwd=os.getcwd())
    return {run_name: TrainJob(run_name, script, Path(runs_dir) / run_name, result) for run_name in run_names}


def alternating_rounds(prefix: str, world_sizes: list[int], overrides: Mapping[str, Any], rounds: int, *,
                       timeout_s: int = 900, runs_dir: Path = RUNS_DIR, echo: bool = False,
                       progress=print) -> dict[int, list[TrainJob]]:
    """The same training at each world size, `rounds` times, alternating (1, 2, 1, 2, ...) so that a
    slow minute of a shared machine hits every world size alike. Returns {world size: one job per round}.
    Chapter 02 and `python -m distlab.bench.ddp_scaling` measure scaling with this, the same way."""
    jobs: dict[int, list[TrainJob]] = {k: [] for k in world_sizes}
    for r in range(rounds):
        for k in world_sizes:
            job = launch_training(f"{prefix}_ws{k}_r{r + 1}", k, overrides, timeout_s=timeout_s, runs_dir=runs_dir,
                                  echo=echo)
            jobs[k].append(job)
            if progress:
                progress(f"round {r + 1}/{rounds}, world size {k}: {job.result.elapsed_s:.0f}s")
    return jobs
