"""The repository's launch/ folder: the enterprise demo's launch matrix, written from `SEED_MATRIX`.

    python -m distlab.launch regenerate   # rewrite launch/ from SEED_MATRIX
    python -m distlab.launch check        # exit 1 naming every file that differs from the writer

Each row is one run of the enterprise assistant's LoRA fine-tuning with DDP (1 GPU, 4 GPUs, and
two LAN nodes of 4 GPUs); `seed_spec` turns a row into a LaunchSpec, torchrun.py writes it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from distlab.config import load_config
from distlab.launch.generated import GENERATED_MARK, check_dir, regenerate
from distlab.launch.spec import LaunchSpec
from distlab.launch.torchrun import plural, render_files
from distlab.paths import LAUNCH_DIR, REPO_ROOT

ENTERPRISE_CONFIG = "lib/distlab/configs/enterprise_7b_lora.yaml"
LAN_MASTER = "192.168.1.100"  # the LAN seed's master node; workers at .101, .102
LAN_WORKER = "192.168.1.101"
LAN_PORT = 29500
LAN_IFNAME = "eth0"  # placeholder: the NIC on 192.168.1.0/24, see `ip -br addr` on each node
GENERATOR_FILE = "lib/distlab/launch/seeds.py"  # named in launch/README.md


@dataclass(frozen=True)
class SeedRun:
    """One row of the enterprise demo's launch matrix."""

    name: str
    nnodes: int
    gpus_per_node: int
    max_steps: int
    purpose: str
    timeout_s: int  # several times the expected duration: a hard stop, not a schedule


SEED_MATRIX: tuple[SeedRun, ...] = (
    SeedRun("run_1gpu", nnodes=1, gpus_per_node=1, max_steps=80, purpose="baseline throughput",
            timeout_s=2 * 3600),
    SeedRun("run_4gpu", nnodes=1, gpus_per_node=4, max_steps=150, purpose="main live demo",
            timeout_s=3600),
    SeedRun("run_2node_8gpu", nnodes=2, gpus_per_node=4, max_steps=200,
            purpose="precomputed scaling over the LAN", timeout_s=2 * 3600),
)


def seed_spec(row: SeedRun) -> LaunchSpec:
    """The LaunchSpec of one matrix row; batch sizes come from the config file itself."""
    cfg = load_config(REPO_ROOT / ENTERPRISE_CONFIG)
    env = {"OMP_NUM_THREADS": "1"}
    notes = {"OMP_NUM_THREADS": "one CPU thread per rank on every run, so the scaling runs differ only in GPUs"}
    common = dict(
        module="distlab.train",
        args=["--config", ENTERPRISE_CONFIG, "--set", "strategy=ddp", "--set", f"max_steps={row.max_steps}",
              "--set", f"output_dir=build/runs/enterprise_7b/{row.name}"],
        nproc_per_node=row.gpus_per_node, nnodes=row.nnodes, strategy="ddp",
        global_batch_size=cfg.global_batch_size, micro_batch_size=cfg.micro_batch_size,
        log_dir=f"logs/{row.name}", timeout_s=row.timeout_s, repo_root="..",
        description=(f"Enterprise assistant LoRA demo, {row.purpose}: {plural(row.nnodes, 'node')} x "
                     f"{plural(row.gpus_per_node, 'GPU')}, {row.max_steps} steps"),
    )
    if row.nnodes == 1:
        return LaunchSpec(**common, env={**env, "NCCL_DEBUG": "WARN"}, env_notes=notes)
    env.update({"NCCL_SOCKET_IFNAME": LAN_IFNAME, "GLOO_SOCKET_IFNAME": LAN_IFNAME,
                "NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "INFO"})
    notes["NCCL_SOCKET_IFNAME"] = (f"the NIC on the 192.168.1.0/24 LAN; {LAN_IFNAME} is a placeholder, "
                                   "check `ip -br addr` on each node")
    return LaunchSpec(**common, env=env, env_notes=notes, rendezvous="static", master_addr=LAN_MASTER,
                      master_port=LAN_PORT, hosts=[LAN_MASTER, LAN_WORKER][:row.nnodes])


def render_seed_readme(matrix: Sequence[SeedRun] = SEED_MATRIX) -> str:
    specs = [(row, seed_spec(row)) for row in matrix]
    lines = [
        "# Launch scripts",
        "",
        f"{GENERATED_MARK} (`python -m distlab.launch regenerate`, from `SEED_MATRIX` in "
        f"`{GENERATOR_FILE}`): do not edit them by hand. `python -m distlab.launch check`, and the "
        "test suite, fail when these files differ from what the generator writes.",
        "",
        "The enterprise assistant demo's launch matrix: LoRA fine-tuning of "
        "`Qwen/Qwen2.5-7B-Instruct` with DDP, configured by "
        f"`{ENTERPRISE_CONFIG}` (global batch of 64 rows per step at every world size).",
        "",
        "| script | nodes x GPUs | world | steps | accumulation | purpose | hard limit |",
        "|---|---|---|---|---|---|---|",
    ]
    for row, spec in specs:
        target = f"[`{row.name}.sh`]({row.name}.sh)" if row.nnodes == 1 else \
            f"[`{row.name}/`]({row.name}/README.md)"
        accum = spec.global_batch_size // (spec.micro_batch_size * spec.data_parallel_size)
        lines.append(f"| {target} | {row.nnodes} x {row.gpus_per_node} | {spec.world_size} | {row.max_steps} | "
                     f"{accum} | {row.purpose} | {row.timeout_s // 60} min |")
    lines += [
        "",
        "Each script changes to the repository root, runs "
        "`python -m distlab.train --config ... --set strategy=ddp --set max_steps=N` under torchrun "
        "and stops it at the hard limit (exit status 124). Use another interpreter with "
        "`PYTHON=/path/to/venv/bin/python launch/run_4gpu.sh`. Per-rank logs go to `logs/<script>/`, the "
        "run's metrics and adapter to `build/runs/enterprise_7b/<script>/`.",
        "",
        "The two-node run follows the LAN cluster's addresses (master `192.168.1.100`, port 29500, NCCL "
        f"over Ethernet); its README says which node runs which script and how to check the nodes first. "
        f"`{LAN_IFNAME}` is a placeholder for the LAN interface.",
        "",
        "Secrets (an HF_TOKEN for gated models) come from your environment, never from these files.",
        "",
    ]
    return "\n".join(lines)


def seed_files(matrix: Sequence[SeedRun] = SEED_MATRIX) -> dict[str, str]:
    """Relative path under launch/ -> content, for the whole matrix plus launch/README.md."""
    files: dict[str, str] = {}
    for row in matrix:
        files.update(render_files(seed_spec(row), row.name))
    files["README.md"] = render_seed_readme(matrix)
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m distlab.launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["regenerate", "check"],
                    help="regenerate: rewrite the folder from SEED_MATRIX; check: exit 1 if it differs")
    ap.add_argument("--dir", type=Path, default=LAUNCH_DIR, help="the launch folder (default: launch/)")
    args = ap.parse_args(argv)
    files = seed_files()
    shown = _shown(args.dir)
    if args.command == "regenerate":
        written = regenerate(args.dir, files)
        print(f"{shown}: wrote {len(written)} files")
        return 0
    problems = check_dir(args.dir, files)
    if problems:
        print(f"{shown}: {len(problems)} file(s) differ from what distlab.launch writes:")
        for p in problems:
            print(f"  {p}")
        print("Run `python -m distlab.launch regenerate` (and review the diff).")
        return 1
    print(f"{shown}: up to date ({len(files)} files)")
    return 0


def _shown(path: Path) -> str:
    """The folder as the user knows it: relative to the repository root when inside it."""
    try:
        return Path(path).resolve().relative_to(Path(REPO_ROOT).resolve()).as_posix() + "/"
    except ValueError:
        return str(path)
