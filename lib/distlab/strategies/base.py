"""The strategy interface: the hooks distlab.train's one loop calls, and what strategies share.

The loop, per optimizer step:

    loss, grad_norm = strategy.train_step(model, micro_batches, choice, label_tokens, optimizer, scheduler, clip)

`train_step` is the whole step. By default it is `forward_backward` (every micro-batch, gradient
sync on the last one only) followed by `optimizer_step` (clip, step, schedule, zero the grads);
a strategy whose engine runs the step itself (DeepSpeed's pipeline engine: forward, backward and
optimizer inside `train_batch`) overrides `train_step` and nothing else of it.

Before the first step, `prepare` hands the model to `parallelize`: the one order in which every strategy's
model is transformed (its pipeline stage kept, placed, split by tensor parallelism, compiled, sharded by FSDP,
filled, given its optimizer, wrapped), each step with why it comes there. A strategy supplies only its own
steps, by overriding the hook of that name (`keep_stage`, `split`, `shard`, `wrap`).

Measurement never lives here: the loop hands every strategy a meter (distlab.measure.meter) and a
strategy calls it at one place, where its communication starts (`self.meter.watch_...`) and,
once, where gradients and optimizer state both exist (`self.meter.state_point`). With
measurement off the meter does nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distlab import compat, sharded_load
from distlab.data import SFTData, model_inputs
from distlab.device import DeviceChoice, autocast, backend_for
from distlab.master_weights import make_master_weight_optimizer
from distlab.measure.meter import NULL_METER, Meter
from distlab.models import whole_shape
from distlab.safe_load import load_tensors
from distlab.schedule import cosine_with_warmup


def compile_layers(model: torch.nn.Module) -> int:
    """torch.compile every transformer block in place; the number compiled.

    Compiling block by block (as torchtitan does) rather than the whole model keeps compile time
    to one block's graph, which every identical block then reuses, and leaves the loss and anything
    that reads the host in eager mode. Each block compiles whole (`fullgraph`): its document boundaries come
    in as a tensor of varying length (distlab.lm_loss.run_layers), never as values read on the host."""
    blocks = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if os.environ.get("DISTLAB_COMPILE_STRICT") == "1":
        # a recompile after the first compile is an error, raised at once with its reason (the MFU ladder's
        # compile rungs: a batch that recompiled would otherwise spend the rung's time box compiling)
        compat.fail_on_recompile()
    for block in blocks:
        # fullgraph: a graph break is an error, not a silent split of the block into eager pieces
        block.compile(fullgraph=True)
    return len(blocks)


class Strategy:
    """Hooks the training loop calls. Subclasses override what their parallelism changes."""

    name = "base"
    # Whether every rank writes its own part of a checkpoint (sharded state), or only the main rank
    # (replicated state): what a rank checks free space for before a save.
    shards_checkpoint = False

    def __init__(self) -> None:
        self.rank, self.world_size, self.local_rank = 0, 1, 0
        self.meter: Meter = NULL_METER
        self.transforms: list[str] = []  # the steps `parallelize` took, in order

    # --- process group
    def setup(self, cfg) -> None:
        """Join the process group (no-op on one device)."""

    def teardown(self, keep_group: bool = False) -> None:
        """Release what setup took; `keep_group` leaves the process group up for the next run
        of a sweep (`python -m distlab.train --variant ...`)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_parallel_size(self) -> int:
        """How many ranks see different data (the loss is normalised over all of them)."""
        return self.world_size

    @property
    def data_parallel_rank(self) -> int:
        return self.rank

    # --- loading (distlab.prepare.prepare_run asks)
    # Whether the strategy shards a weightless (meta) model itself and then reads only each rank's part of
    # the weights (distlab.sharded_load.fill, in `parallelize`): fsdp, tp and fsdp_tp. The others load whole.
    loads_shards = False

    def load_context(self, cfg, choice: DeviceChoice):
        """The context a whole model is loaded in (ZeRO-3: partitioned over the ranks as it loads)."""
        return contextlib.nullcontext()

    # --- model and optimizer: `parallelize` applies the steps in its order; a strategy overrides its own
    placed_as_loaded = False  # whether loading put the weights where they train (ZeRO-3's partitions)
    compiles_layers = True  # whether `compile=true` compiles this strategy's decoder layers

    def prepare(self, model: torch.nn.Module, choice: DeviceChoice, cfg):
        """(model, optimizer, scheduler) ready to train: `parallelize`, with this strategy's steps."""
        return parallelize(model, self, cfg, choice)

    def keep_stage(self, model: torch.nn.Module, choice: DeviceChoice, cfg) -> torch.nn.Module:
        """A pipeline rank's cut: only this rank's stage of the model, the other stages' parts dropped."""
        return model

    def split(self, model: torch.nn.Module, cfg) -> None:
        """Tensor parallelism's cut (in place): each decoder layer's projections split over a mesh."""

    def shard(self, model: torch.nn.Module, choice: DeviceChoice, cfg) -> None:
        """FSDP's cut (in place): every weight sharded over a mesh, layer by layer, then the root."""

    def fill_device(self, choice: DeviceChoice, cfg) -> torch.device | str:
        """Where a weightless model's parts are allocated and read (distlab.sharded_load.fill)."""
        return choice.device

    def trained_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module whose trainable parameters the optimizer steps (a pipeline rank: its stage)."""
        return model

    def optimizer_options(self, cfg) -> dict:
        """What the config asks of make_optimizer besides the learning rate and the decay."""
        kind = getattr(cfg, "optimizer", "adamw")
        return {"fused": getattr(cfg, "fused_optimizer", False), **({"kind": kind} if kind != "adamw" else {}),
                **({"master_weights": True} if getattr(cfg, "master_weights", False) else {})}

    def wrap(self, model: torch.nn.Module, optimizer, scheduler, choice: DeviceChoice, cfg):
        """What runs the training around the model: DDP's wrapper, DeepSpeed's engine, a pipeline's schedule.
        Returns (model, optimizer, scheduler) as the loop holds them."""
        return model, optimizer, scheduler

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def make_optimizer(self, model: torch.nn.Module, lr: float, weight_decay: float,
                       fused: bool = False, kind: str = "adamw", master_weights: bool = False) -> torch.optim.Optimizer:
        """AdamW over trainable weights; no decay on vectors (norms, biases), as is standard.

        `fused`: one kernel updates every tensor (CUDA); the default launches a few per tensor group.
        `kind`: "adamw" (torch), "adamw_8bit" or "paged_adamw_8bit" (bitsandbytes: blockwise 8-bit moments;
        paged state lives in CUDA unified memory, and on a CPU is ordinary host memory).
        `master_weights`: bf16 weights, AdamW stepping fp32 copies of them (distlab.master_weights)."""
        params = [p for p in model.parameters() if p.requires_grad]
        decay = [p for p in params if len(whole_shape(p)) >= 2]  # whole_shape: ZeRO-3 partitions at load
        no_decay = [p for p in params if len(whole_shape(p)) < 2]
        groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        if master_weights:
            return make_master_weight_optimizer(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                                **({"fused": True} if fused else {}))
        if kind != "adamw":
            import bitsandbytes as bnb  # deferred: only the 8-bit optimizers need it

            cls = {"adamw_8bit": bnb.optim.AdamW8bit, "paged_adamw_8bit": bnb.optim.PagedAdamW8bit}[kind]
            return cls(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, **({"fused": True} if fused else {}))

    # --- one optimizer step
    def train_step(self, model, micro_batches: list[dict[str, Any]], choice: DeviceChoice, global_label_tokens: int,
                   optimizer, scheduler, max_grad_norm: float) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        """One whole optimizer step: (this rank's share of the step loss, gradient norm before clipping).

        Both stay where they were computed (tensors on the device, for the strategies here): the loop reads
        them on the host at logging steps only, so a step never waits for the device to catch up."""
        local_loss = self.forward_backward(model, micro_batches, choice, global_label_tokens)
        return local_loss, self.optimizer_step(model, optimizer, scheduler, max_grad_norm)

    def forward_backward(self, model, micro_batches: list[dict[str, Any]], choice: DeviceChoice,
                         global_label_tokens: int) -> torch.Tensor:
        """All micro-steps of one optimizer step; returns this rank's share of the step loss (on the device).

        Each micro-batch's summed loss is divided by the global label-token count, then multiplied
        by the data-parallel size because gradient sync averages over ranks. The model is a
        distlab.lm_loss.CausalLMWithLoss (possibly wrapped): its forward returns the summed loss."""
        scale = self.data_parallel_size / global_label_tokens
        local = torch.zeros((), dtype=torch.float64, device=choice.device)
        for i, batch in enumerate(micro_batches):
            with self.sync_context(model, sync=(i == len(micro_batches) - 1)):
                with self.forward_context(choice):
                    loss_sum = model(**model_inputs(batch, choice.device))
                (loss_sum * scale).backward()
            local += loss_sum.detach().double() / global_label_tokens  # summed on the device: no read per micro-step
        return local

    def sync_context(self, model: torch.nn.Module, sync: bool):
        """Context for one micro-step; `sync=False` lets data parallelism skip the gradient sync."""
        return contextlib.nullcontext()

    def optimizer_step(self, model, optimizer, scheduler, max_grad_norm: float) -> torch.Tensor | float:
        """Clip to the global gradient norm, step, schedule, zero the grads; return the norm before clipping
        (a tensor on the device: clipping scales by it there, and nothing here reads it)."""
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
        grad_norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).detach()  # a DTensor under FSDP2
        optimizer.step()
        self.meter.state_point(model, optimizer)  # gradients and AdamW moments both exist here
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return grad_norm

    @torch.no_grad()
    def evaluate(self, model, data: SFTData, choice: DeviceChoice, batch_size: int = 8) -> float:
        """Token-weighted mean loss over held-out rows, each data-parallel rank taking a share.

        Every rank runs as many forward passes as the busiest one: under FSDP2 and ZeRO-3 a forward
        is collective (each layer's weights are gathered), so a rank with a batch fewer runs one
        more on a stand-in batch whose loss is not counted."""
        was_training = model.training
        model.eval()
        rows = list(range(self.data_parallel_rank, len(data), self.data_parallel_size))
        most = math.ceil(len(data) / self.data_parallel_size)  # rank 0 has the most rows
        totals = torch.zeros(2, dtype=torch.float64)
        for i in range(0, most, batch_size):
            chunk = rows[i:i + batch_size]
            batch = data.batch(chunk or [0])
            with self.forward_context(choice):
                loss = float(model(**model_inputs(batch, choice.device)))
            if chunk:
                totals += torch.tensor([loss, batch["n_label_tokens"]], dtype=torch.float64)
        totals = self.all_reduce_sum(totals.to(choice.device)).cpu()
        model.train(was_training)
        return float(totals[0] / totals[1])

    def forward_context(self, choice: DeviceChoice):
        """The autocast a forward runs under (DeepSpeed's bf16 mode holds the model in bf16 itself)."""
        return autocast(choice)

    # --- collectives (identity on one rank)
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        pass

    def world_max(self, value: int) -> int:
        """The largest `value` over every rank of the world (every stage and group, unlike all_reduce_sum): how
        the ranks agree on something only some of them saw, such as a scheduler's signal."""
        return value

    def any_rank(self, flag: bool) -> bool:
        return self.world_max(int(flag)) > 0

    # --- saving
    def save_model(self, model: torch.nn.Module, path: Path, tokenizer=None) -> None:
        """The adapter (LoRA) or the whole model, loadable with from_pretrained."""
        if self.is_main:
            self.unwrap(model).lm.save_pretrained(path)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
        self.barrier()

    def save_training_state(self, model, optimizer, path: Path) -> None:
        """Trained weights and optimizer state for a checkpoint (replicated: the main rank writes)."""
        if self.is_main:
            torch.save({"model": trained_weights(self.unwrap(model)), "optimizer": optimizer.state_dict()},
                       path / "training_state.pt")

    def load_training_state(self, model, optimizer, path: Path) -> None:
        state = load_tensors(path / "training_state.pt")  # tensors and plain data only: a crafted file is refused
        load_trained_weights(self.unwrap(model), state["model"], path)
        optimizer.load_state_dict(state["optimizer"])


def parallelize(model: torch.nn.Module, strategy: Strategy, cfg, choice: DeviceChoice):
    """(model, optimizer, scheduler) ready to train: the order in which every strategy's model is transformed,
    written once, each step with why it comes where it does (as torchtitan's `parallelize` states its own). A
    strategy supplies only its own steps, by overriding the Strategy hook of the step's name; `strategy.transforms`
    lists the steps this run took, in order.

    Before this, distlab.prepare.prepare_run built the model every strategy starts from, in this order:
      load         whole; weightless on meta (`loads_shards`: read in step 6); or partitioned as it loads (ZeRO-3's
                   `load_context`), a quantised (QLoRA) base quantised inside from_pretrained
      quantise     QLoRA's preparation of the 4-bit base (base frozen, norms and embeddings in fp32), before LoRA:
                   it freezes every parameter there is, and the adapters must stay trainable
      checkpoint   activation checkpointing (with QLoRA, set by its preparation): a flag on each decoder layer,
                   whose call then checkpoints itself, so backward recomputes the layer as it runs under every cut
                   and wrapper below (TP's slices, FSDP's gathers); before LoRA, which adapts to it (PEFT makes
                   the embedding's output require grad for a checkpointed model)
      lora         the adapters, before the model goes to meta (drawn from the seeded generator on the CPU: the
                   same values under every strategy) and before every cut below (TP's plan splits lora_A and lora_B
                   with their projection, FSDP shards them with their layer)
      loss         the CausalLMWithLoss every step below transforms
    """
    transforms = []
    weightless = sharded_load.is_pending(model)
    # 1. keep_stage (pipelines): a rank keeps only its own layers first, so that no step below moves, cuts or
    #    compiles a layer another rank holds
    if _supplies(strategy, "keep_stage"):
        model = strategy.keep_stage(model, choice, cfg)
        transforms.append("keep_stage")
    # 2. place: a whole model goes to its device before it is cut, so that TP's DTensors and FSDP's shards are made
    #    where they run; a weightless one stays on meta until step 6, and ZeRO-3's partitions are placed already
    #    (its engine moves the rest)
    if not weightless and not strategy.placed_as_loaded:
        model = model.to(choice.device)
        transforms.append("place")
    # 3. split (tensor parallelism): on the bare decoder layers and before FSDP, so that fully_shard then shards
    #    each TP slice (a DTensor on the "tp" mesh dimension) along "dp", rather than TP cutting FSDP's shards
    if _supplies(strategy, "split"):
        strategy.split(model, cfg)
        transforms.append("split")
    # 4. compile, each decoder layer: after the layer's own transformations (checkpointing, TP) and before the one
    #    that spans layers (FSDP), torchtitan's order, where torch.compile wraps a layer in a new module that
    #    fully_shard must then shard. Here `Module.compile` keeps the layer object and traces at the first
    #    forward, when every step has run: the graph is the layer as it trains.
    if getattr(cfg, "compile", False) and strategy.compiles_layers:
        compile_layers(model)
        transforms.append("compile")
    # 5. shard (FSDP): fully_shard each decoder layer, then the root; the last cut, so that it shards what the
    #    others left (each TP slice, each layer with its adapters), and the root takes what no layer holds
    if _supplies(strategy, "shard"):
        strategy.shard(model, choice, cfg)
        transforms.append("shard")
    # 6. fill: only once every cut is made does a weightless model take memory: each rank allocates and reads from
    #    the files just the part the cuts left it (distlab.sharded_load.fill)
    if weightless:
        sharded_load.fill(model, strategy.fill_device(choice, cfg), log_as=strategy.name, quantise_on=choice.device)
        transforms.append("fill")
    # 7. optimizer and schedule: over the parameters as they train (TP's slices, FSDP's shards, a stage's own), so
    #    after every cut and the fill; before the wrap, since DeepSpeed's engines take the optimizer (the pipeline
    #    engine the schedule too)
    optimizer = strategy.make_optimizer(strategy.trained_module(model), cfg.lr, cfg.weight_decay,
                                        **strategy.optimizer_options(cfg))
    scheduler = cosine_with_warmup(optimizer, cfg.warmup_steps, cfg.max_steps)
    transforms.append("optimizer")
    # 8. wrap: DDP's gradient all-reduce, DeepSpeed's engine, a pipeline's schedule; last, around the model as it
    #    trains (DDP hooks the gradients of the parameters it finds; the engine owns the model and its step)
    if _supplies(strategy, "wrap"):
        model, optimizer, scheduler = strategy.wrap(model, optimizer, scheduler, choice, cfg)
        transforms.append("wrap")
    strategy.transforms = transforms
    return model, optimizer, scheduler


def _supplies(strategy: Strategy, step: str) -> bool:
    """Whether the strategy overrides the Strategy hook `step` (its own step of `parallelize`)."""
    return getattr(type(strategy), step) is not getattr(Strategy, step)


class NeedsLauncherError(ValueError):
    """A multi-rank strategy started as a plain process: a usage error (one line, exit 2), not a crash."""


class DistributedStrategy(Strategy):
    """Process-group plumbing shared by every multi-rank strategy."""

    def setup(self, cfg) -> None:
        if "RANK" not in os.environ:
            raise NeedsLauncherError(f"strategy {self.name!r} needs a launcher: run it under torchrun "
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
        with self.meter.paused():  # the loop's bookkeeping (token counts, loss) is not the strategy's traffic
            dist.all_reduce(tensor)
        return tensor

    def barrier(self) -> None:
        dist.barrier()

    @property
    def collective_device(self) -> torch.device:
        """Where a tensor for the default group's collectives lives: NCCL reduces only GPU tensors."""
        return torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")

    def world_max(self, value: int) -> int:
        vote = torch.tensor([value], dtype=torch.int64, device=self.collective_device)
        with self.meter.paused():  # the loop's bookkeeping, not the strategy's traffic
            dist.all_reduce(vote, op=dist.ReduceOp.MAX)
        return int(vote.item())


def trained_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu() for n, p in module.named_parameters() if p.requires_grad}


def load_trained_weights(module: torch.nn.Module, saved: dict[str, torch.Tensor], path: Path) -> None:
    """Copy a checkpoint's trained weights in place, refusing one that does not match the model."""
    params = dict(module.named_parameters())
    missing = sorted(n for n, p in params.items() if p.requires_grad and n not in saved)
    unexpected = sorted(set(saved) - set(params))
    if missing or unexpected:
        raise RuntimeError(f"{path}: checkpoint does not match the model (missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]})")
    with torch.no_grad():
        for name, tensor in saved.items():
            params[name].copy_(tensor)


def save_consolidated(model: torch.nn.Module, full_state: dict, path: Path, tokenizer=None) -> None:
    """Write a CausalLMWithLoss's gathered state dict (keys "lm.<...>") the way `save_pretrained`
    does for the unsharded model: PEFT keeps only the adapter weights, transformers the whole model."""
    prefix = "lm."
    state = {k[len(prefix):]: v for k, v in full_state.items() if k.startswith(prefix)}
    path = Path(path)
    model.lm.save_pretrained(path, state_dict=state)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
