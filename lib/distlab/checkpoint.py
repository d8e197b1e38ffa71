"""Periodic checkpoints that a killed run can resume from without losing anything they hold.

Layout: <output_dir>/checkpoints/step-00000012/ with the trained weights, optimizer, scheduler,
batch position, the step log so far, one RNG file per rank, and COMPLETE written last. Writing
goes to a hidden temporary folder that is renamed into place only when every rank has written
its part, so a crash mid-write leaves the previous checkpoint as the newest complete one."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import torch

from distlab import faults

COMPLETE = "COMPLETE"


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    root = checkpoint_dir(output_dir)
    if not root.exists():
        return []
    done = [p for p in root.glob("step-*") if (p / COMPLETE).exists()]
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


def latest(output_dir: str | Path) -> Path | None:
    done = complete_checkpoints(output_dir)
    return done[-1] if done else None


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(output_dir: str | Path, step: int, strategy, model, optimizer, scheduler, batches,
         log_path: Path | None, keep: int) -> Path:
    """Every rank calls this; the strategy decides who writes the weights and optimizer."""
    root = checkpoint_dir(output_dir)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}"
    if strategy.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    strategy.barrier()
    strategy.save_training_state(model, optimizer, tmp)
    torch.save(rng_state(), tmp / f"rng_rank{strategy.rank}.pt")
    faults.during_checkpoint(step, strategy.rank)
    if strategy.is_main:
        torch.save({"step": step, "scheduler": scheduler.state_dict(), "batches": batches.state_dict(),
                    "world_size": strategy.world_size}, tmp / "trainer.pt")
        if log_path is not None and log_path.exists():
            shutil.copy2(log_path, tmp / "train_log.jsonl")
    strategy.barrier()
    if strategy.is_main:
        (tmp / COMPLETE).write_text(f"{step}\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in complete_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    strategy.barrier()
    return final


def load(path: Path, strategy, model, optimizer, scheduler, batches) -> tuple[int, Path]:
    """Restore everything `save` wrote; returns (step, the checkpoint's copy of the step log)."""
    meta = torch.load(path / "trainer.pt", weights_only=False)
    if meta["world_size"] != strategy.world_size:
        raise RuntimeError(f"{path}: written with world size {meta['world_size']}, resuming with "
                           f"{strategy.world_size}; the batch position would not carry over")
    strategy.load_training_state(model, optimizer, path)
    scheduler.load_state_dict(meta["scheduler"])
    batches.load_state_dict(meta["batches"])
    set_rng_state(torch.load(path / f"rng_rank{strategy.rank}.pt", weights_only=False))
    return meta["step"], path / "train_log.jsonl"


def clean_partial(output_dir: str | Path) -> None:
    """Remove temporary folders a crash left behind (main rank only)."""
    for tmp in checkpoint_dir(output_dir).glob(".tmp-step-*"):
        shutil.rmtree(tmp, ignore_errors=True)
