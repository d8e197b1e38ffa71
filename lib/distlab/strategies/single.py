"""The strategy interface, and its simplest form: everything on one device."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from ..device import DeviceChoice


class Strategy:
    """Hooks the training loop calls. Subclasses override what their parallelism changes."""

    name = "base"

    def __init__(self) -> None:
        self.rank, self.world_size, self.local_rank = 0, 1, 0

    # --- process group
    def setup(self, cfg) -> None:
        """Join the process group (no-op on one device)."""

    def teardown(self) -> None:
        pass

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

    # --- model and optimizer
    def wrap_model(self, model: torch.nn.Module, choice: DeviceChoice) -> torch.nn.Module:
        return model.to(choice.device)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def make_optimizer(self, model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        """AdamW over trainable weights; no decay on vectors (norms, biases), as is standard."""
        params = [p for p in model.parameters() if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.999), eps=1e-8)

    # --- one optimizer step
    def sync_context(self, model: torch.nn.Module, sync: bool):
        """Context for one micro-step; `sync=False` lets data parallelism skip the all-reduce."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, model: torch.nn.Module) -> None:
        loss.backward()

    def step(self, model, optimizer, scheduler, max_grad_norm: float) -> float:
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in model.parameters() if p.requires_grad], max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def comm_stats(self) -> dict[str, float]:
        """Communication time and bytes since the last call, where the strategy measures them."""
        return {}

    # --- collectives (identity on one rank)
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        pass

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
            trained = {n: p.detach().cpu() for n, p in self.unwrap(model).named_parameters() if p.requires_grad}
            torch.save({"model": trained, "optimizer": optimizer.state_dict()}, path / "training_state.pt")

    def load_training_state(self, model, optimizer, path: Path) -> None:
        state = torch.load(path / "training_state.pt", map_location="cpu", weights_only=False)
        params = dict(self.unwrap(model).named_parameters())
        missing = sorted(n for n, p in params.items() if p.requires_grad and n not in state["model"])
        unexpected = sorted(set(state["model"]) - set(params))
        if missing or unexpected:
            raise RuntimeError(f"{path}: checkpoint does not match the model (missing {missing[:3]}, "
                               f"unexpected {unexpected[:3]})")
        with torch.no_grad():
            for name, tensor in state["model"].items():
                params[name].copy_(tensor)
        optimizer.load_state_dict(state["optimizer"])


class SingleDevice(Strategy):
    name = "single"
