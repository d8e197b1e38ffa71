"""The strategy interface, and its simplest form: everything on one device."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import torch

from ..data import SFTData, model_inputs
from ..device import DeviceChoice, autocast


def cosine_with_warmup(optimizer, warmup_steps: int, total_steps: int):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class Strategy:
    """Hooks the training loop calls. Subclasses override what their parallelism changes."""

    name = "base"

    def __init__(self) -> None:
        self.rank, self.world_size, self.local_rank = 0, 1, 0

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

    # --- model and optimizer
    def prepare(self, model: torch.nn.Module, choice: DeviceChoice, cfg):
        """(model, optimizer, scheduler) ready to train. Strategies whose engine owns the
        optimizer (DeepSpeed) override this; the others override wrap_model only."""
        model = self.wrap_model(model, choice)
        optimizer = self.make_optimizer(model, cfg.lr, cfg.weight_decay)
        return model, optimizer, cosine_with_warmup(optimizer, cfg.warmup_steps, cfg.max_steps)

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
    def forward_backward(self, model, micro_batches: list[dict[str, Any]], choice: DeviceChoice,
                         global_label_tokens: int) -> float:
        """All micro-steps of one optimizer step; returns this rank's share of the step loss.

        Each micro-batch's summed loss is divided by the global label-token count, then multiplied
        by the data-parallel size because gradient sync averages over ranks. The model is a
        distlab.models.CausalLMWithLoss (possibly wrapped): its forward returns the summed loss."""
        scale = self.data_parallel_size / global_label_tokens
        local = 0.0
        for i, batch in enumerate(micro_batches):
            with self.sync_context(model, sync=(i == len(micro_batches) - 1)):
                with autocast(choice):
                    loss_sum = model(**model_inputs(batch, choice.device))
                self.backward(loss_sum * scale, model)
            local += loss_sum.item() / global_label_tokens
        return local

    @torch.no_grad()
    def evaluate(self, model, data: SFTData, choice: DeviceChoice, batch_size: int = 8) -> float:
        """Token-weighted mean loss over held-out rows (each data-parallel rank takes a share)."""
        was_training = model.training
        model.eval()
        rows = list(range(self.data_parallel_rank, len(data), self.data_parallel_size))
        totals = torch.zeros(2, dtype=torch.float64)
        for i in range(0, len(rows), batch_size):
            batch = data.batch(rows[i:i + batch_size])
            with autocast(choice):
                totals[0] += float(model(**model_inputs(batch, choice.device)))
            totals[1] += batch["n_label_tokens"]
        totals = self.all_reduce_sum(totals.to(choice.device)).cpu()
        model.train(was_training)
        return float(totals[0] / totals[1])

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
