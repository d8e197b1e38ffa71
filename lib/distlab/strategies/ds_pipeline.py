"""The same pipeline split with DeepSpeed's PipelineModule (the DeepSpeed pipeline study's setup).

What is the same as distlab.strategies.pipeline (both are distlab.strategies.staged ranks): the
split (`split_layers`: embeddings + the first
run of decoder layers on stage 0, the last run + final norm + LM head + summed loss on the last
stage; balanced by layer count or `stage_layers`), the micro-batches (the loop's grad_accum
micro-batches, padded to seq_len), the loss convention (summed loss / label tokens of the step),
global-norm clipping, the measurement (per-micro-batch timestamps, timed sends/receives), evaluation
and saving (one adapter or model, loadable with from_pretrained).

What DeepSpeed does differently:
* The model is a flat list of layers, `LayerSpec`s that each rank builds only for its own stage,
  and every layer takes and returns one tuple of tensors. Here the tuple is
  (hidden, position_ids, labels[, attention_mask]): position ids (and the padding mask) travel
  with the activations so every layer can get the rotary embeddings and the causal/packed mask
  (split.StageMasks, built once per stage forward), and the labels travel to the last layer, which returns the
  summed loss. DeepSpeed sends every tensor of the tuple to the next stage (the integer ones are a
  few KB) and sends gradients back for the floating-point ones.
* Partitioning: PipelineModule offers 'uniform', 'parameters' and 'type:regex'; distlab gives it
  explicit boundaries (distlab.compat.pipeline_module_with_parts) so both implementations place
  exactly the same layers on each stage.
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
* The engine runs a schedule of instructions through a table (instruction -> method). This
  rank's engine gets its own copy with OptimizerStep wrapped for the clipping above; with
  `measure_comm` the meter wraps the compute and send/receive instructions in the same copy
  (distlab.measure.pipeline_trace).
* ZeRO stages 2/3 are incompatible with DeepSpeed's pipeline engine (it asserts); stage 0 here.

DeepSpeed's start-up (the JIT-compiled comm op, cached) is distlab.strategies.deepspeed_runtime.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distlab import compat
from distlab.device import DeviceChoice
from distlab.layer_split import describe_split
from distlab.lm_loss import label_loss_sum
from distlab.strategies.deepspeed_runtime import init_deepspeed, pipeline_config, use_extensions_cache
from distlab.strategies.split import StageMasks, decoder_parts, is_tied, layer_types, run_layer, stack_microbatches
from distlab.strategies.staged import StagedStrategy

# --------------------------------------------------------------------------- layers (one tuple in, one out)

class EmbedPipe(nn.Module):
    def __init__(self, embed: nn.Module):
        super().__init__()
        self.embed = embed

    def forward(self, inputs):
        ids, *rest = inputs
        return (self.embed(ids), *rest)


class DecoderLayerPipe(nn.Module):
    def __init__(self, layer: nn.Module, layer_type: str, masks: StageMasks):
        super().__init__()
        self.layer, self.layer_type = layer, layer_type
        object.__setattr__(self, "masks", masks)  # shared by the stage's layers, not a submodule

    def forward(self, inputs):
        hidden, position_ids, labels, *mask = inputs
        masks, position_embeddings = self.masks(hidden, position_ids, mask[0] if mask else None)
        hidden = run_layer(self.layer, hidden, self.layer_type, masks, position_embeddings, position_ids)
        return (hidden, position_ids, labels, *mask)


class NormPipe(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, inputs):
        hidden, *rest = inputs
        return (self.norm(hidden), *rest)


class HeadLossPipe(nn.Module):
    def __init__(self, head: nn.Module, chunked: bool = True):
        super().__init__()
        self.head, self.chunked = head, chunked

    def forward(self, inputs):
        hidden, _, labels, *_ = inputs
        return label_loss_sum(hidden, labels, self.head, chunked=self.chunked)


def _tied_head_loss(module: EmbedPipe, inputs):
    """The tied head's loss: the embedding's weight through F.linear, so the plain cross entropy (a callable
    head: label_loss_sum chunks a linear module's only)."""
    hidden, _, labels, *_ = inputs
    return label_loss_sum(hidden, labels, lambda h: F.linear(h, module.embed.weight))


def layer_specs(causal, train_tied: bool, chunked: bool = True) -> list:
    """DeepSpeed's layer list: embedding, one spec per decoder layer, final norm, head + loss."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec  # deferred: DeepSpeed is optional

    decoder, head = decoder_parts(causal)
    kinds = layer_types(causal.config, range(len(decoder.layers)))
    masks = StageMasks(causal.config, decoder.rotary_emb, kinds)
    specs: list = [TiedLayerSpec("embed", EmbedPipe, decoder.embed_tokens, tied_weight_attr=["embed.weight"])
                   if train_tied else LayerSpec(EmbedPipe, decoder.embed_tokens)]
    specs += [LayerSpec(DecoderLayerPipe, layer, kinds[i], masks) for i, layer in enumerate(decoder.layers)]
    specs.append(LayerSpec(NormPipe, decoder.norm))
    specs.append(TiedLayerSpec("embed", EmbedPipe, decoder.embed_tokens, forward_fn=_tied_head_loss,
                               tied_weight_attr=["embed.weight"]) if train_tied
                 else LayerSpec(HeadLossPipe, head, chunked))
    return specs


def spec_boundaries(ranges: list[range], n_specs: int) -> list[int]:
    """PipelineModule `parts` for the distlab split: spec 0 is the embedding, specs 1..L the
    decoder layers, the last two the norm and the head; stage s owns parts[s]:parts[s+1]."""
    return [0] + [1 + r.stop for r in ranges[:-1]] + [n_specs]


# --------------------------------------------------------------------------- the strategy

class DeepSpeedPipelineStrategy(StagedStrategy):
    name = "ds_pipeline"

    def __init__(self) -> None:
        super().__init__()
        self.engine = None
        self.pipe = None  # DeepSpeed's PipelineModule over this rank's stage
        self.grad_norm = float("nan")  # of the step train_batch() just ran
        self.own_clipping = True

    def setup(self, cfg) -> None:
        cache = use_extensions_cache()  # before DeepSpeed builds anything
        super().setup(cfg)
        init_deepspeed(self, cache)

    def keep_stage(self, model, choice: DeviceChoice, cfg):
        """This rank's stage, and DeepSpeed's PipelineModule over the same modules (what the engine runs)."""
        from deepspeed.pipe import PipelineModule  # deferred: DeepSpeed is optional, and its import is slow

        causal = model.causal_lm
        train_tied = is_tied(causal) and not cfg.lora
        # before the other stages' parts are dropped
        specs = layer_specs(causal, train_tied, cfg.cross_entropy == "chunked")
        wrapped = self.place_stage(model, choice, cfg)  # the same modules as the specs, for evaluation
        parts = spec_boundaries(wrapped.ranges, len(specs))
        with torch.no_grad():  # DeepSpeed broadcasts tied weights in place while building: keep autograd out
            self.pipe = compat.pipeline_module_with_parts(PipelineModule)(
                parts, layers=specs, num_stages=self.num_stages, loss_fn=self._ds_loss,
                partition_method="uniform", activation_checkpoint_interval=0)
        for i, spec in enumerate(specs):  # the specs of other stages must not keep their layers alive
            if not parts[self.stage_index] <= i < parts[self.stage_index + 1]:
                spec.module_args, spec.module_kwargs = (), {}
        if train_tied:
            self.tied_param = self.pipe.tied_modules["embed"].embed.weight
        return wrapped

    def trained_module(self, model):
        return self.pipe  # the optimizer steps the parameters as the engine holds them

    def wrap(self, model, optimizer, scheduler, choice: DeviceChoice, cfg):
        import deepspeed  # deferred: DeepSpeed is optional, and its import is slow

        self.schedule_used = "deepspeed-1f1b"
        bf16 = choice.autocast_dtype == torch.bfloat16 or choice.dtype == torch.bfloat16
        self.own_clipping = not bf16  # bf16: DeepSpeed's BF16 optimizer keeps fp32 masters and clips
        engine, _, _, _ = deepspeed.initialize(model=self.pipe, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=pipeline_config(cfg, bf16))
        self.engine = model.engine = engine
        instructions = compat.instruction_map(engine)
        instructions[_optimizer_step_instruction()] = self._clipped(instructions[_optimizer_step_instruction()])
        self.meter.watch_deepspeed_pipeline(self, engine, instructions)  # the timeline, sends and receives
        compat.set_instruction_map(engine, instructions)
        if self.is_main:
            print(f"[distlab] DeepSpeed PipelineModule, {self.microbatches} micro-batch(es) of "
                  f"{cfg.micro_batch_size} row(s); " + "; ".join(describe_split(model.ranges)), flush=True)
        return model, optimizer, scheduler

    def _ds_loss(self, outputs, labels):
        # DeepSpeed divides by gradient_accumulation_steps before backward and when it averages the
        # micro-batch losses; multiplying by m leaves distlab's summed loss / step label tokens.
        return outputs * (self.loss_scale * self.microbatches)

    def _clipped(self, optimizer_step):
        """The engine's OptimizerStep, after global-norm clipping across stages (fp32) or reading
        DeepSpeed's own norm (bf16)."""
        def run(engine, **kw):
            if self.own_clipping:
                trained = [p for p in engine.module.parameters() if p.requires_grad]
                self.grad_norm = self.clip_across_stages(trained, self.cfg.max_grad_norm)
            self.meter.state_point(engine.module, engine.optimizer)
            optimizer_step(engine, **kw)
            if not self.own_clipping:
                norm = engine.get_global_grad_norm()
                self.grad_norm = float(norm) if norm is not None else float("nan")
        return run

    def train_step(self, model, micro_batches, choice: DeviceChoice, global_label_tokens: int,
                   optimizer, scheduler, max_grad_norm: float) -> tuple[float, float]:
        """The engine's train_batch() is the whole step: forwards, backwards, optimizer and lr step."""
        if len(micro_batches) != self.microbatches:
            raise ValueError(f"{len(micro_batches)} micro-batches for an engine built for {self.microbatches}")
        self.loss_scale = 1.0 / global_label_tokens
        data = []
        for b in micro_batches:
            s = stack_microbatches([b], self.cfg.seq_len, choice.device)
            inputs = (s["input_ids"], s["position_ids"], s["labels"])
            if "attention_mask" in s:
                inputs += (s["attention_mask"],)
            data.append((inputs, s["labels"]))
        loss = self.engine.train_batch(data_iter=iter(data))
        return float(loss), self.grad_norm


def _optimizer_step_instruction():
    from deepspeed.runtime.pipe.schedule import OptimizerStep  # deferred: DeepSpeed is optional

    return OptimizerStep
