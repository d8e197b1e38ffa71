"""Periodic checkpoints that a killed run can resume from without losing anything they hold.

Layout: <output_dir>/checkpoints/step-00000012/ with the trained weights, optimizer, scheduler,
batch position, the step log so far, one RNG file per rank, the run's fingerprint, and COMPLETE
written last. Writing goes to a hidden temporary folder that is renamed into place only when every
rank has written its part, so a crash mid-write leaves the previous checkpoint as the newest complete one.

The fingerprint (`fingerprint`) names everything that changes what the run computes: the model, the
data files' contents, the optimizer, schedule and batch settings, and the world layout. A run resumes a
checkpoint only when its own fingerprint is the same (`check_resume`); otherwise it stops with one line
naming the fields that differ, since continuing would train at the old run's schedule, or not at all,
while recording the new settings. `resume: force` continues anyway and the run's metadata says so."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from distlab import faults
from distlab.config import TrainConfig
from distlab.jsonio import strict_json
from distlab.safe_load import load_tensors

COMPLETE = "COMPLETE"
FINGERPRINT = "fingerprint.json"

# TrainConfig fields that leave every step's numbers as they are: where things run, what is measured or
# written, how often, and memory-for-time trades (recomputation, resharding, offload, the order a pipeline
# schedule runs the same micro-batches in). Every other field is in the fingerprint: a field added later
# is compared unless it is named here. The batch fields and data files enter it resolved (below).
NOT_IN_FINGERPRINT = frozenset({
    "device", "num_threads", "collective_timeout_s", "measure_comm", "measure_state", "activation_checkpointing",
    "fsdp_reshard_after_forward", "zero_offload_optimizer", "fsdp_cpu_offload", "pipeline_schedule", "checkpoint_steps",
    "keep_checkpoints", "resume", "output_dir", "logging_steps", "eval_at_start", "eval_at_end", "save_model",
    "progress", "train_file", "eval_file", "micro_batch_size", "grad_accum", "global_batch_size"})
# How the saved state is cut between ranks: a checkpoint of another layout cannot be loaded, forced or not.
LAYOUT = ("world_size", "data_parallel_size", "pipeline_stages")
_DEFAULTS = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
             for f in dataclasses.fields(TrainConfig)}


class ResumeMismatch(ValueError):
    """The output folder's newest checkpoint was written by a run with other settings (or records none)."""


def file_digest(path: str | Path | None, length: int = 16) -> str | None:
    """sha256 of a file's bytes (its first `length` hex digits, 64 for all): the same data under another name is
    the same data."""
    if path is None:
        return None
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:length]


def _model_identity(model: str | None) -> dict[str, Any]:
    """The model's name; for a local folder also its config's digest (a folder overwritten by another model)."""
    name = model or "distlab-tiny"
    config = Path(name).expanduser() / "config.json"
    return {"model": name, "model_config": file_digest(config) if config.is_file() else None}


def fingerprint(cfg: TrainConfig, world_size: int, data_parallel_size: int, pipeline_stages: int,
                grad_accum: int) -> dict[str, Any]:
    """Everything that changes what a run computes, as JSON values: the fields of `cfg` not in
    NOT_IN_FINGERPRINT, the model's identity, the data files' digests, the batch as it resolves on this world
    (micro batch x accumulation x data-parallel ranks: a global_batch_size and the grad_accum it implies are
    the same run) and the world layout."""
    values = {k: v for k, v in cfg.to_dict().items() if k not in NOT_IN_FINGERPRINT}
    if cfg.epochs is not None:  # epochs decide the step count: max_steps is not used, whatever it says
        values.pop("max_steps")
    values.update(_model_identity(cfg.model))
    values.update(train_data=file_digest(cfg.train_file), eval_data=file_digest(cfg.eval_file),
                  micro_batch_size=cfg.micro_batch_size, grad_accum=grad_accum,
                  global_batch_size=cfg.micro_batch_size * grad_accum * data_parallel_size,
                  world_size=world_size, data_parallel_size=data_parallel_size, pipeline_stages=pipeline_stages)
    return json.loads(strict_json(values))  # tuples as lists: compared as they will read back


def _step(path: Path) -> int:
    return int(path.name.split("-")[1])


def check_resume(path: Path, current: dict[str, Any], max_steps: int | None, force: bool = False) -> list[str]:
    """Whether this run may resume checkpoint `path`: the fields its fingerprint differs in from `current`
    (empty: the same run). ResumeMismatch, one line, when any differ (unless `force`), when it records no
    fingerprint (unless `force`), and always when the world layout differs or nothing is left to train
    (`max_steps` None: not known yet, a run counted in epochs checks with check_steps_left once it is)."""
    output_dir, step = path.parent.parent, _step(path)
    again = "use a new output_dir, or --set resume=force to continue it anyway"
    try:
        saved = json.loads((path / FINGERPRINT).read_text())
    except FileNotFoundError:
        if not force:
            raise ResumeMismatch(f"{output_dir}: the checkpoint at step {step} records no fingerprint of the run "
                                 f"that wrote it (written before distlab checked one); {again}") from None
        saved = None
    differ = ["fingerprint"] if saved is None else sorted(
        k for k in current.keys() | saved.keys() if saved.get(k, _DEFAULTS.get(k)) != current.get(k))
    if differ and not force:
        changes = ", ".join(f"{k} {_show(saved.get(k, _DEFAULTS.get(k)))} -> {_show(current.get(k))}" for k in differ)
        raise ResumeMismatch(f"{output_dir}: the checkpoint at step {step} was written by another run: {changes}; "
                             f"{again}")
    layout = [k for k in LAYOUT if saved is not None and k in differ]
    if layout:
        raise ResumeMismatch(f"{output_dir}: the checkpoint at step {step} was written with "
                             + ", ".join(f"{k} {saved.get(k)}" for k in layout)
                             + f", this run has {', '.join(f'{k} {current.get(k)}' for k in layout)}: its saved "
                             f"state and batch position are cut for that layout, even with resume=force; "
                             f"use a new output_dir")
    if max_steps is not None:
        check_steps_left(path, max_steps)
    return differ


def check_steps_left(path: Path, max_steps: int) -> None:
    """ResumeMismatch, one line, when checkpoint `path` is already at or past the run's last step."""
    output_dir, step = path.parent.parent, _step(path)
    if step >= max_steps:
        raise ResumeMismatch(f"{output_dir}: the checkpoint is at step {step} and the run has {max_steps} steps: "
                             f"nothing left to train; use a new output_dir, or more steps (max_steps or epochs)")


def _show(value: Any) -> str:
    return "(none)" if value is None else str(value)


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


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (most often: the disk is full). The partial folder is gone, the
    previous checkpoint is kept, and the message names the folder and the bytes the checkpoint needs."""


# Room kept free beyond the checkpoint's own bytes: the step log, the RNG files, and file system overhead.
SPACE_MARGIN = 1.1


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _local_tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors this rank holds in `obj` (a DTensor counts its local shard: what this rank writes)."""
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(_local_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_local_tensor_bytes(v) for v in obj)
    return 0


def bytes_to_write(output_dir: str | Path, strategy, model, optimizer) -> int:
    """What this rank's part of the next checkpoint needs on disk: the size of the previous checkpoint when
    there is one (the main rank; measured, the same state again), else the trained weights and optimizer
    state this rank writes (all of it on the main rank of a replicated strategy, its shard under a sharded
    one). Each rank's share is checked where it writes; on a shared file system the first checkpoint's
    total is not, and a save that runs out of space is cleaned up (`save`)."""
    previous = latest(output_dir)
    if previous is not None and strategy.is_main:
        return folder_bytes(previous)
    if not (strategy.is_main or strategy.shards_checkpoint):
        return 0
    trained = sum(_local_tensor_bytes(p) for p in model.parameters() if p.requires_grad)
    return trained + _local_tensor_bytes(getattr(optimizer, "state", {}))


def _space_problem(root: Path, needed: int) -> str | None:
    existing = root if root.exists() else root.parent
    while not existing.exists():  # the output folder may not exist yet on a first save
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if free >= needed * SPACE_MARGIN:
        return None
    return f"{free} bytes free, the checkpoint needs about {needed}"


def save(output_dir: str | Path, step: int, strategy, model, optimizer, scheduler, batches,
         log_path: Path | None, keep: int, run_fingerprint: dict[str, Any]) -> Path:
    """Every rank calls this; the strategy decides who writes the weights and optimizer.

    Before writing, every rank checks the free space for its part (`bytes_to_write`); if any rank is
    short, or any rank's write fails (a full disk shows as OSError, or torch's RuntimeError "unexpected
    pos"), every rank raises CheckpointWriteError together, after the main rank removed the partial folder:
    the previous checkpoint stays the newest complete one, and no space is held by half a checkpoint."""
    root = checkpoint_dir(output_dir)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}"
    needed = bytes_to_write(output_dir, strategy, model, optimizer)
    short = _space_problem(root, needed) if needed else None
    if strategy.any_rank(short is not None):
        raise CheckpointWriteError(f"{tmp}: not written, "
                                   + (short or "another rank has too little space for its part")
                                   + "; the previous checkpoint is kept: free some space (or use an output_dir "
                                     "on a larger disk) and run again to resume")
    failure = None
    try:
        if strategy.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        strategy.barrier()
        strategy.save_training_state(model, optimizer, tmp)
        torch.save(rng_state(), tmp / f"rng_rank{strategy.rank}.pt")
        faults.during_checkpoint(step, strategy.rank, output_dir)
        if strategy.is_main:
            torch.save({"step": step, "scheduler": scheduler.state_dict(), "batches": batches.state_dict(),
                        "world_size": strategy.world_size}, tmp / "trainer.pt")
            (tmp / FINGERPRINT).write_text(strict_json(run_fingerprint, indent=1, sort_keys=True) + "\n")
            if log_path is not None and log_path.exists():
                shutil.copy2(log_path, tmp / "train_log.jsonl")
    except BaseException as e:
        # ENOSPC is an OSError; torch.save reports it as RuntimeError "[enforce fail at inline_container.cc]
        # unexpected pos"; torch DCP gathers every rank's failure into a CheckpointException (a BaseException)
        if not (isinstance(e, (OSError, RuntimeError)) or type(e).__name__ == "CheckpointException"):
            raise
        failure = " ".join(str(e).split())[:200]
    if strategy.any_rank(failure is not None):
        free_then = _free_now(root)  # before the partial folder is removed: what the write ran into
        if strategy.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        strategy.barrier()
        said = failure or "another rank's part failed"
        full = (f": the file system was full ({free_then} bytes free)"
                if isinstance(free_then, int) and free_then < needed else "")
        raise CheckpointWriteError(f"{tmp}: writing the checkpoint of step {step} failed ({said}){full}; the "
                                   f"partial folder is removed and the previous checkpoint kept; the checkpoint "
                                   f"needs about {needed} bytes on this rank: free some space and run again to "
                                   f"resume")
    if strategy.is_main:
        (tmp / COMPLETE).write_text(f"{step}\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in complete_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    strategy.barrier()
    return final


def _free_now(root: Path) -> int | str:
    try:
        return shutil.disk_usage(root).free
    except OSError:
        return "?"


def load(path: Path, strategy, model, optimizer, scheduler, batches) -> tuple[int, Path]:
    """Restore everything `save` wrote; returns (step, the checkpoint's copy of the step log)."""
    # tensors and plain data only (the scheduler, batch position and RNG states are): a file that names
    # anything else is refused before it can run code
    meta = load_tensors(path / "trainer.pt")
    if meta["world_size"] != strategy.world_size:
        raise ResumeMismatch(f"{path}: written with world size {meta['world_size']}, resuming with "
                             f"{strategy.world_size}; the batch position would not carry over")
    strategy.load_training_state(model, optimizer, path)
    scheduler.load_state_dict(meta["scheduler"])
    batches.load_state_dict(meta["batches"])
    set_rng_state(load_tensors(path / f"rng_rank{strategy.rank}.pt"))
    return meta["step"], path / "train_log.jsonl"


def clean_partial(output_dir: str | Path) -> None:
    """Remove temporary folders a crash left behind (main rank only)."""
    for tmp in checkpoint_dir(output_dir).glob(".tmp-step-*"):
        shutil.rmtree(tmp, ignore_errors=True)
