"""A scale rehearsal: every strategy for 2 steps of the Qwen2.5-0.5B shape on 2 CPU ranks, each rank's
memory at load and in a step beside the planner's. A benchmark, not a timed test.

    python -m distlab.bench.scale_rehearsal [--strategies fsdp,zero3] [--modes lora,full,qlora] [--out figures]

The model is the 0.5B preset saved once as a safetensors folder in bf16 (distlab.models.random_preset_folder),
so the strategies that read slices do (distlab.sharded_load). Each run is a fresh torchrun launch (one core per
rank, fp32), so each rank's memory is its own. Per run and rank it prints:

  load   the host memory the load added: peak RSS while the model loads, less the RSS before it;
         planned: distlab.planning.load.plan_load's host bytes (on a CPU the device is the host)
  step   the peak RSS of the training steps, less the same starting point; planned: plan_memory's total
  ratio  measured / planned for each

fsdp_tp needs two tensor-parallel pairs: it runs on 4 ranks, 2 cores oversubscribed (memory, not speed).
What RSS holds beyond the plan is the runtime's, not the model's: glibc keeps freed blocks of the gathered
tensors (its mmap threshold rises after the first large free), and a step adds autograd's and the
collectives' scratch. The load is what the planner must get right; the step's ratio says how far a CPU
run's RSS is from the bytes planned. FSDP + QLoRA's load reads above its plan: each weight it packs leaves a
little more resident memory than the rank keeps of it (freed buffers the allocator holds on to, most of which
distlab.sharded_load.return_freed_memory gives back).

QLoRA (a 4-bit NF4 base, LoRA on it) runs where a 4-bit base can: one device, DDP (each rank quantises the
whole model as from_pretrained loads it) and FSDP (each rank packs one weight at a time and keeps its share:
distlab.sharded_load). Full fine-tuning runs where this machine's memory allows: the planned step of every
rank together under half of the memory available now, else its row says so. The suite runs it on the tiny model
(tests/launches/test_scale_rehearsal.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
import psutil

from distlab.cli import UsageError, run_main
from distlab.config import QUANTISED_STRATEGIES
from distlab.launch.process import RunFailed
from distlab.planning.load import plan_load
from distlab.planning.plan import plan_memory
from distlab.provenance import save_table, stamp

STRATEGIES = ("single", "ddp", "zero2", "fsdp", "zero3", "tp", "fsdp_tp", "pipeline", "ds_pipeline")
MODES = ("lora", "full", "qlora")
PRESET = "qwen2.5-0.5b-random"
TABLE = "scale_rehearsal.csv"
RUN = {"dtype": "fp32", "device": "cpu", "seq_len": 128, "packing": True, "micro_batch_size": 1,
       "global_batch_size": 2, "warmup_steps": 0, "eval_at_start": False, "eval_at_end": False,
       "save_model": False, "checkpoint_steps": 0, "resume": False, "logging_steps": 1, "lora_r": 16}
CHECKPOINT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def rehearsal_folder(model: str | None) -> Path:
    """The folder a run reads: the preset saved as safetensors, or any local model folder."""
    from distlab import models  # deferred: transformers is slow to import

    return Path(models.random_preset_folder(PRESET) if model in (None, PRESET) else models.resolve_model(model))


def planned(shape: dict, strategy: str, world: int, mode: str, rank: int, checkpoint_bytes: float) -> dict:
    kw = dict(dtype="nf4" if mode == "qlora" else "fp32", lora_r=None if mode == "full" else RUN["lora_r"],
              micro_batch=RUN["micro_batch_size"], seq_len=RUN["seq_len"], rank=rank)
    load = plan_load(shape, strategy=strategy, world_size=world, on_gpu=False, checkpoint_bytes=checkpoint_bytes,
                     **kw)
    step = plan_memory(shape, strategy=strategy, world_size=world, **kw)
    return {"path": load.path, "load_planned": load.host, "step_planned": step.total}


def rehearse(model: str | None = None, strategies=STRATEGIES, modes=MODES, steps: int = 2, nproc: int = 2,
             timeout_s: int = 900) -> pd.DataFrame:
    """One fresh launch per strategy and mode; a row per rank (or one row saying why a run was skipped)."""
    from distlab.launch import local  # deferred: the launcher imports the training stack
    from distlab.results.extract import collect_run

    folder = rehearsal_folder(model)
    shape = json.loads((folder / "config.json").read_text())
    checkpoint_bytes = CHECKPOINT_BYTES[shape.get("torch_dtype") or shape.get("dtype") or "float32"]
    rows = []
    for mode in modes:
        for strategy in strategies:
            if mode == "qlora" and strategy not in QUANTISED_STRATEGIES:
                continue  # a 4-bit base runs on one device, DDP and FSDP only (distlab.config refuses the others)
            # fsdp_tp needs two tensor-parallel groups of 2: 4 ranks, 2 cores each oversubscribed (memory, not time)
            world = 1 if strategy == "single" else 4 if strategy == "fsdp_tp" else nproc
            plans = [planned(shape, strategy, world, mode, r, checkpoint_bytes) for r in range(world)]
            need = sum(plan["step_planned"] for plan in plans)
            if mode == "full" and need > psutil.virtual_memory().available / 2:
                rows.append({"strategy": strategy, "mode": mode, "rank": None, "skipped":
                             f"planned {need / 2**30:.1f} GiB for {world} ranks, over half the "
                             f"{psutil.virtual_memory().available / 2**30:.1f} GiB available"})
                continue
            overrides = {**RUN, "model": str(folder), "strategy": strategy, "lora": mode != "full", "max_steps": steps,
                         "quantization": "nf4" if mode == "qlora" else "none"}
            if strategy == "fsdp_tp":
                overrides["tp_size"] = 2
            try:
                job = local.launch_training(f"rehearsal_{strategy}_{mode}", world, overrides, timeout_s=timeout_s,
                                            echo=False)
            except RunFailed as failure:  # a row saying so, and the rehearsal goes on
                lines = [line for line in str(failure).splitlines() if "Error" in line] or ["failed"]
                rows.append({"strategy": strategy, "mode": mode, "rank": None, "skipped": lines[-1].strip()[:200]})
                print(f"{strategy} {mode}: FAILED: {rows[-1]['skipped']}", flush=True)
                continue
            for rank, rec in sorted(collect_run(job.output_dir, expected_ranks=world).items()):
                before = rec["host_before_load_bytes"]
                plan = plans[rank]
                load = rec["host_peak_at_load_bytes"] - before
                step = rec["peak_mem_bytes"] - before
                rows.append({"strategy": strategy, "mode": mode, "rank": rank, "path": plan["path"],
                             "load_mib": load / 2**20, "load_planned_mib": plan["load_planned"] / 2**20,
                             "load_ratio": load / plan["load_planned"], "step_mib": step / 2**20,
                             "step_planned_mib": plan["step_planned"] / 2**20,
                             "step_ratio": step / plan["step_planned"], "skipped": ""})
            print(pd.DataFrame(rows[-world:]).round(3).to_string(index=False), flush=True)
    table = pd.DataFrame(rows)
    table["rank"] = table["rank"].astype("Int64")  # a whole number, blank where a run was skipped
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab.bench.scale_rehearsal",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help=f"a local model folder (default: the {PRESET} preset, saved in bf16)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per launch before it is killed")
    parser.add_argument("--out", metavar="DIR", help=f"save {TABLE} here with a provenance sidecar")
    args = parser.parse_args(argv)
    strategies, modes = args.strategies.split(","), args.modes.split(",")
    unknown = sorted(set(strategies) - set(STRATEGIES)) + sorted(set(modes) - set(MODES))
    if unknown:
        raise UsageError(f"unknown strategy or mode: {', '.join(unknown)} (strategies: {', '.join(STRATEGIES)}; "
                         f"modes: {', '.join(MODES)})")
    table = rehearse(args.model, strategies, modes, args.steps, timeout_s=args.timeout)
    print(table.round(3).to_string(index=False))
    if args.out:
        # deferred: only saving the table needs the digest of the tree it was measured from
        from distlab.publish.freshness import benchmark_inputs

        module = "distlab.bench.scale_rehearsal"
        save_table(table, Path(args.out) / TABLE, {**stamp(args.model or PRESET, 2), "benchmark": module,
                                                   "arguments": vars(args),
                                                   "inputs": benchmark_inputs(module, vars(args))})
    return 0


if __name__ == "__main__":
    run_main(main)
