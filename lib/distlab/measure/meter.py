"""The one meter the training loop reads, and the hooks through which strategies let it in.

    meter = Meter.for_config(cfg)      # NULL_METER when the run measures nothing
    strategy.meter = meter
    ... every step:  stats = meter.take_step()      (after the step's clock has stopped)
    ... at the end:  meter.measured_state, meter.close()

Each strategy calls one `watch_*` hook where its communication happens, and `state_point` where
gradients and optimizer state both exist; the measuring code lives in this package:

  watch_ddp            DDP's gradient all-reduces, through a comm hook        (measure.comm);
                       it also registers the run's compression hook, timed or not
  watch_collectives    every torch.distributed collective (FSDP2, ZeRO)       (measure.comm)
  watch_torch_pipeline / watch_deepspeed_pipeline   the pipeline timeline     (measure.pipeline_trace)
  state_point          bytes of weights, gradients, optimizer state           (measure.state)
"""

from __future__ import annotations

import contextlib
from typing import Any

from distlab.measure.comm import CollectiveTimer, CommTimer
from distlab.measure.state import measure_state


class Meter:
    def __init__(self, comm: bool = False, state: bool = False):
        self.comm, self.state = comm, state
        self._sources: list[Any] = []  # objects with take() -> dict, read after every step
        self._collectives = None
        self.measured_state = None  # distlab.measure.state.MemoryBreakdown of the latest state_point

    @classmethod
    def for_config(cls, cfg) -> Meter:
        if not (cfg.measure_comm or cfg.measure_state):
            return NULL_METER
        return cls(comm=cfg.measure_comm, state=cfg.measure_state)

    # --- hooks strategies call
    def watch_ddp(self, ddp_model, world_size: int, comm_hook: tuple[Any, Any] | None = None) -> None:
        """Register DDP's one comm hook: `comm_hook` ((state, hook), e.g. fp16 compression) inside the timer
        when measuring, alone when not; with neither, DDP keeps its own all-reduce."""
        if self.comm:
            state, inner = comm_hook or (None, None)
            timer = CommTimer(world_size, inner)
            ddp_model.register_comm_hook(state, timer.hook)
            self._sources.append(timer)
        elif comm_hook is not None:
            ddp_model.register_comm_hook(*comm_hook)

    def watch_collectives(self) -> None:
        """Before DeepSpeed's comm backend starts: it keeps references to the collectives."""
        if self.comm and self._collectives is None:
            self._collectives = CollectiveTimer().install()
            self._sources.append(self._collectives)

    def watch_torch_pipeline(self, strategy, pp_stages, schedule) -> None:
        if self.comm:
            # deferred: the trace's analysis loads pandas, which every rank would otherwise carry in its measured RSS
            from distlab.measure.pipeline_trace import trace_torch_pipeline

            self._sources.append(trace_torch_pipeline(strategy, pp_stages, schedule))

    def watch_deepspeed_pipeline(self, strategy, engine, instructions: dict) -> None:
        if self.comm:
            # deferred: as in watch_torch_pipeline (pandas kept out of runs that record no timeline)
            from distlab.measure.pipeline_trace import trace_deepspeed_pipeline

            self._sources.append(trace_deepspeed_pipeline(strategy, engine, instructions))

    def state_point(self, model, optimizer) -> None:
        if self.state:
            self.measured_state = measure_state(model, optimizer)

    def paused(self):
        """Collectives inside this context are not the strategy's traffic (the loop's bookkeeping)."""
        return self._collectives.paused() if self._collectives is not None else contextlib.nullcontext()

    # --- what the loop reads
    def take_step(self) -> dict[str, Any]:
        stats: dict[str, Any] = {}
        for source in self._sources:
            stats.update(source.take())
        return stats

    def close(self) -> None:
        if self._collectives is not None:
            self._collectives.uninstall()
            self._collectives = None
        self._sources.clear()


NULL_METER = Meter()  # measures nothing; its hooks return at once
