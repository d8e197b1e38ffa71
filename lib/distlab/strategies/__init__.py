"""How the one training loop is distributed: each strategy is a small module around distlab.train.

Read `base` first (the hooks the loop calls), then one file per parallelism, in the book's order:

  base         the interface, the process-group plumbing, the helpers strategies share     ch. 01-03
  single       everything on one device                                                   ch. 01
  ddp          DistributedDataParallel: whole model per rank, gradients all-reduced       ch. 02
  fsdp         FSDP2 `fully_shard`: weights, gradients and optimizer state sharded         ch. 03
  zero         DeepSpeed ZeRO stage 2 and 3                                               ch. 03
  deepspeed_runtime  DeepSpeed's start-up (JIT comm op cache) and config, for zero and ds_pipeline
  split        cutting a decoder into stages: layer split, stage module, label-only loss   ch. 04
  pipeline     torch.distributed.pipelining (GPipe, 1F1B)                                  ch. 04
  ds_pipeline  the same split with DeepSpeed's PipelineModule                              ch. 04

The names below are the one list of strategies (the launcher and the planner read them too).
Importing this package loads no strategy: `make_strategy` imports the one a run asks for.
"""

from __future__ import annotations

import importlib

# name -> "module:Class"; the module imports torch, DeepSpeed or pipelining only when asked for
_REGISTRY = {
    "single": "single:SingleDevice",
    "ddp": "ddp:DDPStrategy",
    "fsdp": "fsdp:FSDPStrategy",
    "zero2": "zero:Zero2Strategy",
    "zero3": "zero:Zero3Strategy",
    "pipeline": "pipeline:PipelineStrategy",
    "ds_pipeline": "ds_pipeline:DeepSpeedPipelineStrategy",
}
STRATEGY_NAMES: tuple[str, ...] = tuple(_REGISTRY)
PIPELINE_STRATEGIES: tuple[str, ...] = ("pipeline", "ds_pipeline")  # the world is split into stages


def strategy_class(name: str):
    try:
        module, cls = _REGISTRY[name].split(":")
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; available: {', '.join(STRATEGY_NAMES)}") from None
    return getattr(importlib.import_module(f"distlab.strategies.{module}"), cls)


def make_strategy(name: str):
    return strategy_class(name)()
