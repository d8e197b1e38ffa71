"""The one training loop. Strategies (single, ddp, fsdp, zero, pipeline, tp) wrap it; nobody copies it.

    python -m distlab.train --config lib/distlab/configs/tiny_lora.yaml [--set max_steps=50 ...]

Loss normalisation: every optimizer step's loss is the sum of token losses over the whole global
batch (all micro-batches, all ranks) divided by the number of label tokens in that global batch.
That makes a step mathematically the same whatever the world size and accumulation split, which
is what lets later chapters assert that 1 and 2 ranks produce the same loss curve.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from tqdm import tqdm

from distlab import checkpoint, faults, provenance, yaml_input
from distlab.attention import VARLEN, resolve
from distlab.batching import StepBatches
from distlab.cli import run_main
from distlab.config import TrainConfig, load_config, parse_override
from distlab.device import peak_flops, peak_memory_bytes, reset_peak_memory, synchronize
from distlab.folder_lock import FolderInUse, FolderLock
from distlab.measure.meter import Meter
from distlab.metrics import StepLog, mean_attention_span, strict_json, train_flops_per_token, utilisation
from distlab.models import count_parameters
from distlab.preemption import PREEMPTED_EXIT, Preempted, StopRequest, requeue_under_slurm
from distlab.prepare import build_model, import_model_code, prepare_inputs
from distlab.results.recorder import emit_rank_result
from distlab.strategies import make_strategy
from distlab.strategies.base import Strategy


@dataclass
class TrainResult:
    output_dir: Path
    log_path: Path | None
    eval_loss_before: float | None
    eval_loss_after: float | None
    final_loss: float
    steps: int
    resumed_from: int = 0
    summary: dict[str, Any] = field(default_factory=dict)


def train(cfg: TrainConfig, strategy: Strategy | None = None, keep_group: bool = False) -> TrainResult:
    """One run. `keep_group` leaves the process group up for a next run in the same processes."""
    strategy = strategy or make_strategy(cfg.strategy)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    strategy.meter = Meter.for_config(cfg)  # measurement attaches through the strategy's hooks, if asked for
    # The stop handlers go in first: a scheduler's SIGTERM during the rendezvous or the model load ends the
    # run before its first step, instead of killing it at an arbitrary point.
    with StopRequest() as stop:
        try:
            strategy.setup(cfg)
            with _own_output_dir(cfg, strategy):
                return _train(cfg, strategy, stop)
        finally:
            strategy.meter.close()
            strategy.teardown(keep_group)


@contextlib.contextmanager
def _own_output_dir(cfg: TrainConfig, strategy: Strategy):
    """The run's output folder is locked by the main rank for the whole run (distlab.folder_lock): a second
    run into it is refused on every rank, before anything is read or written there."""
    lock = FolderLock(cfg.output_dir, "training run") if strategy.is_main else None
    refused: Exception | None = None
    if lock is not None:
        try:
            lock.acquire()
        except (FolderInUse, OSError) as e:
            refused = e
    if strategy.any_rank(refused is not None):  # the other ranks learn it here instead of hanging in a collective
        raise refused or FolderInUse(f"{cfg.output_dir}: in use by another training run (the main rank's lock "
                                     f"was refused)")
    if lock is not None and lock.took_over:
        print(f"[distlab] {lock.describe_takeover()}", flush=True)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def run_flops_per_token(cfg: TrainConfig, model_config, n_trainable: int, train_data) -> tuple[float, float]:
    """(model FLOPs, executed FLOPs) per real token of a run: MFU's and HFU's numerators.

    Both count the LM head only where the data has labels (the loss needs nothing else). Model FLOPs
    count attention within each document (a packed row's documents never attend to each other: those
    pairs are no part of the model); executed FLOPs count what this run's kernels compute: one square per
    document with per-document attention, the whole row's square (masked pairs too) otherwise, and the
    layers' forward again under activation checkpointing. So HFU >= MFU, as in PaLM."""
    label_fraction = train_data.label_tokens / train_data.real_tokens
    per_document = not train_data.packed or resolve(cfg.attn_implementation) == VARLEN
    documents = mean_attention_span(train_data.document_lengths)
    model = train_flops_per_token(model_config, n_trainable, documents, not cfg.lora, label_fraction)
    executed = train_flops_per_token(model_config, n_trainable, documents if per_document else cfg.seq_len,
                                     not cfg.lora, label_fraction, recompute=cfg.activation_checkpointing)
    return model, executed


def steps_for_epochs(epochs: float, steps_per_epoch: int) -> int:
    """Optimizer steps for `epochs` passes: a started step runs whole (at least one step)."""
    return max(1, math.ceil(epochs * steps_per_epoch - 1e-9))  # 3 x 1/3 of an epoch is 1 epoch, not 2 steps


def _resume(path: Path | None, strategy, model, optimizer, scheduler, batches, log: StepLog,
            differ: list[str]) -> int:
    """Load checkpoint `path` (the newest complete one, already checked against this run), if any; its step."""
    if path is None:
        return 0
    step, saved_log = checkpoint.load(path, strategy, model, optimizer, scheduler, batches)
    # The log continues from the checkpoint: records of steps after it (written before the crash)
    # are dropped, so every step appears once, as the resumed run computed it.
    log.restore(saved_log)
    log.write("resume", step=step, checkpoint=str(path), **({"different_settings": differ} if differ else {}))
    if strategy.is_main:
        forced = f", with other settings (resume=force): {', '.join(differ)}" if differ else ""
        print(f"[distlab] resumed from {path} (step {step}){forced}", flush=True)
    return step


def _train(cfg: TrainConfig, strategy: Strategy, stop: StopRequest) -> TrainResult:
    out = Path(cfg.output_dir)
    accum = cfg.micro_steps(strategy.data_parallel_size)
    # Which run a checkpoint belongs to is settled before anything is built or written: a refused resume
    # leaves the folder (its log included) as the other run left it. Strategies without stages have one.
    run_fingerprint = checkpoint.fingerprint(cfg, strategy.world_size, strategy.data_parallel_size,
                                             getattr(strategy, "num_stages", 1), accum)
    resume_from = checkpoint.latest(out) if cfg.resume else None
    differ = (checkpoint.check_resume(resume_from, run_fingerprint, None if cfg.epochs is not None else cfg.max_steps,
                                      force=cfg.resume == "force") if resume_from is not None else [])
    # Host memory while the model loads, per rank: under single, ddp, zero2 and the pipelines every rank reads
    # the whole model (and quantises it, for a 4-bit base); fsdp, tp and fsdp_tp read only their own slices,
    # inside strategy.prepare (distlab.sharded_load; over a 4-bit base, each quantised weight whole, one at a time,
    # keeping its rows of the packed bytes); zero3 loads partitioned. The peak is read once
    # strategy.prepare has finished loading. The window opens after the data and the imports the build needs:
    # libraries and tokens are not the model's load (on a CPU rank of the 0.5B shape's QLoRA run, 100 to 140 MiB).
    choice, tokenizer, train_data, eval_data = prepare_inputs(cfg, strategy)
    import_model_code(cfg)  # the libraries that building the model imports: they are not the load
    host = torch.device("cpu")
    reset_peak_memory(host)
    host_before_load = psutil.Process().memory_info().rss  # the interpreter, its libraries and the data
    model = build_model(cfg, strategy, choice)
    n_total, n_trainable = count_parameters(model)
    batches = StepBatches(len(train_data), cfg.micro_batch_size, accum, strategy.data_parallel_size,
                          strategy.data_parallel_rank, cfg.seed, cfg.rank_shares)
    if cfg.epochs is not None:  # before the schedule is built: the cosine decays over the run's steps
        cfg = cfg.replace(max_steps=steps_for_epochs(cfg.epochs, batches.steps_per_epoch))
        if resume_from is not None:
            checkpoint.check_steps_left(resume_from, cfg.max_steps)
        if strategy.is_main:
            print(f"[distlab] {cfg.epochs:g} epochs of {batches.steps_per_epoch} steps: {cfg.max_steps} optimizer "
                  f"steps (epochs decide the step count; max_steps is not used)", flush=True)
    model, optimizer, scheduler = strategy.prepare(model, choice, cfg)
    # VmHWM is updated lazily by the kernel: it can miss a rise that was already sampled above, so the
    # peak includes its own starting sample and can never read below it
    host_peak_at_load = max(host_before_load, peak_memory_bytes(host))
    faults.install_slowdown(strategy.unwrap(model))  # chapter 05's emulated slow device; off by default
    if strategy.is_main:
        checkpoint.clean_partial(out)
    strategy.barrier()

    base_config = strategy.unwrap(model).causal_lm.config
    flops_per_token, executed_flops_per_token = run_flops_per_token(cfg, base_config, n_trainable, train_data)
    peak, peak_source = peak_flops(choice.device, choice.autocast_dtype or choice.dtype)
    log = StepLog(out, strategy.rank, all_ranks=strategy.world_size > 1)
    run_info = {
        "config": cfg.to_dict(), "strategy": strategy.name, "world_size": strategy.world_size,
        "grad_accum": accum, "device": str(choice.device), "device_name": provenance.device_description(),
        "dtype": str(choice.dtype), "autocast_dtype": str(choice.autocast_dtype),
        "parameters": n_total, "trainable_parameters": n_trainable, "train_items": len(train_data),
        "train_data": str(train_data.summary), "packing_fill": train_data.fill,
        "rows_per_step": batches.rows_per_step, "steps_per_epoch": batches.steps_per_epoch,
        "rows_left_out_per_epoch": batches.dropped_per_epoch,
        "flops_per_token": flops_per_token, "executed_flops_per_token": executed_flops_per_token,
        "label_fraction": train_data.label_tokens / train_data.real_tokens,
        "peak_flops": peak, "peak_flops_source": peak_source,
        "threads": torch.get_num_threads(), "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        "versions": provenance.package_versions(), "commit": provenance.git_commit(),
        "fingerprint": run_fingerprint,
    }
    if differ:  # resume=force over a checkpoint of other settings: the result says so
        run_info["resumed_with_different_settings"] = differ
    first_step = _resume(resume_from, strategy, model, optimizer, scheduler, batches, log, differ) + 1
    if first_step == 1:
        log.write("start", **run_info)
    if strategy.is_main:
        print(f"[distlab] {strategy.name} x{strategy.world_size} on {choice.device} ({run_info['device_name']}): "
              f"{n_total / 1e6:.2f}M parameters, {n_trainable / 1e6:.3f}M trainable; {train_data.summary}", flush=True)

    eval_before = None
    if eval_data and cfg.eval_at_start and first_step == 1:
        eval_before = strategy.evaluate(model, eval_data, choice)
        log.write("eval", step=0, eval_loss=eval_before)

    signum = strategy.world_max(stop.signum or 0)  # signalled while loading: nothing trained, nothing new to save
    if signum:
        raise Preempted(signum, None, None)
    bar = tqdm(total=cfg.max_steps, initial=first_step - 1, desc="train", mininterval=10.0, file=sys.stdout,
               disable=not (strategy.is_main and cfg.progress))
    model.train()
    reset_peak_memory(choice.device)
    # The host reads the device only at logging steps: the loss and the gradient norm stay tensors on the
    # device until then, and the clock is read once per logging window (after a synchronize), so a step
    # never waits for the device to drain. step_time_s is the window's mean (the step itself with
    # logging_steps=1): building the micro-batches included, a checkpoint's save (logged with its own time) not.
    window_steps, window_tokens, window_samples = 0, 0, 0
    loss = float("nan")
    synchronize(choice.device)
    window_start = time.perf_counter()
    for step in range(first_step, cfg.max_steps + 1):
        micro = [train_data.batch(rows) for rows in batches.next_step()]
        counts = [sum(b["n_label_tokens"] for b in micro), sum(b["n_real_tokens"] for b in micro),
                  sum(b["n_samples"] for b in micro)]  # host numbers, from the collate
        if strategy.world_size > 1:  # the global batch's counts: one small all-reduce, read here
            reduced = strategy.all_reduce_sum(torch.tensor(counts, dtype=torch.float64, device=choice.device))
            counts = [int(c) for c in reduced.cpu().tolist()]
        local_loss, grad_norm = strategy.train_step(model, micro, choice, counts[0], optimizer, scheduler,
                                                    cfg.max_grad_norm)
        step_loss = strategy.all_reduce_sum(torch.as_tensor(local_loss, dtype=torch.float64, device=choice.device))
        measured = strategy.meter.take_step()  # communication, pipeline timeline: off unless asked for
        window_steps, window_tokens, window_samples = (window_steps + 1, window_tokens + counts[1],
                                                       window_samples + counts[2])
        bar.update(1)
        faults.after_step(step, strategy.rank)
        if step % cfg.logging_steps == 0 or step == cfg.max_steps:
            synchronize(choice.device)
            elapsed = time.perf_counter() - window_start
            loss, step_time = float(step_loss), elapsed / window_steps
            tokens_per_s = window_tokens / elapsed
            record = dict(step=step, world_size=strategy.world_size, loss=loss,
                          lr=scheduler.get_last_lr()[0], grad_norm=float(grad_norm), step_time_s=step_time,
                          mean_step_time_s=step_time, tokens=counts[1], tokens_per_s=tokens_per_s,
                          samples_per_s=window_samples / elapsed, peak_mem_bytes=peak_memory_bytes(choice.device),
                          mfu=utilisation(tokens_per_s, flops_per_token, peak, strategy.world_size),
                          hfu=utilisation(tokens_per_s, executed_flops_per_token, peak, strategy.world_size),
                          epoch=batches.epoch, **measured)
            log.write("step", **record)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:.0f}")
            window_steps, window_tokens, window_samples = 0, 0, 0
        # Every rank finished this step; did a scheduler signal any of them? They stop together, at this step,
        # and agree on which signal it was (the larger number, SIGTERM over SIGUSR1: the more urgent one).
        signum = strategy.world_max(stop.signum or 0)
        stopping = signum > 0 and step < cfg.max_steps  # the last step ends the run anyway
        if stopping or (cfg.checkpoint_steps and step % cfg.checkpoint_steps == 0 and step < cfg.max_steps):
            t_save = time.perf_counter()
            saved = checkpoint.save(out, step, strategy, model, optimizer, scheduler, batches, log.path,
                                    cfg.keep_checkpoints, run_fingerprint)
            # what a scheduler's grace period must leave time for (distlab.launch sizes it from this)
            log.write("checkpoint", step=step, save_s=time.perf_counter() - t_save,
                      bytes=checkpoint.folder_bytes(saved) if strategy.is_main else None,
                      **({"stopped_on": signal.Signals(signum).name} if stopping else {}))
            window_start += time.perf_counter() - t_save  # the save is no part of the steps' time
            if stopping:
                bar.close()
                if strategy.is_main:  # after the save: the requeue ends this attempt, and loses nothing now
                    said = requeue_under_slurm(signum)
                    if said:
                        print(said, flush=True)
                raise Preempted(signum, step, saved)
        if window_steps == 0:  # a window was just logged: the next one starts now
            window_start = time.perf_counter()
    bar.close()

    eval_after = strategy.evaluate(model, eval_data, choice) if (eval_data and cfg.eval_at_end) else None
    if eval_after is not None:
        log.write("eval", step=cfg.max_steps, eval_loss=eval_after)
    if cfg.save_model:
        strategy.save_model(model, out / "model", tokenizer)
    summary = {"final_loss": loss, "eval_loss_before": eval_before, "eval_loss_after": eval_after,
               "peak_mem_bytes": peak_memory_bytes(choice.device), "host_before_load_bytes": host_before_load,
               "host_peak_at_load_bytes": host_peak_at_load}
    log.write("end", **summary)
    if strategy.is_main:
        stamp = provenance.stamp(cfg.model or "distlab-tiny", strategy.world_size)
        (out / "run_metadata.json").write_text(strict_json({**run_info, **summary, "provenance": stamp}, indent=2))
    # launched ranks print their result JSON between log markers (what survives a pod is its log)
    emit_rank_result(cfg, strategy, log.path, summary, measured_state=strategy.meter.measured_state)
    return TrainResult(out, log.path, eval_before, eval_after, loss, cfg.max_steps, first_step - 1, summary)


def variant_configs(config: str | Path, overrides: dict[str, Any], variants: list[str]) -> list[TrainConfig]:
    """The base config plus `--set` overrides, then each `--variant` mapping on top of it. Every
    variant must name its own output_dir: runs of a sweep never share a folder, however the paths are
    spelled (compared resolved: build/runs/x and ./build/../build/runs/x are one folder)."""
    if not variants:
        return [load_config(config, overrides)]
    cfgs, seen = [], {}
    for i, text in enumerate(variants, 1):
        extra = yaml_input.load(text, f"--variant {i}")  # YamlInputError: one line naming the variant
        if not isinstance(extra, dict) or "output_dir" not in extra:
            raise ValueError(f"--variant {i} ({text!r}) must be a mapping that sets output_dir")
        cfg = load_config(config, {**overrides, **extra})
        folder = Path(cfg.output_dir).expanduser().resolve()
        if folder in seen:
            j, spelled = seen[folder]
            same = "" if spelled == cfg.output_dir else f" (spelled {spelled} and {cfg.output_dir})"
            raise ValueError(f"--variant {i} and --variant {j} share output_dir {folder}{same}: the second run "
                             f"would overwrite the first")
        seen[folder] = (i, cfg.output_dir)
        cfgs.append(cfg)
    return cfgs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML file of TrainConfig fields")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one field (repeatable), e.g. --set max_steps=20")
    parser.add_argument("--variant", action="append", default=[], metavar="YAML",
                        help="a sweep: run once per --variant (a YAML mapping applied over --config and --set, "
                             "with its own output_dir), one after another in the same processes and process "
                             "group, e.g. --variant '{output_dir: runs/ga4, grad_accum: 4}'. Saves one "
                             "launch (interpreter start, imports, rendezvous) per run.")
    args = parser.parse_args(argv)
    cfgs = variant_configs(args.config, dict(parse_override(s) for s in args.set), args.variant)
    main_rank = int(os.environ.get("RANK", "0")) == 0
    for i, cfg in enumerate(cfgs):
        try:
            result = train(cfg, keep_group=i < len(cfgs) - 1)
        except Preempted as stopped:
            if main_rank:
                print(f"[distlab] {cfg.output_dir}: {stopped}", flush=True)
            return PREEMPTED_EXIT
        if main_rank:
            print(strict_json({"output_dir": str(result.output_dir), **result.summary}), flush=True)
    return 0


if __name__ == "__main__":
    run_main(main)
