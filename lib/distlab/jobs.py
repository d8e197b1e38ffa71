"""Launch a training run locally the way a practitioner would on a cluster: write the torchrun
script with distlab.launch, then run it with distlab.runner (own process group, timeout, output
streamed into the notebook, every process killed on failure).

    job = launch_training("ddp_ws2", world_size=2, overrides={"strategy": "ddp", "max_steps": 50})
    job.log  # build/runs/ddp_ws2/train_log.jsonl
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from .launch import PIPELINE_STRATEGIES, LaunchSpec, write_scripts
from .paths import BUILD_DIR, REPO_ROOT, RUNS_DIR
from .runner import RunResult, run

TINY_CONFIG = REPO_ROOT / "lib" / "distlab" / "configs" / "tiny_lora.yaml"
SCRIPTS_DIR = BUILD_DIR / "launch"


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
                  runs_dir: Path = RUNS_DIR) -> LaunchSpec:
    output_dir = Path(runs_dir) / name
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    args = ["--config", str(config)]
    for key, value in {**overrides, "output_dir": str(output_dir), "progress": False}.items():
        args += ["--set", f"{key}={_yaml_value(value)}"]
    # Pipeline strategies: the launcher checks the stage count (default: one stage per rank).
    stages = (overrides.get("pipeline_stages") or world_size) if overrides.get("strategy") in PIPELINE_STRATEGIES else None
    return LaunchSpec(module="distlab.train", args=args, nproc_per_node=world_size, max_restarts=max_restarts,
                      pipeline_stages=stages,
                      env=env, log_dir=str(output_dir / "torchrun"), timeout_s=timeout_s, kill_after_s=45,
                      python=sys.executable, description=f"{name}: distlab.train on {world_size} local rank(s)")


def launch_training(name: str, world_size: int, overrides: Mapping[str, Any] | None = None, *,
                    config: str | Path = TINY_CONFIG, max_restarts: int = 0, env: Mapping[str, str] | None = None,
                    timeout_s: int = 900, runs_dir: Path = RUNS_DIR, echo: bool = True, check: bool = True,
                    fresh: bool = True) -> TrainJob:
    """Write build/launch/<name>.sh and run it. `fresh` clears the run folder first (a resume test
    passes fresh=False to keep the checkpoints)."""
    import shutil

    spec = training_spec(name, world_size, overrides or {}, config, max_restarts, env, timeout_s, runs_dir)
    output_dir = Path(runs_dir) / name
    if fresh:
        shutil.rmtree(output_dir, ignore_errors=True)
    script = write_scripts(spec, SCRIPTS_DIR, name)[0]
    # The script's own `timeout` fires first; the runner's limit is the backstop.
    result = run(["bash", str(script)], timeout_s=timeout_s + 60, log_path=output_dir / "console.log",
                 env={"PYTHON": sys.executable}, echo=echo, check=check, cwd=os.getcwd())
    return TrainJob(name, script, output_dir, result)
