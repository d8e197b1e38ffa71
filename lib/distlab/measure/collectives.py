"""Counting the collectives of a piece of code, with their bytes, including those DTensor issues (chapter 07).

`distlab.measure.comm.CollectiveTimer` wraps the `torch.distributed` functions, which FSDP2 and DeepSpeed
call; DTensor's tensor-parallel layers never do: they issue functional collectives
(`torch.ops._c10d_functional`) from inside the dispatcher. A torch dispatch mode sees both kinds, forward
and backward, as ops:

    with CollectiveCounter() as forward:
        out = layer(x)
    forward.calls  # [("all_reduce", 131072), ...]: op name, payload bytes

Bytes are the payload (the tensor reduced or gathered), not what a ring sends: 2(k-1)/k of it per rank for
an all-reduce. This module is imported only where it counts (chapter 07, its tests), not by the training
loop: its base class is a torch internal (through distlab.compat).
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor

from distlab import compat
from distlab.measure.comm import payload_bytes

NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


class CollectiveCounter(compat.torch_dispatch_mode()):
    """Every collective op dispatched while active, as (op name, payload bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor turn the op into local ops and collectives first
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        # leave out the namespaces' bookkeeping ops: waits, and DTensor's autograd wrapping of a result
        if func.namespace in NAMESPACES and "wait" not in name and not name.startswith("_"):
            self.calls.append((name.rstrip("_").replace("allreduce", "all_reduce"), payload_bytes(args, kwargs or {})))
        return out

    @property
    def bytes(self) -> int:
        return sum(b for _, b in self.calls)


# Passes of a ring per collective (distlab.planning.wire_bytes counts the same way): an all-reduce is a
# reduce-scatter then an all-gather.
RING_PASSES = {"all_reduce": 2, "all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}


def sent_per_rank(calls, world_size: int) -> float:
    """Bytes one rank sends on a ring for counted `calls` ((op, payload) pairs): (k-1)/k of the whole buffer
    per pass. The payload of an all-gather is this rank's shard (its input), so the buffer is k times it."""
    k = world_size
    total = 0.0
    for op, payload in calls:
        whole = payload * k if op.startswith("all_gather") else payload
        total += RING_PASSES[op] * (k - 1) / k * whole
    return total
