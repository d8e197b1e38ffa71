"""DistributedDataParallel: every rank holds the whole model and sums gradients with all-reduce.

What changes against one device: the process group (gloo on CPU, nccl on GPUs), the model
wrapper that all-reduces gradients bucket by bucket during backward, `no_sync` on all but the
last micro-step of an accumulation (one all-reduce per optimizer step, not per micro-batch), and
collectives for the logged counts. Data sharding is already in the loop (DistributedSampler)."""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.device import DeviceChoice
from distlab.strategies.base import DistributedStrategy


class DDPStrategy(DistributedStrategy):
    name = "ddp"

    def wrap_model(self, model: torch.nn.Module, choice: DeviceChoice) -> torch.nn.Module:
        model = model.to(choice.device)
        ddp = DDP(model, device_ids=[choice.device.index] if choice.device.type == "cuda" else None)
        self.meter.watch_ddp(ddp, self.world_size)  # a comm hook that times each bucket's all-reduce
        return ddp

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.module

    def sync_context(self, model, sync: bool):
        return contextlib.nullcontext() if sync else model.no_sync()
