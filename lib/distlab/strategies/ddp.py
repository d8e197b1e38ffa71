"""DistributedDataParallel: every rank holds the whole model and sums gradients with all-reduce.

What changes against one device: the process group (gloo on CPU, nccl on GPUs), the model
wrapper that all-reduces gradients bucket by bucket during backward, `no_sync` on all but the
last micro-step of an accumulation (one all-reduce per optimizer step, not per micro-batch), and
collectives for the logged counts. Data sharding is already in the loop (DistributedSampler)."""

from __future__ import annotations

import contextlib
import datetime
import os
import time

import torch
import torch.distributed as dist

from ..device import DeviceChoice
from .single import Strategy


def backend_for(device: str) -> str:
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return "gloo"
    return "nccl"


class DistributedStrategy(Strategy):
    """Process-group plumbing shared by every multi-rank strategy."""

    def setup(self, cfg) -> None:
        if "RANK" not in os.environ:
            raise RuntimeError(f"strategy {self.name!r} needs a launcher: run it under torchrun "
                               "(distlab.launch writes the script)")
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.backend = backend_for(cfg.device)
        if self.backend == "nccl":
            torch.cuda.set_device(self.local_rank)
        if not dist.is_initialized():
            dist.init_process_group(self.backend, timeout=datetime.timedelta(seconds=cfg.collective_timeout_s))

    def teardown(self, keep_group: bool = False) -> None:
        if dist.is_initialized() and not keep_group:
            dist.destroy_process_group()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor)
        return tensor

    def barrier(self) -> None:
        dist.barrier()


class CommTimer:
    """A DDP communication hook that all-reduces each gradient bucket synchronously and times it.

    DDP normally launches bucket all-reduces asynchronously and overlaps them with the rest of the
    backward pass; then "communication time" cannot be read off a clock. This hook waits for each
    all-reduce, so comm and compute are serialised and the measured split is exact (the step gets
    a little slower; the DDP chapter shows by how much)."""

    def __init__(self, world_size: int):
        self.world_size, self.seconds, self.bytes = world_size, 0.0, 0

    def hook(self, state, bucket):
        buf = bucket.buffer()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        self.seconds += time.perf_counter() - t0
        self.bytes += buf.numel() * buf.element_size()
        buf.div_(self.world_size)
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut

    def take(self) -> tuple[float, int]:
        out = (self.seconds, self.bytes)
        self.seconds, self.bytes = 0.0, 0
        return out


class DDPStrategy(DistributedStrategy):
    name = "ddp"

    def __init__(self) -> None:
        super().__init__()
        self.comm_timer: CommTimer | None = None
        self.measure_comm = False

    def setup(self, cfg) -> None:
        super().setup(cfg)
        self.measure_comm = cfg.measure_comm

    def wrap_model(self, model: torch.nn.Module, choice: DeviceChoice) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = model.to(choice.device)
        ddp = DDP(model, device_ids=[choice.device.index] if choice.device.type == "cuda" else None)
        if self.measure_comm:
            self.comm_timer = CommTimer(self.world_size)
            ddp.register_comm_hook(None, self.comm_timer.hook)
        return ddp

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.module

    def sync_context(self, model, sync: bool):
        return contextlib.nullcontext() if sync else model.no_sync()

    def comm_stats(self) -> dict[str, float]:
        if self.comm_timer is None:
            return {}
        seconds, nbytes = self.comm_timer.take()
        return {"comm_time_s": seconds, "comm_bytes": nbytes}
