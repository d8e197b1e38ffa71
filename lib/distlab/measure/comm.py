"""Communication time and bytes of a training step, measured from outside the strategies.

Two instruments, attached by distlab.measure.meter when a run sets `measure_comm`:

* `CommTimer`, a DDP communication hook (chapter 02). DDP normally launches each gradient
  bucket's all-reduce asynchronously and overlaps it with the rest of the backward pass; then
  "communication time" cannot be read off a clock. The hook waits for each all-reduce, so comm
  and compute are serialised and the measured split is exact (the step gets a little slower; the
  DDP chapter shows by how much). DDP takes one hook: a compression hook (TrainConfig.ddp_comm_hook,
  chapter 05) runs *inside* the timer, so the time and bytes are those of the compressed traffic.
* `CollectiveTimer` (chapter 03), for FSDP2 and DeepSpeed, which issue their all-gathers and
  reduce-scatters asynchronously and wait for them later. While installed, every collective of
  `torch.distributed` is waited for as soon as it is issued and timed; the work handle returned is
  already complete, so its later wait() is free. Both FSDP2 and DeepSpeed look the collectives up
  on `torch.distributed` at call time, so wrapping them there sees them. `paused()` leaves out the
  training loop's own bookkeeping all-reduces (token counts, loss).
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch
import torch.distributed as dist

from distlab import compat


class CommTimer:
    """A DDP comm hook that all-reduces each gradient bucket synchronously and times it, in two parts.

    First a one-element all-reduce: it returns when the slowest rank has reached this bucket, so its time
    is the *wait* for the other ranks (plus one small-message latency). Then the bucket's own all-reduce,
    which starts with every rank present: its time is the *transfer* a latency-bandwidth model predicts.
    Without the split, a wait for a slower rank reads as a slow network (chapter 02's cost model).

    `inner`, a DDP comm hook `(state, bucket) -> Future` (fp16/bf16 compression, PowerSGD), replaces the
    plain all-reduce: the timer passes its registered state on, waits for the hook's future, and counts the
    payload of every collective the hook issues (the compressed bytes, not the bucket's). The transfer
    time then includes the hook's own compression and decompression: they are the price of its bytes."""

    def __init__(self, world_size: int, inner=None):
        self.world_size = world_size
        self.inner = inner
        self.wait_s, self.transfer_s, self.bytes, self.calls = 0.0, 0.0, 0, 0
        self._flag = torch.zeros(1)

    def hook(self, state, bucket):
        buf = bucket.buffer()
        flag = self._flag if buf.device.type == "cpu" else self._flag.to(buf.device)
        t0 = time.perf_counter()
        dist.all_reduce(flag)
        t1 = time.perf_counter()
        if self.inner is None:
            dist.all_reduce(buf)
            nbytes = buf.numel() * buf.element_size()
        else:
            buf, nbytes = self._run_inner(state, bucket)
        if buf.device.type == "cuda":
            torch.cuda.synchronize(buf.device)
        t2 = time.perf_counter()
        self.wait_s += t1 - t0
        self.transfer_s += t2 - t1
        self.bytes += nbytes
        self.calls += 1
        if self.inner is None:
            buf.div_(self.world_size)  # the compression hooks average themselves
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut

    def _run_inner(self, state, bucket) -> tuple[torch.Tensor, int]:
        """The inner hook's averaged bucket and the bytes its collectives carried. Its collectives are
        waited for as issued (CollectiveTimer), so PowerSGD's chained all-reduces run here, not later."""
        counter = CollectiveTimer().install()
        try:
            result = self.inner(state, bucket).wait()
        finally:
            counter.uninstall()
        return (result[0] if isinstance(result, list) else result), counter.bytes

    def take(self) -> dict[str, float]:
        out = {"comm_time_s": self.wait_s + self.transfer_s, "comm_wait_s": self.wait_s,
               "comm_transfer_s": self.transfer_s, "comm_calls": self.calls, "comm_bytes": self.bytes}
        self.wait_s, self.transfer_s, self.bytes, self.calls = 0.0, 0.0, 0, 0
        return out


class CollectiveTimer:
    """Times every torch.distributed collective of this process (see the module docstring)."""

    def __init__(self) -> None:
        self.seconds, self.bytes, self.calls = 0.0, 0, 0
        self._originals: dict[str, object] = {}
        self._paused = 0

    def install(self) -> CollectiveTimer:
        for name in compat.collective_names():
            if name in self._originals or not hasattr(dist, name):  # a legacy name a release dropped
                continue
            self._originals[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(self._originals[name]))
        return self

    def uninstall(self) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _wrap(self, fn):
        timer = self

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if timer._paused:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            work = fn(*args, **kwargs)
            if work is not None and hasattr(work, "wait"):
                work.wait()
            timer.seconds += time.perf_counter() - t0
            timer.calls += 1
            timer.bytes += payload_bytes(args, kwargs)
            return work

        return timed

    def take(self) -> dict[str, float]:
        out = {"comm_time_s": self.seconds, "comm_bytes": self.bytes}
        self.seconds, self.bytes, self.calls = 0.0, 0, 0
        return out


def payload_bytes(args, kwargs) -> int:
    """Bytes of the largest tensor argument (the buffer a collective fills or reads)."""
    best = 0

    def visit(x):
        nonlocal best
        if torch.is_tensor(x):
            best = max(best, x.numel() * x.element_size())
        elif isinstance(x, (list, tuple)):
            for y in x:
                visit(y)

    for a in list(args) + list(kwargs.values()):
        visit(a)
    return best
