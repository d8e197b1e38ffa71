"""DistributedDataParallel: every rank holds the whole model and sums gradients with all-reduce.

What changes against one device: the process group (gloo on CPU, nccl on GPUs), the model
wrapper that all-reduces gradients bucket by bucket during backward, `no_sync` on all but the
last micro-step of an accumulation (one all-reduce per optimizer step, not per micro-batch), and
collectives for the logged counts. Data sharding is already in the loop (DistributedSampler).

Gradient compression (chapter 05, `TrainConfig.ddp_comm_hook`): one of torch's DDP communication hooks
replaces the fp32 all-reduce of each bucket. fp16/bf16 halve the bytes on the wire; PowerSGD sends two
thin factors per gradient matrix and keeps the error it made for the next step (error feedback). That
PowerSGD state lives in the hook, not in the model or optimizer, and is NOT checkpointed: a resumed run
restarts it (two plain all-reduces, then fresh error feedback), so it is not bit-for-bit the
uninterrupted run, as every other distlab resume is."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.device import DeviceChoice
from distlab.strategies.base import DistributedStrategy

# PowerSGD's error feedback and warm start need DDP's buckets to be final, which they are after the
# first two steps (DDP rebuilds them in step 2): torch refuses fewer, and plain all-reduce runs until then.
POWERSGD_START_STEP = 2


class DDPStrategy(DistributedStrategy):
    name = "ddp"

    def setup(self, cfg) -> None:
        super().setup(cfg)
        self.comm_hook = compression_hook(cfg.ddp_comm_hook, cfg.powersgd_rank, self.backend)

    def wrap(self, model: torch.nn.Module, optimizer, scheduler, choice: DeviceChoice, cfg):
        ddp = DDP(model, device_ids=[choice.device.index] if choice.device.type == "cuda" else None)
        # the compression hook, inside the meter's timing hook when measuring (DDP takes only one)
        self.meter.watch_ddp(ddp, self.world_size, self.comm_hook)
        return ddp, optimizer, scheduler

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.module

    def sync_context(self, model, sync: bool):
        return contextlib.nullcontext() if sync else model.no_sync()


def compression_hook(name: str | None, powersgd_rank: int, backend: str):
    """(state, hook) for DDP.register_comm_hook, or None for DDP's own fp32 all-reduce."""
    if name is None:
        return None
    if name == "bf16" and backend == "gloo" and not gloo_reduces_bf16():
        raise ValueError("ddp_comm_hook='bf16': this torch's gloo backend (CPU) cannot all-reduce bfloat16 "
                         "tensors; use fp16 or powersgd on CPU, bf16 on GPUs (nccl)")
    if name == "fp16":
        return None, default_hooks.fp16_compress_hook
    if name == "bf16":
        return None, default_hooks.bf16_compress_hook
    # every rank seeds the same random projections (random_seed), as PowerSGD requires
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank,
                                        start_powerSGD_iter=POWERSGD_START_STEP, random_seed=0)
    return state, powerSGD_hook.powerSGD_hook


def gloo_reduces_bf16() -> bool:
    """Whether gloo sums bfloat16 here: a one-element all-reduce (collective: every rank asks)."""
    try:
        probe = torch.ones(1, dtype=torch.bfloat16)
        dist.all_reduce(probe)
    except RuntimeError:
        return False
    return bool(probe.item() == dist.get_world_size())
