"""Pipeline parallelism with torch.distributed.pipelining: the model split by decoder layers.

The stages (distlab.strategies.split) are built by hand from any Llama/Qwen2-style transformers
model and wrapped in real `torch.distributed.pipelining.PipelineStage`s: the `pipeline()` tracer
does not handle HF Qwen2 models on torch 2.13. Layers not on a rank are replaced by placeholders
right after loading, so a rank keeps only its own weights. What every pipeline rank does besides
running its schedule (clipping across stages, evaluation, saving) is in distlab.strategies.staged.

Micro-batches. The training loop hands over `grad_accum` micro-batches of `micro_batch_size` rows
per optimizer step; they become the schedule's m = grad_accum pipeline micro-batches (the loop's
data-parallel size is 1: every stage sees the same rows). All micro-batches are padded to
`seq_len` (the stages' receive buffers have one fixed shape); padding carries no labels, so the
loss is unchanged. Schedules: `ScheduleGPipe` (all forwards, then all backwards) and
`Schedule1F1B` (one forward, one backward in steady state: at most p micro-batches in flight).
torch requires m >= p for 1F1B; with fewer micro-batches 1F1B is the same order of work as GPipe,
so that case runs ScheduleGPipe and the step log says so. "interleaved" runs
`ScheduleInterleaved1F1B` with VIRTUAL = 2 model chunks per rank (the model cut into 2p virtual
stages, rank r holding r and r + p: distlab.strategies.staged): each chunk is its own PipelineStage,
a micro-batch crosses the ranks twice, and the bubble shrinks to (p-1)/(2m+p-1). torch needs m to
be a multiple of its rounds, max(1, m // p).

Loss. The schedule's loss_fn multiplies the last stage's summed loss by 1 / (label tokens of the
whole step) and the schedule runs with scale_grads=False: the gradients are single-device
training's on the same global batch. The step's loss is broadcast from the last stage to every rank.

Measurement (`measure_comm`): the meter time-stamps the stage's forwards, backwards, sends and
receives (distlab.measure.pipeline_trace); nothing here knows about it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from distlab.device import DeviceChoice, autocast
from distlab.layer_split import describe_split
from distlab.strategies.split import is_tied, stack_microbatches
from distlab.strategies.staged import StagedStrategy

SCHEDULES = ("gpipe", "1f1b", "interleaved")
VIRTUAL = 2  # model chunks per rank under the interleaved schedule


class PipelineStrategy(StagedStrategy):
    name = "pipeline"

    def __init__(self) -> None:
        super().__init__()
        self.schedule = None

    def setup(self, cfg) -> None:
        if cfg.pipeline_schedule not in SCHEDULES:
            raise ValueError(f"pipeline_schedule={cfg.pipeline_schedule!r}: expected one of {', '.join(SCHEDULES)}")
        super().setup(cfg)
        self.virtual = VIRTUAL if cfg.pipeline_schedule == "interleaved" else 1

    def keep_stage(self, model, choice: DeviceChoice, cfg):
        tied = is_tied(model.causal_lm)  # read before the other stages' parts are dropped
        wrapped = self.place_stage(model, choice, cfg)
        if tied and not cfg.lora:  # the tied embedding/head weight, trained on both end stages
            ends = sorted({0, self.num_stages - 1})
            self.tie_group = dist.new_group(ends) if self.num_stages > 2 else dist.group.WORLD
            if self.is_first:
                self.tied_param = self.chunks[0].embed.weight
            elif self.is_last:
                self.tied_param = self.chunks[-1].head.weight
        return wrapped

    def wrap(self, model, optimizer, scheduler, choice: DeviceChoice, cfg):
        self.build_schedule(cfg.pipeline_schedule, cfg.micro_steps(1))
        if self.is_main:
            print(f"[distlab] pipeline {self.schedule_used} with {self.microbatches} micro-batch(es) of "
                  f"{cfg.micro_batch_size} row(s); " + "; ".join(describe_split(model.ranges)), flush=True)
        return model, optimizer, scheduler

    def build_schedule(self, schedule: str, microbatches: int) -> None:
        """This rank's PipelineStage(s), one per model chunk, and schedule for m micro-batches per step."""
        self.microbatches = microbatches
        self.schedule_used = schedule
        if schedule == "1f1b" and microbatches < self.num_stages:
            self.schedule_used = "gpipe"  # torch needs m >= p for 1F1B; with fewer it is GPipe's order anyway
        total = self.num_stages * self.virtual
        stages = [PipelineStage(chunk, vs, total, self.choice.device)
                  for vs, chunk in zip(self.chunk_stages, self.chunks)]
        if schedule == "interleaved":
            self.schedule = ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=self._loss_fn,
                                                    scale_grads=False)
        else:
            cls = Schedule1F1B if self.schedule_used == "1f1b" else ScheduleGPipe
            self.schedule = cls(stages[0], n_microbatches=microbatches, loss_fn=self._loss_fn, scale_grads=False)
        self.meter.watch_torch_pipeline(self, stages, self.schedule)  # the timeline, sends and receives

    def _loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # The last stage already returns the summed loss; the target is unused (the schedule wants one).
        return output * self.loss_scale

    # --- one step
    def forward_backward(self, model, micro_batches, choice: DeviceChoice, global_label_tokens: int) -> float:
        if len(micro_batches) != self.microbatches:
            raise ValueError(f"{len(micro_batches)} micro-batches for a schedule built for {self.microbatches}")
        self.loss_scale = 1.0 / global_label_tokens  # data-parallel size 1
        batch = stack_microbatches(micro_batches, self.cfg.seq_len, choice.device)
        args, kwargs = self.stage_inputs(batch)
        losses: list[torch.Tensor] | None = [] if self.is_last else None
        target = batch["labels"] if self.is_last else None
        with autocast(choice):
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        local = torch.tensor([sum(float(x.detach()) for x in losses) if losses else 0.0], dtype=torch.float64,
                             device=choice.device)
        dist.broadcast(local, src=self.num_stages - 1)
        return float(local)

    def optimizer_step(self, model, optimizer, scheduler, max_grad_norm: float) -> float:
        params = [p for p in self.stage_module.parameters() if p.requires_grad]
        if self.tie_group is not None and self.tied_param is not None and self.tied_param.grad is not None:
            dist.all_reduce(self.tied_param.grad, group=self.tie_group)
        norm = self.clip_across_stages(params, max_grad_norm)
        optimizer.step()
        self.meter.state_point(self.stage_module, optimizer)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return norm
