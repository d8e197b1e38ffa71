"""Pipeline parallelism with torch.distributed.pipelining: the model split by decoder layers.

Stages. Rank k holds stage k: a contiguous run of decoder layers, plus the token embeddings on the
first stage and the final norm, LM head and loss on the last. Every stage computes the rotary
embeddings and the attention mask itself from the position ids (and the padding mask, when there
is one), which travel with every micro-batch; only the hidden states cross stage boundaries. The
stages are built by hand from any Llama/Qwen2-style transformers model (embed_tokens, layers,
norm, rotary_emb, an output-embedding head), also under a PEFT LoRA wrapper, and wrapped in real
`torch.distributed.pipelining.PipelineStage`s: the `pipeline()` tracer does not handle HF Qwen2
models on torch 2.13. Layers not on a rank are replaced by placeholders right after loading, so
a rank keeps only its own weights (the full model is read once at start, as from_pretrained does).

The split (`split_layers`): balanced by layer count by default (the extra layers of an uneven
division go to the earlier stages, since the last stage also carries the LM head), or an explicit
list `stage_layers` of layer counts per stage.

Micro-batches. The training loop hands over `grad_accum` micro-batches of `micro_batch_size` rows
per optimizer step; they become the schedule's m = grad_accum pipeline micro-batches (the loop's
data-parallel size is 1: every stage sees the same rows). All micro-batches are padded to
`seq_len` (the stages' receive buffers have one fixed shape); padding carries no labels, so the
loss is unchanged. Schedules: `ScheduleGPipe` (all forwards, then all backwards) and
`Schedule1F1B` (one forward, one backward in steady state: at most p micro-batches in flight).
torch requires m >= p for 1F1B; with fewer micro-batches 1F1B is the same order of work as GPipe,
so that case runs ScheduleGPipe and the step log says so.

Loss. The last stage returns the summed next-token loss of its micro-batch (label positions only,
as distlab.models.CausalLMWithLoss); the schedule's loss_fn multiplies it by 1 / (label tokens of
the whole step), and the schedule runs with scale_grads=False, so the gradients are exactly those
of single-device training on the same global batch. The step's loss is broadcast from the last
stage to every rank. Gradient clipping uses the global norm: squared norms all-reduced over the
stages. A tied input/output embedding (tiny Qwen2, many small models) lives on the first and the
last stage; under full fine-tuning its two gradients are summed between those stages before the
step, so both copies stay identical (as Megatron's embedding group does).

Measurement (`measure_comm=True`):
* Timeline: every PipelineStage forward_one_chunk / backward_one_chunk is wrapped (a subclass,
  `TimedPipelineStage`) and stamped with start/end on a clock common to all ranks (perf_counter
  plus a per-rank offset measured at start with barrier-aligned readings; on one machine the
  offset is ~0). After each step the events are all-gathered and distlab.pipeline_bubble turns
  them into per-stage idle fractions, the bubble, and the Gantt chart.
* Communication: during the schedule's step, the two module-level helpers through which the
  torch schedules issue and wait for every stage-to-stage send and receive
  (`torch.distributed.pipelining.schedules._batch_p2p` and `_wait_batch_p2p`) are wrapped for the
  duration of the step (restored afterwards). Each P2P op gets its post time and the time its
  wait returned; matching sends and receives in order gives each message's transfer time (receive
  done - both sides posted), which is `comm_time_s`; `p2p_blocked_s` is the total time spent
  blocked in receives, waiting for the peer included (that part is the bubble). These helpers
  are private to torch: if a torch release renames them, the wrapping is skipped and comm time
  is reported as missing (never invented).
* Activation memory: tensors autograd saves during each stage forward are counted through
  saved-tensor hooks (parameters excluded, each storage once) and released when the backward
  frees them, giving the peak bytes held for backward per stage: GPipe holds m micro-batches,
  1F1B at most p. With activation checkpointing the checkpointed layers keep only their inputs,
  which torch's checkpoint holds outside these hooks, so the number then under-counts.
On GPUs every stamp is taken after a device synchronize, so measured runs are slightly slower.
"""

from __future__ import annotations

import contextlib
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..data import IGNORE_INDEX
from ..device import DeviceChoice, autocast, peak_memory_bytes
from .ddp import DistributedStrategy
from .single import cosine_with_warmup

SCHEDULES = ("gpipe", "1f1b")


# --------------------------------------------------------------------------- the split

def split_layers(num_layers: int, num_stages: int, stage_layers: list[int] | None = None) -> list[range]:
    """Decoder-layer indices of each stage: balanced by count, or `stage_layers` counts per stage."""
    if num_stages < 1:
        raise ValueError(f"pipeline_stages={num_stages}: need at least 1 stage")
    if stage_layers is not None:
        counts = [int(c) for c in stage_layers]
        if len(counts) != num_stages:
            raise ValueError(f"stage_layers={stage_layers} has {len(counts)} entries for {num_stages} stages")
        if any(c < 0 for c in counts) or sum(counts) != num_layers:
            raise ValueError(f"stage_layers={stage_layers} must be non-negative and sum to the model's "
                             f"{num_layers} decoder layers")
    else:
        if num_layers < num_stages:
            raise ValueError(f"{num_layers} decoder layers cannot fill {num_stages} stages")
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


class NotOnThisStage(nn.Module):
    """Stands in for a part of the model that lives on another stage (keeps the module names)."""

    def __init__(self, what: str, stage: int):
        super().__init__()
        self.what, self.stage = what, stage

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.what} is not on this rank (pipeline stage {self.stage})")

    def extra_repr(self) -> str:
        return f"{self.what} lives on another stage"


def _decoder_parts(causal) -> tuple[Any, Any]:
    decoder = causal.get_decoder()
    for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(decoder, attr):
            raise TypeError(f"{type(causal).__name__}: its decoder has no `{attr}`; the pipeline split "
                            "supports Llama/Qwen2-style models (embed_tokens, layers, norm, rotary_emb)")
    return decoder, causal.get_output_embeddings()


def is_tied(causal) -> bool:
    decoder, head = _decoder_parts(causal)
    return head is not None and head.weight is decoder.embed_tokens.weight


class StageModule(nn.Module):
    """One pipeline stage of a causal LM: [embeddings] -> layers[i:j] -> [norm, head, summed loss].

    forward(x, position_ids, attention_mask=None, labels=None): x is token ids on the first stage,
    the previous stage's hidden states elsewhere. Non-last stages return hidden states; the last
    returns the summed cross entropy over label positions (a 0-dim fp32 tensor)."""

    def __init__(self, causal, layer_ids: range, first: bool, last: bool):
        super().__init__()
        decoder, head = _decoder_parts(causal)
        self.config = causal.config
        self.layer_ids = list(layer_ids)
        self.first, self.last = first, last
        self.embed = decoder.embed_tokens if first else None
        self.layers = nn.ModuleList([decoder.layers[i] for i in self.layer_ids])
        self.rotary = decoder.rotary_emb
        self.norm = decoder.norm if last else None
        self.head = head if last else None
        types = getattr(self.config, "layer_types", None)
        self.layer_types = [types[i] if types else "full_attention" for i in self.layer_ids]

    def _masks(self, hidden, attention_mask, position_ids) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        args = dict(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
                    past_key_values=None, position_ids=position_ids)
        masks = {}
        for kind in set(self.layer_types):
            masks[kind] = (create_sliding_window_causal_mask(**args) if kind == "sliding_attention"
                           else create_causal_mask(**args))
        return masks

    def forward(self, x, position_ids=None, attention_mask=None, labels=None):
        hidden = self.embed(x) if self.first else x
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0).expand(hidden.shape[0], -1)
        masks = self._masks(hidden, attention_mask, position_ids)
        position_embeddings = self.rotary(hidden, position_ids)
        for layer, kind in zip(self.layers, self.layer_types):
            out = layer(hidden, attention_mask=masks[kind], position_embeddings=position_embeddings,
                        position_ids=position_ids, past_key_values=None, use_cache=False)
            hidden = out[0] if isinstance(out, tuple) else out
        if not self.last:
            return hidden
        hidden = self.norm(hidden)
        targets = labels[:, 1:]
        keep = targets != IGNORE_INDEX
        logits = self.head(hidden[:, :-1][keep])
        return F.cross_entropy(logits.float(), targets[keep], reduction="sum")


def drop_other_stages(causal, layer_ids: range, first: bool, last: bool, stage: int) -> None:
    """Replace everything this stage does not run by placeholders, so its memory is released."""
    decoder, _ = _decoder_parts(causal)
    keep = set(layer_ids)
    for i in range(len(decoder.layers)):
        if i not in keep:
            decoder.layers[i] = NotOnThisStage(f"decoder layer {i}", stage)
    if not first:
        decoder.embed_tokens = NotOnThisStage("the token embedding", stage)
    if not last:
        decoder.norm = NotOnThisStage("the final norm", stage)
        causal.set_output_embeddings(NotOnThisStage("the LM head", stage))


class PipelinedModel(nn.Module):
    """What the training loop holds on a pipeline rank: the (partial) model and this rank's stage."""

    def __init__(self, full: nn.Module, stage: StageModule, stage_index: int, ranges: list[range]):
        super().__init__()
        self.full = full  # distlab.models.CausalLMWithLoss with other stages' parts as placeholders
        self.stage = stage
        self.stage_index = stage_index
        self.ranges = ranges

    @property
    def lm(self):
        return self.full.lm

    @property
    def causal_lm(self):
        return self.full.causal_lm

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline stage runs through its schedule (PipelineStrategy.forward_backward)")


# --------------------------------------------------------------------------- measurement

class _ActivationMeter:
    """Bytes of distinct non-parameter tensors autograd holds for backward, and their peak."""

    def __init__(self, module: nn.Module):
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


class _Saved:
    __slots__ = ("meter", "ptr", "tensor")

    def __init__(self, meter: _ActivationMeter, ptr: int, tensor: torch.Tensor):
        self.meter, self.ptr, self.tensor = meter, ptr, tensor

    def __del__(self):
        self.meter.release(self.ptr)


class Recorder:
    """Per-rank event list on the common clock (see the module docstring)."""

    def __init__(self, stage: int, offset: float, device: torch.device, enabled: bool):
        self.stage, self.offset, self.device, self.enabled = stage, offset, device, enabled
        self.events: list[dict] = []
        self.meter: _ActivationMeter | None = None

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() + self.offset

    def take(self) -> list[dict]:
        out, self.events = self.events, []
        return out

    def saving(self):
        if self.meter is None:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self.meter.pack, self.meter.unpack)


def _timed_stage_class():
    from torch.distributed.pipelining import PipelineStage

    class TimedPipelineStage(PipelineStage):
        """A PipelineStage whose forward and backward of each micro-batch are time-stamped."""

        recorder: Recorder | None = None

        def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
            rec = self.recorder
            if rec is None or not rec.enabled:
                return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
            t0 = rec.now()
            with rec.saving():
                out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
            rec.events.append({"stage": self.stage_index, "kind": "F", "mb": fwd_chunk_id, "t0": t0, "t1": rec.now()})
            return out

        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            rec = self.recorder
            if rec is None or not rec.enabled:
                return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
            t0 = rec.now()
            out = super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
            rec.events.append({"stage": self.stage_index, "kind": "B", "mb": bwd_chunk_id, "t0": t0, "t1": rec.now()})
            return out

    return TimedPipelineStage


@contextlib.contextmanager
def timed_p2p(recorder: Recorder, rank_to_stage: dict[int, int]):
    """Wrap the schedules' P2P helpers for one step (see the module docstring); restore after."""
    from torch.distributed.pipelining import schedules

    orig_batch = getattr(schedules, "_batch_p2p", None)
    orig_wait = getattr(schedules, "_wait_batch_p2p", None)
    if not recorder.enabled or orig_batch is None or orig_wait is None:
        yield False
        return
    pending: dict[int, tuple[Any, list[dict]]] = {}
    me = recorder.stage

    def batch_p2p(p2p_ops, desc=None):
        t0 = recorder.now()
        works = orig_batch(p2p_ops, desc)
        evs = []
        for op in p2p_ops:
            kind = "send" if op.op is dist.isend else "recv"
            peer = rank_to_stage.get(op.peer, op.peer)
            act = (kind == "send") == (peer > me)
            evs.append({"stage": me, "kind": kind, "peer": peer, "what": "act" if act else "grad", "t0": t0,
                        "t1": t0, "bytes": op.tensor.numel() * op.tensor.element_size()})
        pending[id(works)] = (works, evs)
        return works

    def wait_batch_p2p(work):
        orig_wait(work)
        entry = pending.pop(id(work), None)
        if entry is not None:
            t1 = recorder.now()
            for ev in entry[1]:
                ev["t1"] = t1
            recorder.events.extend(entry[1])

    schedules._batch_p2p, schedules._wait_batch_p2p = batch_p2p, wait_batch_p2p
    try:
        yield True
    finally:
        schedules._batch_p2p, schedules._wait_batch_p2p = orig_batch, orig_wait
        for _, evs in pending.values():  # never waited on: keep them, with no duration
            recorder.events.extend(evs)


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


# --------------------------------------------------------------------------- padded micro-batches

def stack_microbatches(micro_batches: list[dict[str, Any]], seq_len: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Concatenate micro-batches row-wise, every row padded to seq_len, position ids always given."""
    out: dict[str, list[torch.Tensor]] = {"input_ids": [], "labels": [], "position_ids": [], "attention_mask": []}
    has_mask = "attention_mask" in micro_batches[0]
    for b in micro_batches:
        ids = b["input_ids"]
        rows, width = ids.shape
        if width > seq_len:
            raise ValueError(f"a micro-batch is {width} tokens wide, more than seq_len={seq_len}")
        pad = seq_len - width
        out["input_ids"].append(F.pad(ids, (0, pad), value=0))
        out["labels"].append(F.pad(b["labels"], (0, pad), value=IGNORE_INDEX))
        if "position_ids" in b:
            pos = b["position_ids"]
            if pad:  # padding forms its own "sequence", as distlab.data.collate does
                pos = torch.cat([pos, torch.arange(pad).expand(rows, -1)], dim=1)
        else:
            pos = torch.arange(seq_len).expand(rows, -1)
        out["position_ids"].append(pos)
        if has_mask:
            out["attention_mask"].append(F.pad(b["attention_mask"], (0, pad), value=0))
    return {k: torch.cat(v).contiguous().to(device) for k, v in out.items() if v}


# --------------------------------------------------------------------------- the strategy

class PipelineStrategy(DistributedStrategy):
    name = "pipeline"

    def __init__(self) -> None:
        super().__init__()
        self.stage_index = 0
        self.num_stages = 1
        self.schedule = None
        self.schedule_used = ""
        self.recorder: Recorder | None = None
        self.stage_module: StageModule | None = None
        self.tie_group = None
        self.tied_param: torch.Tensor | None = None
        self._loss_scale = 1.0
        self._step = 0
        self._timeline_path: Path | None = None
        self._p2p_timed = False

    # --- process group
    def setup(self, cfg) -> None:
        super().setup(cfg)
        self.cfg = cfg
        self.num_stages = cfg.pipeline_stages or self.world_size
        if self.num_stages != self.world_size:
            raise ValueError(f"pipeline_stages={self.num_stages} on {self.world_size} ranks: this strategy runs a pure "
                             "pipeline (one stage per rank); pipeline x data parallelism is not implemented here")
        if self.num_stages < 2:
            raise ValueError("a pipeline needs at least 2 stages (ranks)")
        if cfg.pipeline_schedule not in SCHEDULES:
            raise ValueError(f"pipeline_schedule={cfg.pipeline_schedule!r}: expected one of {', '.join(SCHEDULES)}")
        self.stage_index = self.rank

    @property
    def data_parallel_size(self) -> int:
        return 1  # every stage sees the same micro-batches

    @property
    def data_parallel_rank(self) -> int:
        return 0

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over data-parallel replicas: there is one (the stages share the data)."""
        return tensor

    def stage_split(self, causal, cfg) -> tuple[list[range], range]:
        """Every stage's decoder layers, and this stage's."""
        ranges = split_layers(causal.config.num_hidden_layers, self.num_stages, cfg.stage_layers)
        return ranges, ranges[self.stage_index]

    # --- model
    def prepare(self, model, choice: DeviceChoice, cfg):
        causal = model.causal_lm
        ranges, mine = self.stage_split(causal, cfg)
        first, last = self.is_first, self.is_last
        tied = is_tied(causal)
        stage = StageModule(causal, mine, first, last)
        drop_other_stages(causal, mine, first, last, self.stage_index)
        wrapped = PipelinedModel(model, stage, self.stage_index, ranges).to(choice.device)
        self.stage_module, self.choice = stage, choice
        # The tied embedding/head weight, trained on both end stages under full fine-tuning.
        if tied and not cfg.lora:
            ends = sorted({0, self.num_stages - 1})
            self.tie_group = dist.new_group(ends) if self.num_stages > 2 else dist.group.WORLD
            if first:
                self.tied_param = stage.embed.weight
            elif last:
                self.tied_param = stage.head.weight
        offset = clock_offset(choice.device)
        self.recorder = Recorder(self.stage_index, offset, choice.device, enabled=cfg.measure_comm)
        if cfg.measure_comm:
            self.recorder.meter = _ActivationMeter(stage)
            self._timeline_path = Path(cfg.output_dir) / "pipeline_timeline.jsonl"
            if self.is_main:
                self._timeline_path.parent.mkdir(parents=True, exist_ok=True)
                self._timeline_path.write_text("")
        self.build_schedule(cfg.pipeline_schedule, cfg.micro_steps(1))
        optimizer = self.make_optimizer(stage, cfg.lr, cfg.weight_decay)
        if self.is_main:
            print(f"[distlab] pipeline {self.schedule_used} with {self.microbatches} micro-batch(es) of "
                  f"{cfg.micro_batch_size} row(s); " + "; ".join(describe_split(ranges)), flush=True)
        return wrapped, optimizer, cosine_with_warmup(optimizer, cfg.warmup_steps, cfg.max_steps)

    def build_schedule(self, schedule: str, microbatches: int) -> None:
        """(Re)build this rank's PipelineStage and schedule for m micro-batches per step."""
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        self.microbatches = microbatches
        self.schedule_used = schedule
        if schedule == "1f1b" and microbatches < self.num_stages:
            self.schedule_used = "gpipe"  # torch needs m >= p for 1F1B; with fewer it is GPipe's order anyway
        stage = _timed_stage_class()(self.stage_module, self.stage_index, self.num_stages, self.choice.device)
        stage.recorder = self.recorder
        cls = Schedule1F1B if self.schedule_used == "1f1b" else ScheduleGPipe
        self.pp_stage = stage
        self.schedule = cls(stage, n_microbatches=microbatches, loss_fn=self._loss_fn, scale_grads=False)

    def _loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # The last stage already returns the summed loss; the target is unused (the schedule wants one).
        return output * self._loss_scale

    def unwrap(self, model):
        return model

    # --- one step
    def _stage_inputs(self, batch: dict[str, torch.Tensor]):
        args = (batch["input_ids"],) if self.is_first else ()
        kwargs = {"position_ids": batch["position_ids"]}
        if "attention_mask" in batch:
            kwargs["attention_mask"] = batch["attention_mask"]
        if self.is_last:
            kwargs["labels"] = batch["labels"]
        return args, kwargs

    def forward_backward(self, model, micro_batches, choice: DeviceChoice, global_label_tokens: int) -> float:
        if len(micro_batches) != self.microbatches:
            raise ValueError(f"{len(micro_batches)} micro-batches for a schedule built for {self.microbatches}")
        self._loss_scale = 1.0 / global_label_tokens  # data-parallel size 1
        batch = stack_microbatches(micro_batches, self.cfg.seq_len, choice.device)
        args, kwargs = self._stage_inputs(batch)
        losses: list[torch.Tensor] | None = [] if self.is_last else None
        target = batch["labels"] if self.is_last else None
        with autocast(choice), timed_p2p(self.recorder, {r: r for r in range(self.world_size)}) as self._p2p_timed:
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        local = torch.tensor([sum(float(x.detach()) for x in losses) if losses else 0.0], dtype=torch.float64, device=choice.device)
        dist.broadcast(local, src=self.num_stages - 1)
        return float(local)

    def clip_across_stages(self, params: list[torch.Tensor], max_grad_norm: float) -> float:
        """Clip by the global gradient norm of the whole model, each stage holding some of the
        parameters: squared norms summed over the stages. Returns the norm before clipping."""
        # the tied weight's (already summed) gradient is counted once, on the first stage
        counted = [p for p in params if p.grad is not None and not (self.is_last and p is self.tied_param)]
        sq = torch.zeros(1, dtype=torch.float64, device=self.choice.device)
        for p in counted:  # per-tensor norms in the gradient's dtype, as clip_grad_norm_ computes them
            sq += torch.linalg.vector_norm(p.grad.detach()).double() ** 2
        dist.all_reduce(sq)
        norm = float(sq.sqrt())
        if max_grad_norm and max_grad_norm > 0:
            coef = max_grad_norm / (norm + 1e-6)
            if coef < 1.0:
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        return norm

    def step(self, model, optimizer, scheduler, max_grad_norm: float) -> float:
        params = [p for p in self.stage_module.parameters() if p.requires_grad]
        if self.tie_group is not None and self.tied_param is not None and self.tied_param.grad is not None:
            dist.all_reduce(self.tied_param.grad, group=self.tie_group)
        norm = self.clip_across_stages(params, max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return norm

    def comm_stats(self) -> dict[str, Any]:
        """Gather this step's timeline from every stage (after the step's clock has stopped)."""
        if self.recorder is None or not self.recorder.enabled:
            return {}
        from ..pipeline_bubble import step_summary

        self._step += 1
        mine = {"events": self.recorder.take(), "peak_mem": peak_memory_bytes(self.choice.device),
                "act_peak": self.recorder.meter.take_peak() if self.recorder.meter else 0}
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, mine)
        events = [e for r in every for e in r["events"]]
        summary = step_summary(events)
        stats = {
            "comm_time_s": summary["comm_time_s"] if self._p2p_timed else float("nan"),
            "comm_bytes": summary["comm_bytes"], "p2p_blocked_s": summary["p2p_blocked_s"],
            "bubble_fraction": summary["bubble_fraction"], "stage_idle": summary["stage_idle"],
            "stage_busy_s": summary["stage_busy_s"], "pipeline_span_s": summary["pipeline_span_s"],
            "pipeline_schedule": self.schedule_used, "pipeline_stages": self.num_stages,
            "microbatches": self.microbatches,
            "stage_peak_mem_bytes": [r["peak_mem"] for r in every],
            "stage_activation_peak_bytes": [r["act_peak"] for r in every],
        }
        if self.is_main and self._timeline_path is not None:
            with open(self._timeline_path, "a") as fh:
                fh.write(json.dumps({"step": self._step, "schedule": self.schedule_used, "stages": self.num_stages,
                                     "microbatches": self.microbatches, "events": events}) + "\n")
        return stats

    # --- evaluation: a plain forward through the stages, one batch at a time
    def _send_tensor(self, t: torch.Tensor, dst: int) -> None:
        header = torch.tensor([t.dim(), *t.shape, _DTYPES.index(t.dtype)], dtype=torch.int64, device=t.device)
        dist.send(torch.tensor([header.numel()], dtype=torch.int64, device=t.device), dst)
        dist.send(header, dst)
        dist.send(t.contiguous(), dst)

    def _recv_tensor(self, src: int, device: torch.device) -> torch.Tensor:
        n = torch.zeros(1, dtype=torch.int64, device=device)
        dist.recv(n, src)
        header = torch.zeros(int(n), dtype=torch.int64, device=device)
        dist.recv(header, src)
        ndim = int(header[0])
        shape = [int(x) for x in header[1:1 + ndim]]
        t = torch.empty(shape, dtype=_DTYPES[int(header[1 + ndim])], device=device)
        dist.recv(t, src)
        return t

    @torch.no_grad()
    def evaluate(self, model, data, choice: DeviceChoice, batch_size: int = 8) -> float:
        was_training = model.training
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=choice.device)
        for i in range(0, len(data), batch_size):
            rows = list(range(i, min(i + batch_size, len(data))))
            raw = data.batch(rows)
            batch = stack_microbatches([raw], self.cfg.seq_len, choice.device)
            _, kwargs = self._stage_inputs(batch)
            x = batch["input_ids"] if self.is_first else self._recv_tensor(self.stage_index - 1, choice.device)
            with autocast(choice):
                out = self.stage_module(x, **kwargs)
            if self.is_last:
                total[0] += float(out)
            else:
                self._send_tensor(out, self.stage_index + 1)
            total[1] += raw["n_label_tokens"]
        dist.broadcast(total, src=self.num_stages - 1)
        model.train(was_training)
        return float(total[0] / total[1])

    # --- saving
    def _owned_state(self, model: PipelinedModel) -> dict[str, torch.Tensor]:
        lm = model.lm
        if hasattr(lm, "peft_config"):  # the adapter file's own keys (adapter name stripped), this stage's only
            from peft import get_peft_model_state_dict

            return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(lm).items()}
        return {k: v.detach().cpu() for k, v in lm.state_dict().items()}

    def save_model(self, model, path: Path, tokenizer=None) -> None:
        """Every stage sends its part to rank 0, which writes one adapter (LoRA) or one full model,
        loadable with from_pretrained like the single-device one."""
        part = self._owned_state(model)
        every: list[Any] = [None] * self.world_size if self.is_main else None
        dist.gather_object(part, every, dst=0)
        if self.is_main:
            merged: dict[str, torch.Tensor] = {}
            for p in every:
                merged.update(p)
            lm = model.lm
            if hasattr(lm, "peft_config"):
                # What PeftModel.save_pretrained writes: the adapter config and adapter_model.safetensors.
                from safetensors.torch import save_file

                config = copy.deepcopy(lm.peft_config["default"])
                config.inference_mode = True
                Path(path).mkdir(parents=True, exist_ok=True)
                config.save_pretrained(str(path))
                save_file(merged, str(Path(path) / "adapter_model.safetensors"), metadata={"format": "pt"})
            else:
                causal = model.causal_lm
                if getattr(causal.config, "tie_word_embeddings", False):  # the head is the embedding: saved once
                    for k in [k for k in merged if k.endswith("lm_head.weight")]:
                        merged.pop(k)
                causal.save_pretrained(path, state_dict=merged)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
        self.barrier()

    def _state_file(self, path: Path) -> Path:
        return Path(path) / f"training_state.stage{self.stage_index}.pt"

    def save_training_state(self, model, optimizer, path: Path) -> None:
        """Each stage writes its own trained weights and optimizer state (no gathering)."""
        trained = {n: p.detach().cpu() for n, p in model.full.named_parameters() if p.requires_grad}
        torch.save({"model": trained, "optimizer": optimizer.state_dict(),
                    "stage_layers": [len(r) for r in model.ranges]}, self._state_file(path))

    def load_training_state(self, model, optimizer, path: Path) -> None:
        state = torch.load(self._state_file(path), map_location="cpu", weights_only=False)
        if state["stage_layers"] != [len(r) for r in model.ranges]:
            raise RuntimeError(f"{path}: written with stage layers {state['stage_layers']}, resuming with "
                               f"{[len(r) for r in model.ranges]}")
        params = dict(model.full.named_parameters())
        missing = sorted(n for n, p in params.items() if p.requires_grad and n not in state["model"])
        if missing:
            raise RuntimeError(f"{path}: stage {self.stage_index} checkpoint lacks {missing[:3]}")
        with torch.no_grad():
            for name, tensor in state["model"].items():
                params[name].copy_(tensor)
        optimizer.load_state_dict(state["optimizer"])


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]


def describe_split(ranges: list[range]) -> list[str]:
    """Human-readable stage contents, e.g. ['stage 0: embeddings + layers 0-1', ...]."""
    out = []
    for s, r in enumerate(ranges):
        parts = (["embeddings"] if s == 0 else []) + ([f"layers {r.start}-{r.stop - 1}"] if len(r) else [])
        parts += ["norm + LM head + loss"] if s == len(ranges) - 1 else []
        out.append(f"stage {s}: " + " + ".join(parts))
    return out


def sdpa_backends(device: str | torch.device = "cpu", heads: int = 4, head_dim: int = 64, seq: int = 128) -> list[dict]:
    """Which scaled_dot_product_attention backends run on this device, and which one PyTorch picks,
    for the two kinds of attention the tutorial's batches use: plain causal (is_causal, no mask)
    and a boolean mask (packed rows: block-diagonal causal; padded rows: causal + padding). Each
    backend is tried alone (torch.nn.attention.sdpa_kernel); the pick is PyTorch's own dispatch
    (torch._fused_sdp_choice, private: "unknown" if it is missing)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(2, heads, seq, head_dim, device=device, dtype=dtype)
    mask = torch.ones(2, 1, seq, seq, dtype=torch.bool, device=device).tril()
    names = {0: "math", 1: "flash", 2: "mem_efficient", 3: "cudnn", 4: "overrideable"}
    rows = []
    for kind, kwargs in (("causal, no mask", {"is_causal": True}), ("boolean mask (packing/padding)", {"attn_mask": mask})):
        row = {"attention": kind}
        for name, backend in (("math", SDPBackend.MATH), ("flash", SDPBackend.FLASH_ATTENTION),
                              ("mem_efficient", SDPBackend.EFFICIENT_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(q, q, q, **kwargs)
                row[name] = True
            except RuntimeError:
                row[name] = False
        try:
            choice = torch._fused_sdp_choice(q, q, q, kwargs.get("attn_mask"), 0.0, kwargs.get("is_causal", False))
            row["pytorch picks"] = names.get(int(choice), str(choice))
        except (AttributeError, RuntimeError):
            row["pytorch picks"] = "unknown"
        rows.append(row)
    return rows
