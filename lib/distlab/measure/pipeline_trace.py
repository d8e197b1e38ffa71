"""The timeline of a pipeline step, recorded from outside both pipeline strategies (chapter 04).

With `measure_comm`, distlab.measure.meter attaches one of these to the pipeline a strategy built:

* Compute: each micro-batch's forward and backward on each stage is stamped with start and end
  on a clock common to all ranks (perf_counter plus a per-rank offset measured at start with
  barrier-aligned readings; on one machine the offset is ~0). torch: the PipelineStage's
  per-chunk methods are wrapped on the instance; DeepSpeed: this engine's copy of its
  instruction table has ForwardPass/BackwardPass wrapped (the k-th ForwardPass of a step is
  micro-batch k).
* Communication: torch's schedules issue and wait for every stage-to-stage send and receive
  through two module-level helpers, wrapped for the duration of each step; each op gets its
  post time and the time its wait returned. Matching sends and receives in order gives each
  message's transfer time (receive done - both sides posted), `comm_time_s`; `p2p_blocked_s` is
  the time spent blocked in receives, waiting for the peer included (that part is the bubble).
  DeepSpeed's sends and receives are blocking, so each Send/Recv instruction spans the transfer.
* Page faults: each compute event also counts the process's minor page faults during it (memory
  the allocator got from the kernel and touched for the first time: on CPU, that time is in the box).
* Activation memory: tensors autograd saves during each stage forward are counted through
  saved-tensor hooks (parameters excluded, each storage once) and released when the backward
  frees them: the peak bytes held for backward per stage. GPipe holds m micro-batches, 1F1B at
  most p. With activation checkpointing the checkpointed layers keep only their inputs, which
  torch's checkpoint holds outside these hooks, so the number then under-counts.

After each step every rank's events are all-gathered and distlab.measure.bubble turns them into
per-stage idle fractions, the bubble and the Gantt chart; rank 0 appends the step to
`<output_dir>/pipeline_timeline.jsonl`. On GPUs every stamp is taken after a device synchronize,
so measured runs are slightly slower.
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distlab import compat
from distlab.device import peak_memory_bytes
from distlab.jsonio import strict_json
from distlab.measure.bubble import step_summary


class ActivationMeter:
    """Bytes of distinct non-parameter tensors autograd holds for backward, and their peak."""

    def __init__(self, module: torch.nn.Module):
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.refs: dict[int, list[int]] = {}
        self.live = 0
        self.peak = 0

    def pack(self, t):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return t
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.param_ptrs or ptr == 0:
            return t
        entry = self.refs.get(ptr)
        if entry is None:
            nbytes = t.untyped_storage().nbytes()
            self.refs[ptr] = [1, nbytes]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        else:
            entry[0] += 1
        return _Saved(self, ptr, t)

    @staticmethod
    def unpack(h):
        return h.tensor if isinstance(h, _Saved) else h

    def release(self, ptr: int) -> None:
        entry = self.refs.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[ptr]

    def take_peak(self) -> int:
        peak, self.peak = self.peak, self.live
        return peak

    def saving(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Saved:
    __slots__ = ("meter", "ptr", "tensor")

    def __init__(self, meter: ActivationMeter, ptr: int, tensor: torch.Tensor):
        self.meter, self.ptr, self.tensor = meter, ptr, tensor

    def __del__(self):
        self.meter.release(self.ptr)


def clock_offset(device: torch.device, rounds: int = 7) -> float:
    """Seconds to add to this rank's perf_counter to read rank 0's clock (median of barrier-aligned
    readings; ~0 between processes of one machine, whose monotonic clocks are the same)."""
    world = dist.get_world_size()
    samples = []
    for _ in range(rounds):
        dist.barrier()
        mine = torch.tensor([time.perf_counter()], dtype=torch.float64, device=device)
        every = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        samples.append(float(every[0]) - float(mine))
    return statistics.median(samples)


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(t) for t in obj)
    return 0


class PipelineTrace:
    """This rank's events of the current step, and the gathering of every rank's after it."""

    def __init__(self, strategy, activations_of: torch.nn.Module):
        self.strategy = strategy
        self.stage = strategy.stage_index
        self.device = strategy.choice.device
        self.offset = clock_offset(self.device)
        self.activations = ActivationMeter(activations_of)
        self.events: list[dict] = []
        self.chunks = {"F": 0, "B": 0}  # micro-batches started this step, for engines that do not say
        self.step = 0
        self.timeline = Path(strategy.cfg.output_dir) / "pipeline_timeline.jsonl"
        if strategy.is_main:
            self.timeline.parent.mkdir(parents=True, exist_ok=True)
            self.timeline.write_text("")

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() + self.offset

    def timed_compute(self, kind: str, fn, chunk_of, model_chunk: int = 0):
        """`fn` wrapped to record one compute event; `chunk_of(args, kwargs)` names the micro-batch,
        `model_chunk` which of the rank's model chunks runs it (0 unless interleaved)."""
        def run(*args, **kwargs):
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = self.now()
            with self.activations.saving() if kind == "F" else contextlib.nullcontext():
                out = fn(*args, **kwargs)
            t1 = self.now()
            self.events.append({"stage": self.stage, "kind": kind, "mb": chunk_of(args, kwargs), "chunk": model_chunk,
                                "t0": t0, "t1": t1,
                                "page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults})
            return out
        return run

    def take(self) -> dict[str, Any]:
        """Every rank's events of the step just finished, summarised (collective: all ranks call it)."""
        s = self.strategy
        self.step += 1
        mine = {"events": self.events, "peak_mem": peak_memory_bytes(self.device),
                "act_peak": self.activations.take_peak()}
        self.events, self.chunks = [], {"F": 0, "B": 0}
        every: list[Any] = [None] * s.world_size
        dist.all_gather_object(every, mine)
        events = [e for r in every for e in r["events"]]
        summary = step_summary(events)
        if s.is_main:
            with open(self.timeline, "a") as fh:
                fh.write(strict_json({"step": self.step, "schedule": s.schedule_used, "stages": s.num_stages,
                                      "virtual": s.virtual, "microbatches": s.microbatches,
                                      "events": events}) + "\n")
        return {
            "comm_time_s": summary["comm_time_s"], "comm_bytes": summary["comm_bytes"],
            "p2p_blocked_s": summary["p2p_blocked_s"], "bubble_fraction": summary["bubble_fraction"],
            "stage_idle": summary["stage_idle"], "stage_busy_s": summary["stage_busy_s"],
            "pipeline_span_s": summary["pipeline_span_s"], "pipeline_schedule": s.schedule_used,
            "pipeline_stages": s.num_stages, "microbatches": s.microbatches,
            "stage_peak_mem_bytes": [r["peak_mem"] for r in every],
            "stage_activation_peak_bytes": [r["act_peak"] for r in every],
        }


def trace_torch_pipeline(strategy, pp_stages, schedule) -> PipelineTrace:
    """Time-stamp this rank's torch.distributed.pipelining stages (one per model chunk: events carry
    the chunk's place on the rank, 0 ... v-1) and the schedule's sends and receives."""
    trace = PipelineTrace(strategy, strategy.stage_module)
    for chunk, pp_stage in enumerate(pp_stages):
        compat.wrap_stage_chunks(
            pp_stage,
            lambda fn, c=chunk: trace.timed_compute("F", fn, lambda a, kw: a[0] if a else kw["fwd_chunk_id"], c),
            lambda fn, c=chunk: trace.timed_compute("B", fn, lambda a, kw: a[0] if a else kw["bwd_chunk_id"], c))
    me, step = trace.stage, schedule.step
    what = "p2p" if len(pp_stages) > 1 else ""
    pending: dict[int, tuple[Any, list[dict]]] = {}

    def wrap_batch(batch_p2p):
        def timed(p2p_ops, desc=None):
            t0 = trace.now()
            works = batch_p2p(p2p_ops, desc)
            evs = []
            for op in p2p_ops:
                kind = "send" if op.op is dist.isend else "recv"
                # one stage per rank: the peer rank is its stage; interleaved, both kinds go both ways
                act = (kind == "send") == (op.peer > me)
                evs.append({"stage": me, "kind": kind, "peer": op.peer, "what": what or ("act" if act else "grad"),
                            "t0": t0, "t1": t0, "bytes": op.tensor.numel() * op.tensor.element_size()})
            pending[id(works)] = (works, evs)
            return works
        return timed

    def wrap_wait(wait_batch_p2p):
        def timed(work):
            tw = trace.now()  # interleaved schedules post receives early and wait later: blocked from here
            wait_batch_p2p(work)
            entry = pending.pop(id(work), None)
            if entry is not None:
                t1 = trace.now()
                for ev in entry[1]:
                    ev["t1"], ev["tw"] = t1, tw
                trace.events.extend(entry[1])
        return timed

    def timed_step(*args, **kwargs):
        with compat.patched_pipeline_p2p(wrap_batch, wrap_wait):
            try:
                return step(*args, **kwargs)
            finally:
                for _, evs in pending.values():  # never waited on: keep them, with no duration
                    trace.events.extend(evs)
                pending.clear()

    schedule.step = timed_step
    return trace


def trace_deepspeed_pipeline(strategy, engine, instructions) -> PipelineTrace:
    """Time-stamp a DeepSpeed PipelineEngine's compute and send/receive instructions, in the
    engine's own instruction table (`instructions`, an instruction class -> method mapping that
    the strategy installs on the engine)."""
    from deepspeed.runtime.pipe import schedule as S  # deferred: DeepSpeed is optional

    trace = PipelineTrace(strategy, engine.module)
    me = trace.stage

    def compute(kind):
        def next_chunk(args, kwargs):
            trace.chunks[kind] += 1
            return trace.chunks[kind] - 1
        return trace.timed_compute(kind, instructions[S.ForwardPass if kind == "F" else S.BackwardPass], next_chunk)

    def comm(kind, what, peer, fn, size_before=None, size_after=None):
        def run(eng, **kw):
            nbytes = size_before(eng, kw["buffer_id"]) if size_before else 0
            t0 = trace.now()
            fn(eng, **kw)
            t1 = trace.now()
            if size_after:
                nbytes = size_after(eng, kw["buffer_id"])
            trace.events.append({"stage": me, "kind": kind, "peer": peer, "what": what, "t0": t0, "t1": t1,
                                 "bytes": nbytes})
        return run

    def grads_of_inputs(eng, b):
        inputs = compat.pipe_buffer(eng, "inputs", b)
        inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        return sum(_nbytes(t.grad) for t in inputs if isinstance(t, torch.Tensor) and t.grad is not None)

    instructions[S.ForwardPass] = compute("F")
    instructions[S.BackwardPass] = compute("B")
    instructions[S.SendActivation] = comm("send", "act", me + 1, instructions[S.SendActivation],
                                          size_before=lambda e, b: _nbytes(compat.pipe_buffer(e, "outputs", b)))
    instructions[S.RecvActivation] = comm("recv", "act", me - 1, instructions[S.RecvActivation],
                                          size_after=lambda e, b: _nbytes(compat.pipe_buffer(e, "inputs", b)))
    instructions[S.SendGrad] = comm("send", "grad", me - 1, instructions[S.SendGrad], size_before=grads_of_inputs)
    instructions[S.RecvGrad] = comm("recv", "grad", me + 1, instructions[S.RecvGrad],
                                    size_after=lambda e, b: _nbytes(compat.received_grad(e)))
    return trace
