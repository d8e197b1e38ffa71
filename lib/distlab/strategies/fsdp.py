"""FSDP2 (`torch.distributed.fsdp.fully_shard`): every rank keeps only a shard of each weight,
its gradient and its optimizer state, and gathers whole layers just in time.

What changes against DDP: instead of one wrapper that all-reduces gradients, `fully_shard` is
applied to each decoder layer and then to the root module (embedding, final norm, LM head: tied
in the tiny model, one parameter, sharded once by the root). Each parameter becomes a DTensor cut
on dim 0 over a 1-D device mesh of all ranks. Forward all-gathers one layer's weights, runs it and
frees them again; backward all-gathers them once more and reduce-scatters the gradients, so each
rank ends the step with the gradient shard of its own weight shard and updates only that.

On GPUs with bf16 autocast, a MixedPrecisionPolicy gathers the weights in bf16 and reduces the
gradients in fp32; on CPU (fp32) there is no policy. Accumulation uses
`set_requires_gradient_sync(False)` (FSDP2's `no_sync`): gradients of non-final micro-steps stay
unsharded and local, and the final micro-step reduce-scatters their sum. Checkpoints are sharded
(`torch.distributed.checkpoint`: every rank writes its own shard); `save_model` gathers a full
state dict on rank 0 and writes a normal adapter or model folder that `from_pretrained` loads.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..device import DeviceChoice, autocast
from .ddp import DistributedStrategy

# Collectives whose time counts as communication. FSDP2 calls the first two, DeepSpeed most of the
# others; looked up on `torch.distributed` at call time by both, so wrapping them there sees them.
TIMED_COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
                     "all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_reduce_coalesced",
                     "all_gather_coalesced", "_all_gather_base", "_reduce_scatter_base", "reduce")


class CollectiveTimer:
    """Times every torch.distributed collective of this process, for the communication share.

    FSDP2 and DeepSpeed issue their all-gathers and reduce-scatters asynchronously and wait for them
    later; the wall time of an asynchronous call says nothing. While installed, each collective is
    waited for as soon as it is issued and timed, so communication and compute are serialised and
    the split is exact (the step gets a little slower: the same trade-off as DDP's CommTimer in
    chapter 02). The work handle returned is already complete, so its later wait() is free.
    `paused()` leaves out the training loop's own bookkeeping all-reduces (token counts, loss)."""

    def __init__(self) -> None:
        self.seconds, self.bytes, self.calls = 0.0, 0, 0
        self._originals: dict[str, object] = {}
        self._paused = 0

    def install(self) -> CollectiveTimer:
        for name in TIMED_COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None or name in self._originals:
                continue
            self._originals[name] = fn
            setattr(dist, name, self._wrap(fn))
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
            timer.bytes += _payload_bytes(args, kwargs)
            return work

        return timed

    def take(self) -> tuple[float, int]:
        out = (self.seconds, self.bytes)
        self.seconds, self.bytes, self.calls = 0.0, 0, 0
        return out


def _payload_bytes(args, kwargs) -> int:
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


@torch.no_grad()
def evaluate_in_lockstep(strategy, model, data, choice: DeviceChoice, batch_size: int = 8, cast=None) -> float:
    """Token-weighted held-out loss like Strategy.evaluate, for strategies whose forward pass is
    collective (FSDP2 and ZeRO-3 all-gather each layer's weights): every rank must run the same
    number of forward passes, so a rank whose share of rows is a batch shorter runs one more on a
    stand-in batch whose loss is not counted. `cast(choice)` gives the forward's autocast context."""
    from ..data import model_inputs

    cast = cast or autocast
    was_training = model.training
    model.eval()
    rows = list(range(strategy.data_parallel_rank, len(data), strategy.data_parallel_size))
    most = math.ceil(len(data) / strategy.data_parallel_size)  # rank 0 has the most rows
    totals = torch.zeros(2, dtype=torch.float64)
    for i in range(0, most, batch_size):
        chunk = rows[i:i + batch_size]
        batch = data.batch(chunk or [0])
        with cast(choice):
            loss = float(model(**model_inputs(batch, choice.device)))
        if chunk:
            totals += torch.tensor([loss, batch["n_label_tokens"]], dtype=torch.float64)
    totals = strategy.all_reduce_sum(totals.to(choice.device)).cpu()
    model.train(was_training)
    return float(totals[0] / totals[1])


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a distlab CausalLMWithLoss (under a PEFT wrapper or not)."""
    layers = getattr(model.causal_lm.get_decoder(), "layers", None)
    if layers is None:
        raise TypeError(f"{type(model.causal_lm).__name__}: no decoder `.layers` to shard layer by layer")
    return list(layers)


class CollectiveTimedStrategy(DistributedStrategy):
    """A multi-rank strategy whose collectives CollectiveTimer times when `measure_comm` is on
    (FSDP2 and ZeRO); the loop's own bookkeeping all-reduces are left out of the count."""

    def __init__(self) -> None:
        super().__init__()
        self.timer: CollectiveTimer | None = None

    def start_timer(self, cfg) -> None:
        if cfg.measure_comm:
            self.timer = CollectiveTimer().install()

    def teardown(self, keep_group: bool = False) -> None:
        if self.timer is not None:
            self.timer.uninstall()
            self.timer = None
        super().teardown(keep_group)

    def comm_stats(self) -> dict[str, float]:
        if self.timer is None:
            return {}
        seconds, nbytes = self.timer.take()
        return {"comm_time_s": seconds, "comm_bytes": nbytes}

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        with self.timer.paused() if self.timer is not None else contextlib.nullcontext():
            return super().all_reduce_sum(tensor)


class FSDPStrategy(CollectiveTimedStrategy):
    name = "fsdp"

    def __init__(self) -> None:
        super().__init__()
        self.cfg = None
        self.mesh = None
        self.measured_state = None  # memory.MemoryBreakdown of the last step, with cfg.measure_state

    def setup(self, cfg) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        super().setup(cfg)
        self.cfg = cfg
        device_type = "cuda" if self.backend == "nccl" else "cpu"
        self.mesh = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("dp",))
        self.start_timer(cfg)

    def mixed_precision(self, choice: DeviceChoice):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if choice.autocast_dtype is None:
            return MixedPrecisionPolicy()  # fp32 (CPU): gather and reduce in the weights' dtype
        return MixedPrecisionPolicy(param_dtype=choice.autocast_dtype, reduce_dtype=torch.float32)

    def wrap_model(self, model: torch.nn.Module, choice: DeviceChoice) -> torch.nn.Module:
        from torch.distributed.fsdp import fully_shard

        model = model.to(choice.device)
        mp = self.mixed_precision(choice)
        reshard = self.cfg.fsdp_reshard_after_forward if self.cfg is not None else True
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=self.mesh, reshard_after_forward=reshard, mp_policy=mp)
        # The root takes everything not in a layer: embedding, final norm and LM head (the same
        # tensor when tied, so it is sharded once). The root keeps its weights gathered between
        # forward and backward (FSDP2's default for the root): backward needs them first.
        fully_shard(model, mesh=self.mesh, mp_policy=mp)
        return model

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # fully_shard changes the module's class in place; there is no wrapper

    def sync_context(self, model, sync: bool):
        if sync:
            return contextlib.nullcontext()
        return _no_gradient_sync(model)

    def evaluate(self, model, data, choice: DeviceChoice, batch_size: int = 8) -> float:
        return evaluate_in_lockstep(self, model, data, choice, batch_size)

    def step(self, model, optimizer, scheduler, max_grad_norm: float) -> float:
        params = [p for p in model.parameters() if p.requires_grad]
        # On DTensors the norm is computed shard by shard and all-reduced: the global norm.
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        optimizer.step()
        if self.cfg is not None and self.cfg.measure_state:
            from ..memory import measure_owned_state

            self.measured_state = measure_owned_state(model, optimizer)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    # --- saving
    def _state_options(self, **kw):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # LoRA: the frozen base weights never change, the checkpoint holds only what is trained.
        return StateDictOptions(ignore_frozen_params=bool(self.cfg and self.cfg.lora), **kw)

    def save_training_state(self, model, optimizer, path: Path) -> None:
        """Sharded: every rank writes its own shards of the trained weights and optimizer state."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer, options=self._state_options())
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path / "dcp"))

    def load_training_state(self, model, optimizer, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_state_dict,
            set_state_dict,
        )

        model_sd, optim_sd = get_state_dict(model, optimizer, options=self._state_options())
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=str(path / "dcp"))  # fills the shards in place, with resharding
        # LoRA: the state holds only the trained tensors (dcp.load checked each one was in the
        # checkpoint); non-strict so the frozen base weights, left out on purpose, are not "missing".
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=self._state_options(strict=not (self.cfg and self.cfg.lora)))

    def save_model(self, model: torch.nn.Module, path: Path, tokenizer=None) -> None:
        """A consolidated adapter (LoRA) or model folder, written by rank 0 from a gathered state dict."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        # LoRA: gather only the adapters (the frozen base model is the one from_pretrained already has)
        lora = bool(self.cfg and self.cfg.lora)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                   ignore_frozen_params=lora))
        if self.is_main:
            save_consolidated(model, full, path, tokenizer)
        self.barrier()


@contextlib.contextmanager
def _no_gradient_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def save_consolidated(model: torch.nn.Module, full_state: dict, path: Path, tokenizer=None) -> None:
    """Write a CausalLMWithLoss's full state dict (keys "lm.<...>") the way `save_pretrained` does
    for the unsharded model: PEFT keeps only the adapter weights, transformers the whole model."""
    prefix = "lm."
    state = {k[len(prefix):]: v for k, v in full_state.items() if k.startswith(prefix)}
    path = Path(path)
    model.lm.save_pretrained(path, state_dict=state)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
