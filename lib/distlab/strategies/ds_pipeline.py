"""The same pipeline split with DeepSpeed's PipelineModule (the DeepSpeed-PP seed's setup).

What is the same as distlab.strategies.pipeline: the split (`split_layers`: embeddings + the first
run of decoder layers on stage 0, the last run + final norm + LM head + summed loss on the last
stage; balanced by layer count or `stage_layers`), the micro-batches (the loop's grad_accum
micro-batches, padded to seq_len), the loss convention (summed loss / label tokens of the step),
global-norm clipping, the measurement (per-micro-batch timestamps, timed sends/receives), evaluation
and saving (one adapter or model, loadable with from_pretrained).

What DeepSpeed does differently:
* The model is a flat list of layers, `LayerSpec`s that each rank builds only for its own stage,
  and every layer takes and returns one tuple of tensors. Here the tuple is
  (hidden, position_ids, labels[, attention_mask]): position ids (and the padding mask) travel
  with the activations so every layer computes the rotary embeddings and the causal/packed mask
  (cached once per stage forward), and the labels travel to the last layer, which returns the
  summed loss. DeepSpeed sends every tensor of the tuple to the next stage (the integer ones are a
  few KB) and sends gradients back for the floating-point ones.
* Partitioning: PipelineModule offers 'uniform', 'parameters' and 'type:regex'; distlab overrides
  `_partition_layers` so both implementations place exactly the same layers on each stage.
* A tied input/output embedding trained on both ends (full fine-tuning of the tiny model) is a
  `TiedLayerSpec` used by the first and the last stage; DeepSpeed all-reduces its gradient
  between them (`ReduceTiedGrads`). Frozen ties (LoRA) need nothing.
* `engine.train_batch()` runs the whole step, DeepSpeed's 1F1B-style TrainSchedule for
  gradient_accumulation_steps = m micro-batches, *including* the optimizer step and the learning
  rate scheduler step. DeepSpeed divides each micro-batch loss by the accumulation steps before
  backward and averages them for the returned loss, so the loss function multiplies by m
  (summed loss x m / label tokens): the gradients and the logged loss are then distlab's.
* The optimizer is the same torch AdamW as everywhere (a DeepSpeed-named optimizer would
  JIT-compile fused Adam). In fp32 (CPU) DeepSpeed's own clipping is off and the OptimizerStep
  instruction is wrapped to clip by the global norm across stages first, exactly as the torch
  pipeline does; with bf16 (GPUs) DeepSpeed's BF16 optimizer keeps fp32 master weights and clips.
* Measurement: the engine executes a schedule of instructions through its `_INSTRUCTION_MAP`;
  this rank's engine gets a copy with ForwardPass/BackwardPass and Send/Recv Activation/Grad
  wrapped to time-stamp them (the k-th ForwardPass of a step is micro-batch k). DeepSpeed's sends
  and receives are blocking, so each event spans the whole transfer; the analysis is the same
  as for the torch pipeline (distlab.pipeline_bubble).
* ZeRO stages 2/3 are incompatible with DeepSpeed's pipeline engine (it asserts); stage 0 here.

First distributed start: DeepSpeed JIT-compiles its shared-memory comm op (~1 minute on two cores)
into TORCH_EXTENSIONS_DIR, pointed at a persistent cache unless already set (shared with the ZeRO
strategies, distlab.strategies.zero.extensions_dir); rank 0 prints a line before it compiles.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..data import IGNORE_INDEX
from ..device import DeviceChoice
from .pipeline import (PipelinedModel, PipelineStrategy, Recorder, StageModule, _ActivationMeter, _decoder_parts,
                       clock_offset, drop_other_stages, is_tied, stack_microbatches)
from .single import cosine_with_warmup


# --------------------------------------------------------------------------- layers

class _MaskCache:
    """Rotary embeddings and attention masks of the micro-batch flowing through this stage, computed
    once per stage forward (the same position-id tensor object passes every layer of the stage)."""

    def __init__(self, config, rotary: nn.Module):
        self.config, self.rotary = config, rotary
        self.key: tuple | None = None
        self.value: tuple | None = None

    def get(self, hidden, position_ids, attention_mask):
        if self.key is not None and self.key[0] is position_ids and self.key[1] is attention_mask:
            return self.value
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        args = dict(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask, past_key_values=None,
                    position_ids=position_ids)
        types = set(getattr(self.config, "layer_types", None) or ["full_attention"])
        masks = {k: create_sliding_window_causal_mask(**args) if k == "sliding_attention" else create_causal_mask(**args)
                 for k in types}
        self.key, self.value = (position_ids, attention_mask), (masks, self.rotary(hidden, position_ids))
        return self.value


class EmbedPipe(nn.Module):
    def __init__(self, embed: nn.Module):
        super().__init__()
        self.embed = embed

    def forward(self, inputs):
        ids, *rest = inputs
        return (self.embed(ids), *rest)


class DecoderLayerPipe(nn.Module):
    def __init__(self, layer: nn.Module, layer_type: str, cache: _MaskCache):
        super().__init__()
        self.layer, self.layer_type = layer, layer_type
        object.__setattr__(self, "cache", cache)  # shared, not a submodule

    def forward(self, inputs):
        hidden, position_ids, labels, *mask = inputs
        masks, position_embeddings = self.cache.get(hidden, position_ids, mask[0] if mask else None)
        out = self.layer(hidden, attention_mask=masks[self.layer_type], position_embeddings=position_embeddings,
                         position_ids=position_ids, past_key_values=None, use_cache=False)
        return (out[0] if isinstance(out, tuple) else out, position_ids, labels, *mask)


class NormPipe(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, inputs):
        hidden, *rest = inputs
        return (self.norm(hidden), *rest)


def _summed_loss(hidden, labels, weight):
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX
    logits = F.linear(hidden[:, :-1][keep], weight)
    return F.cross_entropy(logits.float(), targets[keep], reduction="sum")


class HeadLossPipe(nn.Module):
    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def forward(self, inputs):
        hidden, _, labels, *_ = inputs
        targets = labels[:, 1:]
        keep = targets != IGNORE_INDEX
        return F.cross_entropy(self.head(hidden[:, :-1][keep]).float(), targets[keep], reduction="sum")


def _tied_head_loss(module: EmbedPipe, inputs):
    hidden, _, labels, *_ = inputs
    return _summed_loss(hidden, labels, module.embed.weight)


def layer_specs(causal, train_tied: bool) -> list:
    """DeepSpeed's layer list: embedding, one spec per decoder layer, final norm, head + loss."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    decoder, head = _decoder_parts(causal)
    cache = _MaskCache(causal.config, decoder.rotary_emb)
    types = getattr(causal.config, "layer_types", None)
    specs: list = [TiedLayerSpec("embed", EmbedPipe, decoder.embed_tokens, tied_weight_attr=["embed.weight"])
                   if train_tied else LayerSpec(EmbedPipe, decoder.embed_tokens)]
    specs += [LayerSpec(DecoderLayerPipe, layer, types[i] if types else "full_attention", cache)
              for i, layer in enumerate(decoder.layers)]
    specs.append(LayerSpec(NormPipe, decoder.norm))
    specs.append(TiedLayerSpec("embed", EmbedPipe, decoder.embed_tokens, forward_fn=_tied_head_loss,
                               tied_weight_attr=["embed.weight"]) if train_tied else LayerSpec(HeadLossPipe, head))
    return specs


def spec_boundaries(ranges: list[range], n_specs: int) -> list[int]:
    """PipelineModule `parts` for the distlab split: spec 0 is the embedding, specs 1..L the
    decoder layers, the last two the norm and the head; stage s owns parts[s]:parts[s+1]."""
    parts = [0] + [1 + r.stop for r in ranges[:-1]] + [n_specs]
    return parts


def _pipeline_module_class():
    from deepspeed.pipe import PipelineModule

    class SplitPipelineModule(PipelineModule):
        """PipelineModule with distlab's split instead of DeepSpeed's partition methods."""

        def __init__(self, parts: list[int], *args, **kwargs):
            object.__setattr__(self, "_distlab_parts", parts)
            super().__init__(*args, **kwargs)

        def _partition_layers(self, method="uniform"):
            self.parts = list(self._distlab_parts)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    return SplitPipelineModule


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(t) for t in obj)
    return 0


# --------------------------------------------------------------------------- the strategy

class DeepSpeedPipelineStrategy(PipelineStrategy):
    name = "ds_pipeline"

    def __init__(self) -> None:
        super().__init__()
        self.engine = None
        self._last_norm = float("nan")
        self._counts = {"F": 0, "B": 0}

    def setup(self, cfg) -> None:
        from .zero import init_deepspeed, use_extensions_cache

        cache = use_extensions_cache()  # before DeepSpeed builds anything
        super().setup(cfg)
        init_deepspeed(self, cache)

    def ds_config(self, cfg, bf16: bool) -> dict[str, Any]:
        m = cfg.micro_steps(1)
        config: dict[str, Any] = {
            "train_batch_size": cfg.micro_batch_size * m,  # data-parallel size 1
            "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
            "gradient_accumulation_steps": m,
            # fp32: distlab clips by the global norm (see the module docstring); bf16: DeepSpeed does
            "gradient_clipping": cfg.max_grad_norm if bf16 else 0.0,
            "zero_optimization": {"stage": 0},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
            "pipeline": {"activation_checkpoint_interval": 0},
        }
        if bf16:
            config["bf16"] = {"enabled": True}
        return config

    def prepare(self, model, choice: DeviceChoice, cfg):
        import deepspeed

        causal = model.causal_lm
        ranges, mine = self.stage_split(causal, cfg)
        first, last = self.is_first, self.is_last
        train_tied = is_tied(causal) and not cfg.lora
        specs = layer_specs(causal, train_tied)
        parts = spec_boundaries(ranges, len(specs))
        with torch.no_grad():  # DeepSpeed broadcasts tied weights in place while building: keep autograd out
            pipe = _pipeline_module_class()(parts, layers=specs, num_stages=self.num_stages, loss_fn=self._ds_loss,
                                            partition_method="uniform", activation_checkpoint_interval=0)
        for i, spec in enumerate(specs):  # the specs of other stages must not keep their layers alive
            if not parts[self.stage_index] <= i < parts[self.stage_index + 1]:
                spec.module_args, spec.module_kwargs = (), {}
        stage = StageModule(causal, mine, first, last)  # the same modules, for evaluation
        drop_other_stages(causal, mine, first, last, self.stage_index)
        wrapped = PipelinedModel(model, stage, self.stage_index, ranges).to(choice.device)
        self.stage_module, self.choice, self.microbatches = stage, choice, cfg.micro_steps(1)
        self.schedule_used = "deepspeed-1f1b"
        if train_tied:
            self.tied_param = pipe.tied_modules["embed"].embed.weight
        self.recorder = Recorder(self.stage_index, clock_offset(choice.device), choice.device,
                                 enabled=cfg.measure_comm)
        if cfg.measure_comm:
            from pathlib import Path

            self.recorder.meter = _ActivationMeter(pipe)
            self._timeline_path = Path(cfg.output_dir) / "pipeline_timeline.jsonl"
            if self.is_main:
                self._timeline_path.parent.mkdir(parents=True, exist_ok=True)
                self._timeline_path.write_text("")
        bf16 = choice.autocast_dtype == torch.bfloat16 or choice.dtype == torch.bfloat16
        optimizer = self.make_optimizer(pipe, cfg.lr, cfg.weight_decay)
        scheduler = cosine_with_warmup(optimizer, cfg.warmup_steps, cfg.max_steps)
        self.max_grad_norm = cfg.max_grad_norm
        self.own_clipping = not bf16
        engine, _, _, _ = deepspeed.initialize(model=pipe, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=self.ds_config(cfg, bf16))
        self.engine = engine
        self._instrument(engine)
        wrapped.engine = engine
        if self.is_main:
            from .pipeline import describe_split

            print(f"[distlab] DeepSpeed PipelineModule, {self.microbatches} micro-batch(es) of "
                  f"{cfg.micro_batch_size} row(s); " + "; ".join(describe_split(ranges)), flush=True)
        self._p2p_timed = True
        return wrapped, optimizer, scheduler

    def _ds_loss(self, outputs, labels):
        # DeepSpeed divides by gradient_accumulation_steps before backward and when it averages the
        # micro-batch losses; multiplying by m leaves distlab's summed loss / step label tokens.
        return outputs * (self._loss_scale * self.microbatches)

    # --- instrumentation of the engine's instructions
    def _instrument(self, engine) -> None:
        from deepspeed.runtime.pipe import schedule as ds_schedule

        base = dict(type(engine)._INSTRUCTION_MAP)
        rec, me = self.recorder, self.stage_index

        def compute(kind, fn):
            def run(eng, **kw):
                if not rec.enabled:
                    return fn(eng, **kw)
                t0 = rec.now()
                with rec.saving() if kind == "F" else contextlib.nullcontext():
                    fn(eng, **kw)
                rec.events.append({"stage": me, "kind": kind, "mb": self._counts[kind], "t0": t0, "t1": rec.now()})
                self._counts[kind] += 1
            return run

        def comm(kind, what, peer, fn, size_before=None, size_after=None):
            def run(eng, **kw):
                if not rec.enabled:
                    return fn(eng, **kw)
                nbytes = size_before(eng, kw["buffer_id"]) if size_before else 0
                t0 = rec.now()
                fn(eng, **kw)
                t1 = rec.now()
                if size_after:
                    nbytes = size_after(eng, kw["buffer_id"])
                rec.events.append({"stage": me, "kind": kind, "peer": peer, "what": what, "t0": t0, "t1": t1,
                                   "bytes": nbytes})
            return run

        def grads_of_inputs(eng, b):
            inputs = eng.pipe_buffers["inputs"][b]
            inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
            return sum(_nbytes(t.grad) for t in inputs if isinstance(t, torch.Tensor) and t.grad is not None)

        def optimizer_step(fn):
            def run(eng, **kw):
                if self.own_clipping:
                    self._last_norm = self._clip(self.max_grad_norm)
                fn(eng, **kw)
                if not self.own_clipping:
                    norm = eng.get_global_grad_norm()
                    self._last_norm = float(norm) if norm is not None else float("nan")
            return run

        S = ds_schedule
        mapping = dict(base)
        mapping[S.ForwardPass] = compute("F", base[S.ForwardPass])
        mapping[S.BackwardPass] = compute("B", base[S.BackwardPass])
        mapping[S.SendActivation] = comm("send", "act", me + 1, base[S.SendActivation],
                                         size_before=lambda e, b: _nbytes(e.pipe_buffers["outputs"][b]))
        mapping[S.RecvActivation] = comm("recv", "act", me - 1, base[S.RecvActivation],
                                         size_after=lambda e, b: _nbytes(e.pipe_buffers["inputs"][b]))
        mapping[S.SendGrad] = comm("send", "grad", me - 1, base[S.SendGrad], size_before=grads_of_inputs)
        mapping[S.RecvGrad] = comm("recv", "grad", me + 1, base[S.RecvGrad],
                                   size_after=lambda e, b: _nbytes(e.grad_layer))
        mapping[S.OptimizerStep] = optimizer_step(base[S.OptimizerStep])
        engine._INSTRUCTION_MAP = mapping

    def _clip(self, max_grad_norm: float) -> float:
        """Global-norm clipping over all stages (the tied weight counted once), as PipelineStrategy."""
        return self.clip_across_stages([p for p in self.engine.module.parameters() if p.requires_grad], max_grad_norm)

    # --- one step
    def forward_backward(self, model, micro_batches, choice: DeviceChoice, global_label_tokens: int) -> float:
        if len(micro_batches) != self.microbatches:
            raise ValueError(f"{len(micro_batches)} micro-batches for an engine built for {self.microbatches}")
        self._loss_scale = 1.0 / global_label_tokens
        data = []
        for b in micro_batches:
            s = stack_microbatches([b], self.cfg.seq_len, choice.device)
            inputs = (s["input_ids"], s["position_ids"], s["labels"]) + ((s["attention_mask"],) if "attention_mask" in s else ())
            data.append((inputs, s["labels"]))
        self._counts = {"F": 0, "B": 0}
        loss = self.engine.train_batch(data_iter=iter(data))  # forward, backward, optimizer and lr step
        return float(loss)

    def step(self, model, optimizer, scheduler, max_grad_norm: float) -> float:
        return self._last_norm  # train_batch() already stepped the optimizer and the scheduler

    def unwrap(self, model):
        return model

