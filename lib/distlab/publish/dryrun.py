"""Check every profile against every chapter without running anything: a `--profile gpu` build must not
fail on arrival on a GPU node because of a parameter no notebook declares or a batch that cannot split.

    python -m distlab.publish.dryrun [--profile NAME ...]      (make test runs it for every profile)

For each notebook and profile: the notebook's own defaults (its `parameters` cell, evaluated) overlaid
with the profile's values; every profile parameter must be declared by the notebook (papermill would
inject it and the chapter would silently ignore it); then every launch the chapter makes is built the
way `distlab.launch.local` builds it: the training config (types, ranges, model name), the accumulation
steps at each world size (the global batch must divide), the pipeline's micro-batch rows, and the
torchrun launch spec, validated field by field.

Which launches a chapter makes is read from its parameters by the rules in `launches`: world sizes from
`world_sizes`, `oversubscribe` and `nproc` (an "auto" value as each machine a workshop brings resolves
it: distlab.machine.example_machines; the gpu profile on the machines with GPUs only); strategies from
`strategies` (chapter 03), the pipeline table's rows (chapter 04), DDP otherwise. A chapter that calls no
`local.launch_*` but has a training budget (chapter 01) trains in its kernel: its config is checked at world
size 1.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import nbformat

from distlab import paths
from distlab.cli import run_main
from distlab.config import PIPELINE_STRATEGIES, load_config
from distlab.launch.local import TINY_CONFIG, training_spec
from distlab.machine import auto_parameters, example_machines, fitting_global_batch
from distlab.publish.profiles import discover, load_profiles, parameters_for, selects

CONFIG_KEYS_OF_CHAPTERS = ("model", "device", "dtype", "seq_len", "micro_batch_size", "global_batch_size",
                           "max_steps", "lr", "packing", "num_threads", "stage_layers")


@dataclass
class Problem:
    notebook: str
    profile: str
    what: str

    def __str__(self) -> str:
        return f"{self.notebook} [{self.profile}]: {self.what}"


@dataclass
class Launch:
    name: str
    world_size: int
    overrides: dict[str, Any]
    in_process: bool = False  # trained inside the notebook's kernel (chapter 01): a config, no torchrun spec


def notebook_defaults(notebook: str | Path) -> dict[str, Any]:
    """The values the notebook's `parameters` cell assigns (it holds assignments only)."""
    nb = nbformat.read(str(notebook), as_version=4)
    cell = next((c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])), None)
    if cell is None:
        return {}
    namespace: dict[str, Any] = {}
    exec(compile(cell.source, f"{Path(notebook).name}:parameters", "exec"), {}, namespace)  # noqa: S102
    return {k: v for k, v in namespace.items() if not k.startswith("_")}


def launches_training(notebook: str | Path) -> bool:
    nb = nbformat.read(str(notebook), as_version=4)
    return any("launch_training(" in c.source or "launch_sweep(" in c.source for c in nb.cells if c.cell_type == "code")


AUTO_LAUNCH_FIELDS = ("world_sizes", "oversubscribe", "nproc")  # the parameters that shape a launch


def on_machines(params: dict[str, Any], gpus_only: bool) -> list[tuple[str, dict[str, Any]]]:
    """(machine, the parameters with their "auto" launch values resolved there), for every example machine
    (only those with GPUs when `gpus_only`); one unnamed entry when no launch parameter says "auto"."""
    if not any(params.get(k) == "auto" for k in AUTO_LAUNCH_FIELDS):
        return [("", params)]
    out = []
    for name, machine in example_machines().items():
        if gpus_only and not machine.gpus:
            continue
        auto = auto_parameters(machine)
        resolved = {**params, **{k: getattr(auto, k) for k in AUTO_LAUNCH_FIELDS if params.get(k) == "auto"}}
        if resolved.get("global_batch_size") == "auto":  # as the chapter resolves it, from the ranks it runs
            ranks = [*resolved.get("world_sizes", []), resolved.get("oversubscribe") or 0, resolved.get("nproc") or 1]
            resolved["global_batch_size"] = fitting_global_batch(resolved["micro_batch_size"], ranks)
        out.append((name, resolved))
    return out


def launches(stem: str, params: dict[str, Any]) -> list[Launch]:
    """The training launches a chapter makes under these parameters (see the module docstring)."""
    base = {k: params[k] for k in CONFIG_KEYS_OF_CHAPTERS if k in params}
    worlds = sorted({int(w) for w in params.get("world_sizes") or []}
                    | ({int(params["oversubscribe"])} if params.get("oversubscribe") else set())
                    | ({int(params["nproc"])} if params.get("nproc") else set()))
    out: list[Launch] = []
    if "table_rows" in params and params.get("nproc"):  # the pipeline chapter: one stage per rank
        nproc = int(params["nproc"])
        strategy = params.get("table_strategy", "ds_pipeline")
        for micro, ga, ckpt, dtype in params["table_rows"]:
            out.append(Launch(f"{stem}:table b{micro} ga{ga}", nproc, {
                **base, "strategy": strategy, "micro_batch_size": micro, "grad_accum": ga, "global_batch_size": None,
                "activation_checkpointing": ckpt, "dtype": dtype}))
        if params.get("compare_grad_accum"):
            out.append(Launch(f"{stem}:compare", nproc, {**base, "strategy": "pipeline", "global_batch_size": None,
                                                         "grad_accum": params["compare_grad_accum"]}))
        return out
    for world in worlds:
        for strategy in params.get("strategies") or (["ddp"] if world > 1 else ["single"]):
            for mode in params.get("modes") or ["lora"]:
                extra = {"lora": mode == "lora"}
                if mode == "full" and "full_lr" in params:
                    extra["lr"] = params["full_lr"]
                out.append(Launch(f"{stem}:{strategy}/{mode} ws{world}", world,
                                  {**base, "strategy": strategy, **extra}))
    return out


def check_launch(launch: Launch) -> str | None:
    """Build the launch's config and torchrun spec as local.launch_training would; the error, or None."""
    try:
        cfg = load_config(TINY_CONFIG, launch.overrides, override_source="the notebook's parameters")
        data_parallel = 1 if cfg.strategy in PIPELINE_STRATEGIES else launch.world_size
        cfg.micro_steps(data_parallel)
        if launch.in_process:
            return None
        training_spec(launch.name.replace(":", "_").replace(" ", "_").replace("/", "_"), launch.world_size,
                      launch.overrides).validate()
    except (ValueError, TypeError) as exc:  # ConfigError and LaunchSpecError are ValueErrors
        return f"{launch.name}: {exc}"
    return None


def check(profiles: Iterable[str] | None = None, notebooks_dir: str | Path = paths.NOTEBOOKS_DIR
          ) -> tuple[list[Problem], list[str]]:
    """(problems, one line per notebook and profile saying what was checked)."""
    notebooks_dir = Path(notebooks_dir)
    table = load_profiles(notebooks_dir / "profiles.yaml")
    problems: list[Problem] = []
    report: list[str] = []
    for profile in profiles or list(table):
        shared = set(table.get(profile, {}).get("*", {}))
        declared = set().union(*(notebook_defaults(nb) for nb in discover(notebooks_dir)))
        for name in sorted(shared - declared):
            problems.append(Problem("*", profile, f"profile parameter {name!r} is declared by no notebook"))
        for nb in discover(notebooks_dir):
            defaults = notebook_defaults(nb)
            given = parameters_for(table, profile, nb)
            # A "*" value is shared by every chapter and only some use it; a chapter's own must be declared.
            own = {k: v for key, body in table.get(profile, {}).items() if key != "*" and selects(key, nb)
                   for k, v in body.items()}
            for name in sorted(set(own) - set(defaults)):
                problems.append(Problem(nb.stem, profile, f"profile parameter {name!r} is declared by no "
                                                          "parameters cell (papermill would inject it unused)"))
            # what the notebook sees: its defaults, replaced by the profile's values it declares
            merged = {**defaults, **{k: v for k, v in given.items() if k in defaults}}
            if launches_training(nb):
                planned = [Launch(f"{launch.name} on {where}" if where else launch.name, launch.world_size,
                                  launch.overrides, launch.in_process)
                           for where, params in on_machines(merged, gpus_only=profile == "gpu")
                           for launch in launches(nb.stem, params)]
            elif "max_steps" in defaults and "micro_batch_size" in defaults:  # trains in the kernel itself
                planned = [Launch(f"{nb.stem}:in-process", 1, {k: merged[k] for k in CONFIG_KEYS_OF_CHAPTERS
                                                               if k in merged}, in_process=True)]
            else:
                planned = []
            failed = [msg for launch in planned if (msg := check_launch(launch))]
            problems += [Problem(nb.stem, profile, msg) for msg in failed]
            worlds = sorted({launch.world_size for launch in planned})
            report.append(f"{profile:6} {nb.stem:32} {len(given):2} parameter(s), {len(planned):2} launch(es)"
                          + (f" at world size {', '.join(map(str, worlds))}" if worlds else "")
                          + (f": {len(failed)} FAILED" if failed else ": ok"))
    return problems, report


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m distlab.publish.dryrun", description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", nargs="+", help="profiles to check (default: every profile in profiles.yaml)")
    args = ap.parse_args(argv)
    problems, report = check(args.profile)
    print("\n".join(report))
    for p in problems:
        print(f"PROBLEM {p}")
    print(f"dryrun: {len(report)} notebook x profile pairs, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    run_main(main)
