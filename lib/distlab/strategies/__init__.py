"""How the one training loop is distributed: each strategy is a small module around distlab.train.

Read `base` first (the hooks the loop calls), then one file per parallelism, in the book's order:

  base         the interface, `parallelize` (the one order of a model's transformations),   ch. 01-03
               the process-group plumbing, the helpers strategies share
  single       everything on one device                                                   ch. 01
  ddp          DistributedDataParallel: whole model per rank, gradients all-reduced       ch. 02
  fsdp         FSDP2 `fully_shard`: weights, gradients and optimizer state sharded         ch. 03
  zero         DeepSpeed ZeRO stage 2 and 3                                               ch. 03
  deepspeed_runtime  DeepSpeed's start-up (JIT comm op cache) and config, for zero and ds_pipeline
  split        cutting a decoder into stage modules, label-only loss                      ch. 04
  staged       what both pipelines share: a rank's stage, its replicas, its step         ch. 04
  pipeline     torch.distributed.pipelining (GPipe, 1F1B, interleaved 1F1B)                ch. 04
  ds_pipeline  the same split with DeepSpeed's PipelineModule                              ch. 04
  tp           tensor parallelism (DTensor): each layer's projections split over the ranks  ch. 07
  fsdp_tp      2-D: tensor parallelism inside groups of ranks, FSDP across the groups       ch. 08

The one list of strategy names is distlab.config.STRATEGY_NAMES (the config, the launcher and the planner
read it without importing torch); the registry below maps each to its class. Importing this package
loads no strategy: `make_strategy` imports the one a run asks for.
"""

from __future__ import annotations

import importlib

from distlab.config import PIPELINE_STRATEGIES, STRATEGY_NAMES

__all__ = ["PIPELINE_STRATEGIES", "STRATEGY_NAMES", "make_strategy", "strategy_class"]

# name -> "module:Class"; the module imports torch, DeepSpeed or pipelining only when asked for
_REGISTRY = {
    "single": "single:SingleDevice",
    "ddp": "ddp:DDPStrategy",
    "fsdp": "fsdp:FSDPStrategy",
    "zero2": "zero:Zero2Strategy",
    "zero3": "zero:Zero3Strategy",
    "pipeline": "pipeline:PipelineStrategy",
    "ds_pipeline": "ds_pipeline:DeepSpeedPipelineStrategy",
    "tp": "tp:TPStrategy",
    "fsdp_tp": "fsdp_tp:FSDPxTPStrategy",
}
assert tuple(_REGISTRY) == STRATEGY_NAMES, "distlab.config.STRATEGY_NAMES and the registry list the same strategies"


def strategy_class(name: str):
    try:
        module, cls = _REGISTRY[name].split(":")
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; available: {', '.join(STRATEGY_NAMES)}") from None
    return getattr(importlib.import_module(f"distlab.strategies.{module}"), cls)


def make_strategy(name: str):
    return strategy_class(name)()
