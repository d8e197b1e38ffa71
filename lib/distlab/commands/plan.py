"""A training config's memory plan per rank and the LAN-cluster guide's advice, before anything runs.

    python -m distlab plan --config lib/distlab/configs/lan_qlora_7b.yaml [--set seq_len=1024]

Reads the config as distlab.train does (every field checked), takes the model's shape offline (a folder's
config.json, a random preset, the tiny default, or one of the studied models' hub ids: no download), and
prints (1) what one rank of a DDP replica holds with the config's settings (quantised base, LoRA targets,
optimizer, checkpointing, micro-batch x seq_len), component by component, against each GPU's usable memory,
and (2) the recommender's decision tree (distlab.planning.advice.recommend) for the same LoRA run on those
GPUs, starting from a bf16 base. Devices: the LAN cluster guide's three cards unless --devices says
otherwise (NAME:GB,NAME:GB,...).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from distlab import markdown
from distlab.cli import UsageError, finite_float
from distlab.config import load_config, parse_override
from distlab.planning.advice import recommend
from distlab.planning.cards import LAN_CLUSTER
from distlab.planning.load import plan_load
from distlab.planning.memory import GIB, breakdown_table
from distlab.planning.plan import plan_memory
from distlab.planning.shapes import CASE_STUDY_MODEL_IDS

# TrainConfig.optimizer -> the planner's optimizer (paging moves the state, it does not shrink it)
PLANNER_OPTIMIZER = {"adamw": "adamw", "adamw_8bit": "adamw8bit", "paged_adamw_8bit": "adamw8bit"}
PLANNER_DTYPE = {"none": None, "nf4": "nf4", "int8": "int8"}


def model_shape_of(model: str | None) -> dict:
    """The HF config (as a dict) of a config's `model`, without downloading anything."""
    from distlab import models  # deferred: torch and transformers only when a local model is read

    if model in models.RANDOM_PRESETS:
        return {"vocab_size": len(models.load_tokenizer(None)), **models.RANDOM_PRESETS[model]}
    if model in CASE_STUDY_MODEL_IDS:
        return dict(CASE_STUDY_MODEL_IDS[model])
    folder = Path(models.resolve_model(model))
    if not (folder / "config.json").is_file():
        raise UsageError(f"model={model!r}: no offline shape (give a folder holding config.json, a preset, or one "
                         f"of {', '.join(CASE_STUDY_MODEL_IDS)})")
    return json.loads((folder / "config.json").read_text())


def parse_devices(text: str | None) -> list[dict]:
    if not text:
        return LAN_CLUSTER
    devices = []
    for item in text.split(","):
        name, _, gb = item.rpartition(":")
        try:
            devices.append({"name": name or f"gpu{len(devices)}", "memory_gib": float(gb)})
        except ValueError:
            raise UsageError(f"--devices {text!r}: expected NAME:GB,NAME:GB,... (e.g. 'RTX 4070:8')") from None
    return devices


def config_plan(cfg, shape: dict, world_size: int):
    """What one rank holds with the config's settings, in a step (the planner's per-component breakdown) and
    while the model loads (distlab.planning.load): a DDP replica, or with strategy=fsdp (FSDP + QLoRA for a
    4-bit base) one rank's shards. Returns (step plan, load peak)."""
    strategy = "fsdp" if cfg.strategy == "fsdp" else ("ddp" if world_size > 1 else "single")
    settings = dict(dtype=PLANNER_DTYPE[cfg.quantization], weight_bytes=None if cfg.quantization != "none" else 2,
                    lora_r=cfg.lora_r if cfg.lora else None, lora_targets=cfg.lora_targets,
                    micro_batch=cfg.micro_batch_size, seq_len=cfg.seq_len,
                    activation_checkpointing=cfg.activation_checkpointing,
                    optimizer=PLANNER_OPTIMIZER[cfg.optimizer], activation_bytes=2, double_quant=cfg.double_quant)
    return (plan_memory(shape, strategy=strategy, world_size=world_size, **settings),
            plan_load(shape, strategy=strategy, world_size=world_size, **settings))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML file of TrainConfig fields")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one field")
    parser.add_argument("--devices", help="NAME:GB,... (default: the LAN cluster guide's three GPUs)")
    parser.add_argument("--link-gbit", type=finite_float, default=1.0, help="the link between the GPUs' hosts")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, dict(parse_override(s) for s in args.set))
    devices = parse_devices(args.devices)
    shape = model_shape_of(cfg.model)
    plan, load = config_plan(cfg, shape, len(devices))
    peak = max(plan.total, load.device)  # a rank must fit both: loading and a step
    gib = GIB
    print(f"plan: {cfg.model}, quantization={cfg.quantization}, LoRA r={cfg.lora_r} on {','.join(cfg.lora_targets)}, "
          f"optimizer={cfg.optimizer}, micro-batch {cfg.micro_batch_size} x {cfg.seq_len} tokens, activation "
          f"checkpointing={cfg.activation_checkpointing}; " +
          (f"sharded by FSDP over {len(devices)} GPUs" if cfg.strategy == "fsdp" else
           f"one replica per GPU ({len(devices)} GPUs)"))
    print(markdown.table(breakdown_table({"per rank": plan}, unit=gib, unit_name="GiB").round(3).reset_index()))
    print(f"while the model loads ({load.path}): {load.device / gib:.2f} GiB per GPU, {load.host / gib:.2f} GiB of "
          f"host memory per rank; a step: {plan.total / gib:.2f} GiB per GPU")
    reserve = 1.5
    for d in devices:
        usable = d["memory_gib"] - reserve
        verdict = "fits" if peak / gib <= usable else "does NOT fit"
        print(f"  {d['name']}: {usable:.1f} GiB usable ({d['memory_gib']:g} - {reserve} reserve): "
              f"{peak / gib:.2f} GiB {verdict}" + (" (the load is the peak)" if load.device > plan.total else ""))
    rec = recommend(shape, devices, lora_r=cfg.lora_r if cfg.lora else None, lora_targets=cfg.lora_targets,
                    seq_len=cfg.seq_len, micro_batch=cfg.micro_batch_size,
                    activation_checkpointing=cfg.activation_checkpointing,
                    optimizer=PLANNER_OPTIMIZER[cfg.optimizer], reserve_gib=reserve, link_gbit=args.link_gbit,
                    model_name=str(cfg.model))
    print(rec)
    return 0
