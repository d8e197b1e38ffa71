"""One rank of pipeline inference, started by torchrun or srun (or alone, as a 1-stage run).

Rank and world come from torchrun's RANK/WORLD_SIZE or Slurm's SLURM_PROCID/SLURM_NTASKS; the
stages talk over gloo on CPU or NCCL between GPUs (MASTER_ADDR/MASTER_PORT). Each rank writes into --out-dir:

  rank<r>.log        its log (also on stdout, prefixed "[rank<r>]:")
  stage<r>.json      its layers, memory (parameter bytes held vs the whole checkpoint, RSS) and
                     timeline (one entry per forward: micro-batch, step, start, end)
  completions.jsonl  (last rank) per prompt: text, tokens, time to first token, per-token latency;
                     appended and fsynced one micro-batch at a time, as each finishes (distlab.inference.resume)
  run_settings.json  (last rank) the settings that decide the tokens, checked when a run is resumed
  summary.json       (last rank) tokens/s and the run's settings

--resume keeps what an earlier run of the same settings in --out-dir answered (a job that lost a stage,
resubmitted or requeued) and generates only the rest; without it the run starts from an empty
completions.jsonl. DISTLAB_KILL_AFTER_MICRO_BATCHES (distlab.faults) kills a stage mid-job on purpose.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import logging
import os
import resource
import signal
import sys
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from distlab import faults
from distlab.cli import finite_float, run_main
from distlab.device import backend_for
from distlab.inference import resume
from distlab.inference.batches import micro_batches, read_prompts
from distlab.inference.engine import Pipeline, Sampling
from distlab.inference.stage import InferenceStage
from distlab.inference.stage_weights import checkpoint_bytes
from distlab.jsonio import strict_json
from distlab.layer_split import split_layers
from distlab.models import resolve_model
from distlab.paths import DEMO_PROMPTS

MIB = 2 ** 20


def rank_and_world() -> tuple[int, int]:
    """torchrun's variables first, then Slurm's, else a single process."""
    for r, w in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if r in os.environ and w in os.environ:
            return int(os.environ[r]), int(os.environ[w])
    return 0, 1


def local_model_dir(model: str | None) -> Path:
    """The model's local folder; inference never downloads (HF_HUB_OFFLINE=1)."""
    path = Path(resolve_model(model))
    if not (path / "config.json").is_file():
        raise SystemExit(f"model {model!r}: {path} is not a local model folder with config.json "
                         "(pipeline inference reads local checkpoints only)")
    return path


def repeat_prompts(prompts: list, n: int | None) -> list:
    """The first n prompts, cycling through the file when n is larger (weak scaling); ids stay unique."""
    if not n:
        return prompts
    return [(pid if i < len(prompts) else f"{pid}#{i // len(prompts)}", text)
            for i, (pid, text) in ((i, prompts[i % len(prompts)]) for i in range(n))]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m distlab.inference", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="local model folder (default: the default model)")
    ap.add_argument("--adapter", default=None, help="a PEFT LoRA folder merged into the stages' weights")
    ap.add_argument("--prompts", default=str(DEMO_PROMPTS), help="prompt JSONL")
    ap.add_argument("--num-prompts", type=int, default=None, help="use n prompts (cycling the file)")
    ap.add_argument("--batch-size", default="1",
                    help="rows per micro-batch; a comma list (1,2,4) runs a sweep, each size in out-dir/b<N>/")
    ap.add_argument("--in-flight", type=int, default=None,
                    help="micro-batches in the pipeline at once (default all; 1 = one at a time)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--sample", action="store_true", help="temperature/top-p sampling (default greedy)")
    ap.add_argument("--temperature", type=finite_float, default=0.2)
    ap.add_argument("--top-p", type=finite_float, default=0.9)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--stage-layers", default=None, help="layers per stage, e.g. 3,1 (default balanced)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")),
                    help="torch threads per rank (default OMP_NUM_THREADS, else 1)")
    ap.add_argument("--comm-timeout-s", type=finite_float, default=120, help="timeout for one send/recv")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="auto: the rank's GPU (LOCAL_RANK / SLURM_LOCALID) when one is visible, else CPU")
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                    help="stage weights: auto = bf16 on a GPU, fp32 on CPU (exact against model.generate)")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--resume", action="store_true",
                    help="keep the completions an earlier run with the same settings left in --out-dir and "
                         "answer only the remaining prompts (what a resubmitted or requeued job does)")
    ap.add_argument("--kill-rank", type=int, default=None, help="fault injection: this rank SIGKILLs itself")
    ap.add_argument("--kill-at-step", type=int, default=2, help="... after this many decoding steps")
    return ap.parse_args(argv)


def stage_device(requested: str) -> torch.device:
    """This rank's device: its own GPU (one per task under srun, one per local rank under torchrun)."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: no GPU is visible to this rank")
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))
    torch.cuda.set_device(local % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def setup_logging(out_dir: Path, rank: int, append: bool = False) -> logging.Logger:
    """Log to out_dir/rank<r>.log and stdout; a resumed run appends, so the lost attempt's log stays."""
    log = logging.getLogger(f"distlab.inference.rank{rank}")
    log.setLevel(logging.INFO)
    log.propagate = False
    for old in list(log.handlers):  # an earlier run in this process (a test, a notebook) logged elsewhere
        log.removeHandler(old)
        old.close()
    fmt = logging.Formatter(f"[rank{rank}]:%(asctime)s %(message)s", "%H:%M:%S")
    for handler in (logging.FileHandler(out_dir / f"rank{rank}.log", mode="a" if append else "w"),
                    logging.StreamHandler(sys.stdout)):
        handler.setFormatter(fmt)
        log.addHandler(handler)
    return log


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rank, world = rank_and_world()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = setup_logging(out_dir, rank, append=args.resume)
    prompts = repeat_prompts(read_prompts(args.prompts), args.num_prompts)
    ids = [pid for pid, _ in prompts]
    # answers are kept, and skipped on --resume, by prompt id: the file's are unique (load_prompts), and cycling
    # it (--num-prompts) adds ids `<id>#<k>`, which the file may hold already
    if len(set(ids)) != len(ids):
        dup = next(pid for pid in ids if ids.count(pid) > 1)
        raise ValueError(f"{args.prompts}: prompt id {dup!r} appears more than once; ids must be unique")
    torch.set_num_threads(args.threads)
    from transformers import AutoConfig, AutoTokenizer  # deferred: transformers is slow to import
    from transformers.utils import logging as hf_logging  # deferred: transformers is slow to import

    hf_logging.set_verbosity_error()
    device = stage_device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(args.dtype) or (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    if world > 1:  # NCCL between GPU stages, gloo between CPU ones
        dist.init_process_group(backend_for(device.type), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=args.comm_timeout_s))
    model_dir = local_model_dir(args.model)
    config = AutoConfig.from_pretrained(model_dir, attn_implementation="sdpa")
    counts = [int(c) for c in args.stage_layers.split(",")] if args.stage_layers else None
    ranges = split_layers(config.num_hidden_layers, world, counts)
    rss0 = psutil.Process().memory_info().rss
    stage = InferenceStage(config, ranges[rank], first=rank == 0, last=rank == world - 1)
    info = stage.load(model_dir, args.adapter, dtype=dtype)
    stage.to(device)
    rss1 = psutil.Process().memory_info().rss
    memory = {"stage_param_bytes": stage.param_bytes(), "checkpoint_bytes": checkpoint_bytes(model_dir),
              "read_bytes": info["read_bytes"], "rss_before_load": rss0, "rss_after_load": rss1}
    log.info("stage %d/%d: layers %s, %s; holds %.1f MiB of a %.1f MiB checkpoint (RSS +%.1f MiB)%s",
             rank, world, ranges[rank].start if len(ranges[rank]) else "-", f"{len(ranges[rank])} layers",
             memory["stage_param_bytes"] / MIB, memory["checkpoint_bytes"] / MIB, (rss1 - rss0) / MIB,
             f", LoRA merged into {info['lora_merged']} weights" if args.adapter else "")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    sampling = Sampling(args.max_new_tokens, greedy=not args.sample, temperature=args.temperature,
                        top_p=args.top_p, seed=args.seed)
    sizes = [int(b) for b in str(args.batch_size).split(",")]
    for batch_size in sizes:
        where = out_dir if len(sizes) == 1 else out_dir / f"b{batch_size}"
        where.mkdir(parents=True, exist_ok=True)
        settings = token_settings(args, model_dir, prompts, batch_size, dtype)
        run_batch_size(args, stage, tokenizer, prompts, batch_size, sampling, where, log,
                       dict(memory), rank, world, ranges, model_dir, settings)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


def token_settings(args, model_dir: Path, prompts: list, batch_size: int, dtype: torch.dtype) -> dict:
    """What decides every answer's tokens (not the stage count: a resubmission may run on fewer nodes)."""
    digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]
    return {"model": str(Path(model_dir).resolve()), "adapter": str(Path(args.adapter).resolve()) if args.adapter
            else None, "prompts_sha256": digest, "prompts": len(prompts), "batch_size": batch_size,
            "max_new_tokens": args.max_new_tokens, "greedy": not args.sample, "temperature": args.temperature,
            "top_p": args.top_p, "seed": args.seed, "dtype": str(dtype)}


def answered_before(out_dir: Path, settings: dict, resume_run: bool, rank: int, world: int, log, device) -> set:
    """The prompt ids already answered (resuming), read by the last stage, the one that writes them, and
    sent to every stage: all of them must skip the same micro-batches."""
    done = [set()]
    if rank == world - 1:
        (out_dir / "summary.json").unlink(missing_ok=True)  # written again only when this run finishes
        state, note = resume.start(out_dir, settings, resume_run)
        if note:
            log.warning(note)
        done = [state.ids]
    if world > 1:
        dist.broadcast_object_list(done, src=world - 1, device=device if device.type == "cuda" else None)
    return done[0]


def run_batch_size(args, stage, tokenizer, prompts, batch_size, sampling, out_dir, log, memory, rank, world,
                   ranges, model_dir, settings) -> None:
    """Generate every prompt not answered yet in micro-batches of `batch_size`; write this rank's files into
    out_dir, the completions of each micro-batch as soon as it finishes."""
    batches = micro_batches(tokenizer, prompts, batch_size)
    pipe = Pipeline(stage, rank, world, stage.config, tokenizer.eos_token_id, tokenizer.pad_token_id, sampling)
    if args.kill_rank == rank:
        arm_kill(pipe, args.kill_at_step, log)
    done = answered_before(out_dir, settings, args.resume, rank, world, log, next(stage.parameters()).device)
    todo = resume.remaining(batches, done)
    if world > 1:
        dist.barrier()
    if done:
        log.info("resuming: %d of %d prompts already answered, %d of %d micro-batches left", len(done),
                 len(prompts), len(todo), len(batches))
    log.info("generating: %d prompts in %d micro-batches of <= %d, %s in flight, <= %d new tokens, %s",
             sum(mb.rows for mb in todo), len(todo), batch_size, args.in_flight or "all", args.max_new_tokens,
             "greedy" if sampling.greedy else f"sampling T={sampling.temperature} top_p={sampling.top_p}")
    path = out_dir / resume.COMPLETIONS
    finished, new_rows = [], []

    def on_done(st) -> None:
        if rank == world - 1:  # durable before the next micro-batch can finish
            rows = [r for r in completion_rows([st], tokenizer) if r["id"] not in done]
            resume.append_rows(path, rows)
            new_rows.extend(rows)
        finished.append(st.mb.index)
        faults.after_micro_batches(len(finished), rank)

    start = time.perf_counter()
    pipe.run(todo, args.in_flight, on_done=on_done)
    wall = time.perf_counter() - start
    memory["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    (out_dir / f"stage{rank}.json").write_text(strict_json(
        {"rank": rank, "world": world, "layers": list(ranges[rank]), "first": rank == 0, "last": rank == world - 1,
         "memory": memory, "wall_s": wall, "events": pipe.events}, indent=1))
    if rank != world - 1:
        log.info("done: stage %d finished in %.2f s", rank, wall)
        return
    answered = resume.read_log(path).ids
    missing = [pid for pid, _ in prompts if pid not in answered]
    if missing:
        raise RuntimeError(f"{path}: {len(missing)} prompts unanswered after the run ({missing[:3]} ...)")
    new_tokens = sum(r["new_tokens"] for r in new_rows)
    summary = {"stages": world, "stage_layers": [len(r) for r in ranges], "prompts": len(prompts),
               "batch_size": batch_size, "micro_batches": len(batches),
               "in_flight": args.in_flight or len(batches), "max_new_tokens": args.max_new_tokens,
               "greedy": sampling.greedy, "model": str(model_dir), "adapter": args.adapter,
               "answered_before": len(done), "answered_now": len(new_rows), "micro_batches_run": len(todo),
               "new_tokens": new_tokens, "wall_s": wall, "tokens_per_s": new_tokens / wall if wall > 0 else 0.0,
               "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
               "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT") or 0)}
    (out_dir / "summary.json").write_text(strict_json(summary, indent=1))
    log.info("done: %d new tokens in %.2f s = %.1f tokens/s; %d prompts answered now, %d before", new_tokens, wall,
             summary["tokens_per_s"], len(new_rows), len(done))


def completion_rows(states, tokenizer) -> list[dict]:
    rows = []
    for st in states:
        times = st.token_times
        for r in range(st.mb.rows):
            toks = st.tokens[r]
            n = len(toks)
            rows.append({"id": st.mb.ids[r], "prompt": st.mb.prompts[r],
                         "text": tokenizer.decode(toks, skip_special_tokens=True).strip(), "tokens": toks,
                         "new_tokens": n, "micro_batch": st.mb.index, "ttft_s": times[0],
                         "per_token_s": (times[n - 1] - times[0]) / (n - 1) if n > 1 else None,
                         "finish_s": times[n - 1]})
    return rows


def arm_kill(pipe: Pipeline, at_step: int, log) -> None:
    """Fault injection: SIGKILL this rank when it starts decoding step `at_step` (mid-generation)."""
    inner = pipe._step

    def step(st, step_index):
        if step_index >= at_step:
            log.info("fault injection: SIGKILL at decoding step %d", step_index)
            for h in logging.getLogger(log.name).handlers:
                h.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        inner(st, step_index)

    pipe._step = step


if __name__ == "__main__":
    run_main(main)
