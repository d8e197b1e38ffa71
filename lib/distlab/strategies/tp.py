"""Tensor parallelism (Megatron's split, with DTensor): every rank holds a slice of each decoder layer's
projections and all ranks work on the same batch.

What changes against one device: a 1-D device mesh of all ranks and, per decoder layer, a plan for
`torch.distributed.tensor.parallel.parallelize_module`. q/k/v and gate/up are `ColwiseParallel` (each
rank keeps a block of output features: whole attention heads, a block of the FFN width), o and down are
`RowwiseParallel` (the matching block of input features): no communication between the two matmuls of a
block, one all-reduce of the block's output in forward, and the mirror all-reduce of the block's input
gradient in backward. For that mirror each block's input is made one DTensor first (`block_input_plan`), so
the partial input gradients of q, k and v (gate and up) are summed before one all-reduce, as Megatron's fused
projections do; a plan of the seven projections alone would all-reduce each column-parallel one's on its own.
The embedding, the norms and the LM head stay whole on every rank (unless
`vocab_parallel`, below); they receive the same (already summed) gradients everywhere, so their updates stay
identical without communication.

Sequence parallelism (`sequence_parallel`, Megatron's sequence parallelism, Korthikanti et al. 2022): between
the blocks each rank keeps only its slice of the sequence (`Shard(1)` of batch x sequence x hidden), so the
norms and residual additions work on s / tp tokens (`SequenceParallel` on both norms of a layer and on the
final norm). Before a block the slices are all-gathered (its column-parallel matmuls compute this rank's
features for every token, and causal attention mixes the tokens; the rotary position embeddings and document
boundaries come whole from the position ids, computed once for the whole sequence), and the block's
row-parallel output is reduce-scattered
along the sequence instead of all-reduced: an all-reduce IS a reduce-scatter then an all-gather, so the
bytes stay the same and the activations between blocks shrink by tp. The gathered input reaches q/k/v (and
gate/up) as one DTensor, so the backward sums their partial input gradients first and reduce-scatters
once per block. The embedding output is cut at the first layer's input (no communication; its gradient is
all-gathered in backward), the final norm's output is all-gathered for the LM head and the loss. The norms'
weights see only this rank's tokens: their gradients are partial sums, all-reduced once per step
(`sum_partial_gradients`). Under LoRA the adapters follow their projections (`layer_plan`), the whole factors
that meet these DTensors as replicated DTensors (`ReplicateParallel`).

The vocabulary (`vocab_parallel`, Megatron's vocabulary-parallel embedding and cross entropy): the embedding
is cut by rows (`RowwiseParallel`: a rank looks up the tokens of its V / tp rows, zeros for the others, and an
all-reduce sums the partial outputs), the LM head by output columns (`ColwiseParallel`, its logits left sharded
on the vocabulary), and the loss is computed from the logit slices under torch's `loss_parallel()`: per label
token an all-reduce of the largest logit, of the sum of exponentials and of the target's logit; backward, the
head's input gradient is all-reduced (`vocab_plan`, `TPStrategy.sync_context`). A tied embedding and head are
one matrix cut the same way (`Shard(0)`), and stay one. Chapter 07 writes the loss by hand first.

The data is NOT split: every rank sees every row (data-parallel size 1), so the loop's token counts and
loss need no sum over ranks. A rank computes the local heads of attention, which needs the key/value
head count divisible by the world size (`check_tp_degree`). With LoRA the plan splits each wrapped
projection's frozen base layer and the adapter factor on the same side (`layer_plan`). No periodic checkpoints yet
(`tp` refuses checkpoint_steps: a sliced optimizer state needs torch.distributed.checkpoint, as fsdp
writes it); `save_model` gathers the full weights and rank 0 writes a from_pretrained folder. Loading is split
too: the plan is applied to a weightless (meta) model, then each rank reads its slices (distlab.sharded_load).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from distlab.layer_split import tp_degree_problem
from distlab.strategies.base import DistributedStrategy, save_consolidated
from distlab.strategies.split import decoder_layers

# Megatron's pairs: the first matmul of a block split by output features, the second by input features
LAYER_PLAN = {
    "self_attn.q_proj": ColwiseParallel, "self_attn.k_proj": ColwiseParallel, "self_attn.v_proj": ColwiseParallel,
    "self_attn.o_proj": RowwiseParallel,
    "mlp.gate_proj": ColwiseParallel, "mlp.up_proj": ColwiseParallel, "mlp.down_proj": RowwiseParallel,
}


def check_tp_degree(config, tp: int) -> None:
    """A rank holds whole heads, and every query head needs its key/value head on the same rank."""
    problem = tp_degree_problem(config, tp)
    if problem:
        raise ValueError(problem)


class ReplicateParallel(ParallelStyle):
    """A module's weights whole on every rank, as replicated DTensors: for an adapter factor that meets DTensor
    activations under sequence parallelism (a plain tensor cannot multiply a DTensor). Its gradient then comes
    back as a partial sum where the activations were split, which `sum_partial_gradients` adds up.
    `local_output`: hand the next module a plain tensor (this rank's part) instead of the DTensor."""

    def __init__(self, local_output: bool = False):
        super().__init__()
        self.local_output = local_output

    def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
        to_local = (lambda _module, output, _mesh: output.to_local()) if self.local_output else None
        return distribute_module(module, device_mesh, output_fn=to_local)


def layer_plan(layer: torch.nn.Module, sequence_parallel: bool = False) -> dict:
    """LAYER_PLAN for one decoder layer, and each block's input made one DTensor (`block_input_plan`). A
    projection LoRA wraps (PEFT's lora.Linear) is split through its frozen `base_layer`, and its adapter so that
    it adds to the same slice: a column-parallel projection's lora_B is column-parallel (its lora_A, whole,
    reads the whole block input, a DTensor, so it is a replicated DTensor too: `ReplicateParallel`), a
    row-parallel one's lora_A is row-parallel (it reads this rank's input features; its r outputs are summed,
    and lora_B, whole, maps them to the whole output). With sequence parallelism a row-parallel projection
    reduce-scatters its output to token slices instead, and so does its lora_A (r values a token); its lora_B
    then meets this rank's tokens as a DTensor and is replicated too."""
    modules = dict(layer.named_modules())
    tokens = Shard(1)
    plan = {}
    for name, style in LAYER_PLAN.items():
        rowwise = style is RowwiseParallel
        split = RowwiseParallel(output_layouts=tokens) if sequence_parallel and rowwise else style()
        if f"{name}.base_layer" not in modules:
            plan[name] = split
            continue
        plan[f"{name}.base_layer"] = split
        for adapter in modules[f"{name}.lora_A"]:  # a ModuleDict: one Linear per adapter name
            lora_a, lora_b = f"{name}.lora_A.{adapter}", f"{name}.lora_B.{adapter}"
            if not rowwise:
                plan[lora_a], plan[lora_b] = ReplicateParallel(), ColwiseParallel()
            elif sequence_parallel:
                plan[lora_a] = RowwiseParallel(output_layouts=tokens, use_local_output=False)
                plan[lora_b] = ReplicateParallel(local_output=True)
            else:
                plan[lora_a] = RowwiseParallel()
    plan.update(block_input_plan(sequence_parallel))
    if sequence_parallel:
        plan.update({"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel()})
    return plan


def block_input_plan(sequence_parallel: bool = False) -> dict:
    """Each block's input becomes one DTensor before its column-parallel projections read it, so backward sums
    their partial input gradients (q, k, v: 3; gate, up: 2) into one DTensor and reduces it once per block:
    Megatron's f operator, 2 all-reduces a layer in backward. Without it each ColwiseParallel makes its own
    DTensor of the same plain input and all-reduces its own gradient: 5 a layer (chapter 07, section 4).
    Under sequence parallelism the input arrives as this rank's tokens and is all-gathered here, once per block
    (and, backward, its summed gradient reduce-scattered once)."""
    arriving, whole = (Shard(1) if sequence_parallel else Replicate()), Replicate()
    return {"self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": arriving},
                                            desired_input_kwarg_layouts={"hidden_states": whole}),
            "mlp": PrepareModuleInput(input_layouts=(arriving,), desired_input_layouts=(whole,))}


def vocab_plan(model: torch.nn.Module, mesh) -> None:
    """Cut the embedding by rows and the LM head by output columns (in place): each rank holds V / tp rows of
    the vocabulary and computes those logits, left sharded for loss_parallel(). A tied head is the embedding's
    matrix: each style makes its own DTensor of it, so the head is given the embedding's again (both Shard(0))."""
    causal = model.causal_lm
    embedding, head = causal.get_input_embeddings(), causal.get_output_embeddings()
    tied = head.weight is embedding.weight
    parallelize_module(embedding, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    parallelize_module(head, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
    if tied:
        head.weight = embedding.weight


def apply_tp_plan(model: torch.nn.Module, mesh, sequence_parallel: bool = False, vocab_parallel: bool = False) -> None:
    """Split every decoder layer's projections (and their LoRA adapters) over the mesh (in place); with
    `sequence_parallel`, also the activations between blocks along the sequence; with `vocab_parallel`, the
    embedding and the LM head along the vocabulary (the loss then runs under loss_parallel())."""
    check_tp_degree(model.causal_lm.config, mesh.size())
    # SequenceParallel re-registers a norm's weight as a new Parameter without its requires_grad (torch 2.13):
    # a frozen norm (under LoRA) would start training. Every parameter keeps its flag (restored below).
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    layers = decoder_layers(model)
    for layer in layers:
        parallelize_module(layer, mesh, layer_plan(layer, sequence_parallel))
    if sequence_parallel:
        # the whole embedding output, equal on every rank, is cut into token slices at the first layer (a
        # local slice, no communication); the final norm's slices are gathered for the LM head and the loss
        parallelize_module(layers[0], mesh, PrepareModuleInput(input_layouts=(Replicate(),),
                                                               desired_input_layouts=(Shard(1),),
                                                               use_local_output=True))
        norm = model.causal_lm.get_decoder().norm
        parallelize_module(norm, mesh, SequenceParallel())
        parallelize_module(norm, mesh, PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate()))
    if vocab_parallel:
        vocab_plan(model, mesh)
    for name, p in model.named_parameters():
        p.requires_grad_(trainable[name])


def refuse_periodic_checkpoints(name: str, cfg) -> None:
    """tp and fsdp_tp: a sliced optimizer state needs torch.distributed.checkpoint, not written here yet."""
    if cfg.checkpoint_steps:
        raise ValueError(f"strategy {name!r} writes no periodic checkpoints yet: set checkpoint_steps=0")


def per_tensor_adamw(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW, no decay on vectors, one tensor at a time: torch's multi-tensor AdamW cannot mix DTensor slices
    and plain tensors (tp), or DTensors on two meshes (fsdp_tp), in one group."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, foreach=False)


def clip_and_step(model: torch.nn.Module, optimizer, scheduler, max_grad_norm: float, meter) -> float:
    """The optimizer step over sliced weights: partial gradients summed, clipped to the global norm computed
    from each rank's own elements, step, schedule, zero the grads; returns the norm before clipping."""
    sum_partial_gradients(model)
    norm = global_grad_norm(model)
    if norm > max_grad_norm:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(max_grad_norm / (norm + 1e-6))  # as clip_grad_norm_ scales
    optimizer.step()
    meter.state_point(model, optimizer)
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict on the CPU, every DTensor gathered (collective: every rank calls it)."""
    return {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
            for name, t in model.state_dict().items()}


class TPStrategy(DistributedStrategy):
    name = "tp"
    loads_shards = True  # prepare_run builds it weightless; `parallelize` splits it, then fills each rank's slices

    def __init__(self) -> None:
        super().__init__()
        self.mesh = None
        self.sequence_parallel = False
        self.vocab_parallel = False

    @property
    def data_parallel_size(self) -> int:
        return 1  # every rank sees every row

    @property
    def data_parallel_rank(self) -> int:
        return 0

    def setup(self, cfg) -> None:
        refuse_periodic_checkpoints(self.name, cfg)
        super().setup(cfg)
        self.sequence_parallel = cfg.sequence_parallel
        self.vocab_parallel = cfg.vocab_parallel
        if cfg.tp_size not in (None, self.world_size):
            raise ValueError(f"strategy 'tp' splits over all {self.world_size} ranks: tp_size={cfg.tp_size} "
                             "needs strategy fsdp_tp (tensor parallelism inside groups, FSDP across them)")
        self.mesh = init_device_mesh("cuda" if self.backend == "nccl" else "cpu", (self.world_size,),
                                     mesh_dim_names=("tp",))

    def split(self, model: torch.nn.Module, cfg) -> None:
        apply_tp_plan(model, self.mesh, self.sequence_parallel, self.vocab_parallel)

    def loss_context(self):
        """Where the loss is computed from logit slices (`vocab_parallel`), its forward and its backward both run
        under torch's loss_parallel(); otherwise nothing."""
        return loss_parallel() if self.vocab_parallel else contextlib.nullcontext()

    def sync_context(self, model: torch.nn.Module, sync: bool):
        return self.loss_context()  # one micro-step: forward and backward (no gradient sync to skip: one replica)

    def evaluate(self, model, data, choice, batch_size: int = 8) -> float:
        with self.loss_context():
            return super().evaluate(model, data, choice, batch_size)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor  # one data-parallel replica: every rank already holds the whole step's counts and loss

    def make_optimizer(self, model, lr: float, weight_decay: float, fused: bool = False):
        return per_tensor_adamw(model, lr, weight_decay)

    def optimizer_step(self, model, optimizer, scheduler, max_grad_norm: float) -> float:
        return clip_and_step(model, optimizer, scheduler, max_grad_norm, self.meter)

    def save_model(self, model: torch.nn.Module, path: Path, tokenizer=None) -> None:
        full = full_state(model)  # collective: every rank gathers
        if self.is_main:
            save_consolidated(model, full, path, tokenizer)
        self.barrier()


def sum_partial_gradients(model: torch.nn.Module) -> None:
    """Under sequence parallelism a norm's weight (replicated) meets only this rank's tokens, so its gradient
    comes back as a partial sum (placement Partial): summed here, once per step, before the norm and the update
    read it (an all-reduce of `hidden` values per norm)."""
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(g.device_mesh, p.placements)


def global_grad_norm(model: torch.nn.Module) -> float:
    """The gradient norm of the whole model from each rank's own elements and one all-reduce of a scalar
    (gathering the sliced gradients instead would move the whole model's gradient every step). An element
    held on several ranks (a whole tensor, or a DTensor replicated along a mesh dimension) counts once:
    its square is divided by the number of ranks that hold it."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    total, device = torch.zeros((), dtype=torch.float64), "cpu"
    for p in model.parameters():
        if p.grad is None:
            continue
        g, device = p.grad, p.grad.device
        if isinstance(g, DTensor):
            copies = math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if pl.is_replicate())
            copies *= world // g.device_mesh.size()  # ranks outside the tensor's mesh hold it too
            g = g.to_local()
        else:
            copies = world
        total += g.detach().double().pow(2).sum().cpu() / copies
    if world > 1:
        total = total.to(device)  # NCCL reduces CUDA tensors only
        dist.all_reduce(total)
    return float(total) ** 0.5
