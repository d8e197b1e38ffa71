"""Memory overflow on the small device: the planner's bytes against a host's memory cap, the OOM kill, the fix.

    placement = host_runs.place(2)
    with placement.running():
        r = overflow_demo(placement)     # full fine-tuning OOM-killed on host 1, then the planner's advice
    print(report(r))

Host 1 gets a cgroup memory cap (distlab.lan.cgroups) standing in for a smaller GPU. The model is a
random-init Qwen2 of about 28M parameters (`demo_model`), big enough that what the planner counts
(weights, gradients, AdamW's moments, DDP's buckets) outweighs what it does not (the interpreter, torch,
the torchrun agent: `RUNTIME_ALLOWANCE`, the "reserve" the recommender keeps on every device). The cap is
that allowance plus `CAP_FRACTION` of the planned DDP replica, so full fine-tuning cannot fit: the kernel's
OOM killer SIGKILLs rank 1 (exit -9), torchrun on host 1 reports it, and rank 0 fails at once on its
broken connection (a dead process's sockets are closed by the kernel: no collective timeout). Then the
recommender's choice for LoRA r=16 on the same caps (a DDP replica: every GPU fits it) runs under the same
cap and completes. Its choice for full fine-tuning, FSDP at 275 MiB planned, was OOM-killed too under
this cap when tried: each rank first loads the whole model and the runtime dwarfs the state saved.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import psutil

from distlab.lan import host_runs
from distlab.lan.cgroups import HostLimits, oom_killed
from distlab.lan.diagnose import diagnose, first_error

MIB = 2**20
GIB = 2**30
# What a rank's host holds besides the planned training state: the torchrun agent and the rank's
# interpreter with torch, transformers and the data loaded (the recommender keeps it back as its
# per-device reserve). Measured: the LoRA rerun peaks at 768 MiB in its memory group (page cache
# included) with 178 MiB planned, so about 590 MiB is runtime; the demo prints its peak every time.
RUNTIME_ALLOWANCE = 600 * MIB
CAP_FRACTION = 0.6  # host 1's cap leaves room for 60% of the planned DDP replica: full fine-tuning overflows
TRAIN = {"eval_file": None, "save_model": False, "logging_steps": 1, "seq_len": 128, "micro_batch_size": 1,
         "grad_accum": 1, "eval_at_start": False, "eval_at_end": False, "dtype": "fp32", "lora": False,
         "lora_dropout": 0.0, "warmup_steps": 0}


def demo_model() -> Path:
    """The tiny Qwen2's shape with 8 layers and a 4096-wide FFN (27.7M parameters, random init), built once:
    its planned state, not the runtime around it, decides whether a rank fits."""
    from distlab.models import balanced_bench_model  # deferred: distlab.models pulls in torch

    return Path(balanced_bench_model(intermediate_size=4096, layers=8))


def model_config(model_dir: Path):
    from transformers import AutoConfig  # deferred: transformers is slow to import

    return AutoConfig.from_pretrained(model_dir)


def planned_bytes(config, strategy: str, lora: bool, world: int = 2) -> int:
    from distlab.planning.load import peak_bytes  # deferred: the planner pulls in pandas

    return int(peak_bytes(config, strategy=strategy, world_size=world, dtype="fp32", lora_r=16 if lora else None,
                          micro_batch=TRAIN["micro_batch_size"], seq_len=TRAIN["seq_len"]))


def advice(config, caps: list[int], allowance: int, lora_r: int | None = 16):
    """The recommender's decision tree on devices of these caps (each keeping the runtime allowance back,
    as it keeps a CUDA context's reserve on a GPU), for LoRA r=`lora_r` (None: full fine-tuning)."""
    from distlab.planning.advice import recommend  # deferred: pulls in pandas

    devices = [{"name": f"dl5h{i}", "memory_gib": c / GIB} for i, c in enumerate(caps)]
    return recommend(config, devices, lora_r=lora_r, weight_bytes=4, seq_len=TRAIN["seq_len"],
                     micro_batch=TRAIN["micro_batch_size"], activation_checkpointing=False, reserve_gib=allowance / GIB,
                     link_gbit=1.0, model_name="the 28M demo model")


def _unprefixed(line: str) -> str:
    """A console line without the runner's `[dl5h1] ` and torchrun's `[default0]:` prefixes."""
    return re.sub(r"^(\[[\w.]+\]:? ?)+", "", line).strip()


def rank_exit_line(lines: list[str]) -> str:
    """torchrun's failure summary for the killed rank (`rank : 1 ...`, `exitcode : -9 ...`), as one line."""
    plain = [_unprefixed(ln) for ln in lines]
    for i, line in enumerate(plain):
        if re.match(r"exitcode\s*:\s*-9", line):
            rank = next((m.group(1) for ln in reversed(plain[max(0, i - 4):i])
                         if (m := re.match(r"rank\s*:\s*(\d+)", ln))), "?")
            host = next((m.group(1) for ln in plain[max(0, i - 4):i] if (m := re.match(r"host\s*:\s*(\S+)", ln))),
                        "")
            return f"rank {rank}{' on ' + host if host else ''}: {line}"
    return first_error(lines)


def _host_memory(placement, i: int) -> dict:
    return oom_killed(placement.name(i))


def cgroup_line(name: str, seen: dict) -> str:
    """The memory group's own account of the run, as one line the diagnosis rules read."""
    return (f"[{name}] memory cgroup: oom_kill {seen.get('oom_kills')}, failcnt {seen.get('failcnt')}, peak "
            f"{seen.get('max_usage_bytes', 0) / MIB:.0f} MiB of a {seen.get('limit_bytes', 0) / MIB:.0f} MiB cap")


def overflow_demo(placement: host_runs.Placement, *, steps: int = 3, allowance: int = RUNTIME_ALLOWANCE,
                  cap_fraction: float = CAP_FRACTION, echo=False, timeout_s: int = 180,
                  rerun: bool = True) -> dict[str, Any]:
    """Full fine-tuning under host 1's cap (OOM-killed), then (`rerun`) the planner's advice under the same cap."""
    r = overflow_failure(placement, steps=steps, allowance=allowance, cap_fraction=cap_fraction, echo=echo,
                         timeout_s=timeout_s)
    return rerun_with_advice(placement, r, echo=echo, timeout_s=timeout_s) if rerun else r


def overflow_failure(placement: host_runs.Placement, *, steps: int = 3, allowance: int = RUNTIME_ALLOWANCE,
                     cap_fraction: float = CAP_FRACTION, echo=False, timeout_s: int = 180) -> dict[str, Any]:
    """Full fine-tuning under host 1's cap: the planner's bytes, the kill, its evidence and the advice."""
    if placement.cluster is None:
        raise RuntimeError(f"the memory cap needs the namespace cluster and cgroups: {placement.why_local}")
    model_dir = demo_model()
    config = model_config(model_dir)
    need = planned_bytes(config, "ddp", lora=False, world=placement.nodes)
    cap = int(allowance + cap_fraction * need)
    caps = [psutil.virtual_memory().total // placement.nodes] + [cap] * (placement.nodes - 1)
    overrides = {**TRAIN, "model": str(model_dir), "max_steps": steps, "strategy": "ddp"}
    failed = host_runs.run_training(placement, "overflow_full", overrides, limits=_limits(placement, cap), echo=echo,
                               timeout_s=timeout_s)
    seen = _host_memory(placement, 1)  # read before the next launch resets the group
    lines = [*failed.lines, cgroup_line(placement.name(1), seen)]
    rec = advice(config, caps, allowance)
    return {"model": str(model_dir), "overrides": overrides, "planned_full_ddp_bytes": need, "cap_bytes": cap,
            "allowance_bytes": allowance, "full_ok": failed.ok, "full_elapsed_s": failed.elapsed_s,
            "full_node_exit": [r.returncode for r in failed.results], "error_line": rank_exit_line(failed.lines),
            "cgroup_line": lines[-1], "full_tail": failed.lines[-30:], "diagnosis": diagnose(lines), "oom": seen,
            "advice": rec.label, "advice_reasoning": rec.reasoning, "advice_strategy": rec.strategy,
            "advice_planned_bytes": int(rec.decision.chosen.peak) if rec.plan else None}


def rerun_with_advice(placement: host_runs.Placement, r: dict[str, Any], *, echo=False, timeout_s: int = 180) -> dict:
    """The advised setup (LoRA, the recommender's strategy) under the cap the full fine-tuning overflowed."""
    if r["advice_strategy"] == "none":
        return r
    fixed = host_runs.run_training(placement, "overflow_advised", {**r["overrides"], "strategy": r["advice_strategy"],
                                                               "lora": True},
                              limits=_limits(placement, r["cap_bytes"]), echo=echo, timeout_s=timeout_s)
    return {**r, "advised_ok": fixed.ok, "advised_elapsed_s": fixed.elapsed_s,
            "advised_oom": _host_memory(placement, 1), "advised_failure": fixed.failure() if not fixed.ok else ""}


def _limits(placement: host_runs.Placement, cap: int) -> list[HostLimits]:
    return [HostLimits()] + [HostLimits(memory_bytes=cap)] * (placement.nodes - 1)


def report(r: dict) -> str:
    """What the chapter prints: the planner's bytes, the cap, the kill, the advice and its rerun."""
    need = r["planned_full_ddp_bytes"] / MIB
    cap, allowance = r["cap_bytes"] / MIB, r["allowance_bytes"] / MIB
    lines = [f"planner: full fine-tuning under DDP needs {need:.0f} MiB per rank; host 1's cap {cap:.0f} MiB = "
             f"{allowance:.0f} MiB runtime allowance + {cap - allowance:.0f} MiB for training state",
             f"full fine-tuning: {'completed' if r['full_ok'] else 'FAILED'} after {r['full_elapsed_s']:.1f} s "
             f"(node exit codes {r['full_node_exit']}): {r['error_line']}",
             f"  {r['cgroup_line']}",
             f"  diagnosis: {', '.join(d['rule'] for d in r['diagnosis']) or 'no rule matched'}",
             f"advice for LoRA r=16 on the same caps: {r['advice']}"
             + (f" ({r['advice_planned_bytes'] / MIB:.0f} MiB per rank planned)" if r["advice_planned_bytes"] else "")]
    if "advised_ok" in r:
        peak = r["advised_oom"].get("max_usage_bytes", 0) / MIB
        lines.append(f"advised run under the same cap: {'completed' if r['advised_ok'] else 'FAILED'} in "
                     f"{r['advised_elapsed_s']:.1f} s, host 1 peak {peak:.0f} MiB, oom_kill "
                     f"{r['advised_oom'].get('oom_kills')}")
    return "\n".join(lines)
