"""distlab's loop vs Hugging Face Trainer (padding collator, fp32 and bf16) vs TRL SFTTrainer (packing).

    python -m distlab.bench.trainer_vs_hf [--steps 40] [--rounds 2] [--out figures]

Same model (the default tiny Qwen2 + the same LoRA), same tokenised rows with the same label
masking, same micro-batch, steps, optimizer and schedule, one CPU thread each. The Hugging Face
runs use the stock stack (SDPA attention with a mask, peft's nn.Dropout, fp32 unless the name says
bf16: then `bf16=True`, HF's CPU autocast; TRL, whose SFTConfig defaults to bf16, gets it only where
bf16 matmuls are native, as distlab does); distlab runs its own recipe, which is what is being
compared: packing, per-document attention for packed rows (distlab.attention), the LM head only at
label positions, 16-bit dropout coins (distlab.dropout), and bf16 autocast where the CPU runs bf16
matmuls natively (dtype auto-bf16; attention kept in fp32). Every framework runs in its own
process, alternating over rounds so machine noise hits all of them alike.
Throughput is real (non-pad) tokens per second of wall-clock time between the end of the warm-up
steps and the end of the last step: data loading, collation and logging all count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from distlab.cli import run_main
from distlab.config import TrainConfig
from distlab.data import build_sft_data, load_jsonl, model_inputs, tokenize_conversations
from distlab.device import autocast, choose_device, native_bf16
from distlab.jsonio import strict_json
from distlab.launch.process import python_module_cmd, run
from distlab.lm_loss import CausalLMWithLoss
from distlab.metrics import read_log
from distlab.models import load_model, load_tokenizer
from distlab.prepare import apply_lora, seed_everything
from distlab.provenance import save_table, stamp
from distlab.train import train

FRAMEWORKS = ("distlab", "hf_trainer", "hf_trainer_bf16", "trl_sft_packing")
MODULE = "distlab.bench.trainer_vs_hf"  # what `make benchmarks` runs; its tables name it in their sidecars
FRAMEWORK_TABLE, RECIPE_TABLE = "bench_trainer_vs_hf.csv", "bench_recipe_ablation.csv"
GOAL_VS_HF_TRAINER = 1.6  # printed against, never asserted in a timed test
DISTLAB_DTYPE = "auto-bf16"  # bf16 autocast where native (distlab.device.native_bf16), else fp32


def _common(args):
    torch.set_num_threads(1)
    cfg = TrainConfig(max_steps=args.steps, micro_batch_size=args.micro_batch_size, seq_len=args.seq_len,
                      lr=2e-3, warmup_steps=5, eval_file=None, save_model=False, progress=False, logging_steps=1,
                      dtype=DISTLAB_DTYPE, device=args.device, model=args.model)
    tokenizer = load_tokenizer(cfg.model)
    examples, _ = tokenize_conversations(load_jsonl(cfg.train_file), tokenizer, cfg.seq_len)
    return cfg, tokenizer, examples


def _throughput(step_end_times: list[float], step_tokens: list[int], warmup: int) -> float:
    span = step_end_times[-1] - step_end_times[warmup - 1]
    return sum(step_tokens[warmup:]) / span


def run_distlab(args) -> dict:
    cfg, _, _ = _common(args)
    with tempfile.TemporaryDirectory() as tmp:
        train(cfg.replace(output_dir=tmp, eval_at_start=False, eval_at_end=False))
        steps = read_log(Path(tmp) / "train_log.jsonl")
    return {"tokens_per_s": _throughput([s["time"] for s in steps], [s["tokens"] for s in steps], args.warmup),
            "steps": len(steps)}


class _StepClock:
    """Trainer callback recording wall time at each step end, and a collator counting real tokens."""

    def __init__(self, collator):
        from transformers import TrainerCallback  # deferred: transformers is slow to import

        self.collator, self.times, self.pending, self.tokens = collator, [], 0, []
        clock = self

        class Callback(TrainerCallback):
            def on_step_end(self, *_, **__):
                clock.times.append(time.time())
                clock.tokens.append(clock.pending)
                clock.pending = 0

        self.callback = Callback()

    def __call__(self, features):
        batch = self.collator(features)
        if "attention_mask" in batch:
            self.pending += int(batch["attention_mask"].sum())
        else:  # padding-free: one flattened row, every token real
            self.pending += int(batch["input_ids"].numel())
        return batch


def _hf_model(cfg):
    seed_everything(cfg.seed)
    model = load_model(cfg.model)  # stock SDPA attention
    model.config.use_cache = False
    return apply_lora(model, cfg.replace(fast_dropout=False))  # stock peft LoRA, nn.Dropout included


def run_hf_trainer(args, bf16: bool = False) -> dict:
    # deferred: transformers is slow to import
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

    cfg, tokenizer, examples = _common(args)
    rows = [{"input_ids": e.input_ids, "labels": e.labels} for e in examples]
    clock = _StepClock(DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100))
    with tempfile.TemporaryDirectory() as tmp:
        targs = TrainingArguments(output_dir=tmp, per_device_train_batch_size=cfg.micro_batch_size,
                                  max_steps=cfg.max_steps, learning_rate=cfg.lr, lr_scheduler_type="cosine",
                                  warmup_steps=cfg.warmup_steps, weight_decay=cfg.weight_decay,
                                  max_grad_norm=cfg.max_grad_norm, logging_steps=cfg.max_steps, save_strategy="no",
                                  report_to=[], use_cpu=args.device == "cpu", dataloader_num_workers=0,
                                  seed=cfg.seed, disable_tqdm=True, bf16=bf16)
        Trainer(model=_hf_model(cfg), args=targs, train_dataset=rows, data_collator=clock,
                callbacks=[clock.callback]).train()
    return {"tokens_per_s": _throughput(clock.times, clock.tokens, args.warmup), "steps": len(clock.times)}


def run_trl(args) -> dict:
    from datasets import Dataset  # deferred: only the TRL baseline needs it
    from trl import SFTConfig, SFTTrainer  # deferred: TRL is only a benchmark baseline

    cfg, tokenizer, examples = _common(args)
    data = Dataset.from_list([{"input_ids": e.input_ids,
                               "assistant_masks": [int(lab != -100) for lab in e.labels]} for e in examples])
    with tempfile.TemporaryDirectory() as tmp:
        targs = SFTConfig(output_dir=tmp, per_device_train_batch_size=cfg.micro_batch_size, max_steps=cfg.max_steps,
                          learning_rate=cfg.lr, lr_scheduler_type="cosine", warmup_steps=cfg.warmup_steps,
                          weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
                          logging_steps=cfg.max_steps, save_strategy="no", report_to=[], use_cpu=args.device == "cpu",
                          dataloader_num_workers=0, seed=cfg.seed, disable_tqdm=True,
                          packing=True, max_length=cfg.seq_len,
                          # TRL's SFTConfig turns bf16 on by default; like distlab's auto-bf16, only where it is native
                          bf16=native_bf16(args.device))
        trainer = SFTTrainer(model=_hf_model(cfg), args=targs, train_dataset=data, processing_class=tokenizer)
        clock = _StepClock(trainer.data_collator)
        trainer.data_collator = clock
        trainer.add_callback(clock.callback)
        trainer.train()
    return {"tokens_per_s": _throughput(clock.times, clock.tokens, args.warmup), "steps": len(clock.times)}


RECIPE = (("stock: SDPA with the packing mask, nn.Dropout, fp32",
           {"attn_implementation": "sdpa", "fast_dropout": False, "dtype": "fp32"}),
          ("+ per-document attention", {"attn_implementation": "varlen", "fast_dropout": False, "dtype": "fp32"}),
          ("+ 16-bit dropout coins", {"attn_implementation": "varlen", "fast_dropout": True, "dtype": "fp32"}),
          ("+ bf16 matmuls (autocast; attention in fp32)",
           {"attn_implementation": "varlen", "fast_dropout": True, "dtype": "bf16-autocast"}))


def recipe_steps(device: str = "cpu") -> tuple:
    """The ablation's lines on this device: the bf16 line only where bf16 matmuls are native."""
    return tuple(r for r in RECIPE if r[1]["dtype"] == "fp32" or native_bf16(device))


def recipe_ablation(steps: int = 8, warmup: int = 2, rounds: int = 2, micro_batch_size: int = 4, seq_len: int = 256):
    """distlab's own speed-ups one at a time, in this process (one thread), on the same packed
    batches: milliseconds per forward+backward+AdamW step, medians over alternating rounds, and
    attention's share of one profiled step of each line (measured apart from the timed steps)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = TrainConfig(micro_batch_size=micro_batch_size, seq_len=seq_len)
    data = build_sft_data(cfg.train_file, load_tokenizer(cfg.model), seq_len, True, cfg.overlong)
    batches = [data.batch(range(i * micro_batch_size, (i + 1) * micro_batch_size)) for i in range(warmup + steps)]
    lines = recipe_steps("cpu")
    times: dict[str, list[float]] = {label: [] for label, _ in lines}
    shares: dict[str, float] = {}
    try:
        for _ in range(rounds):
            for label, changes in lines:
                run_cfg = cfg.replace(**changes)
                choice = choose_device("cpu", run_cfg.dtype)
                seed_everything(cfg.seed)
                base = load_model(cfg.model, attn_implementation=run_cfg.attn_implementation)
                model = CausalLMWithLoss(apply_lora(base, run_cfg)).train()
                opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
                for i, batch in enumerate(batches):
                    if i == warmup:
                        t0 = time.perf_counter()
                    with autocast(choice):
                        loss = model(**model_inputs(batch, choice.device))
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                times[label].append((time.perf_counter() - t0) / steps * 1e3)
                if label not in shares:  # after the timed steps: the profiler slows what it watches
                    shares[label] = attention_share(model, opt, batches[0], choice)
    finally:
        torch.set_num_threads(threads)
    stock = statistics.median(times[lines[0][0]])
    return pd.DataFrame([{"recipe": label, "ms_per_step": statistics.median(v), "speedup": stock / statistics.median(v),
                          "attention_share": shares[label]} for label, v in times.items()])


def _is_attention(name: str) -> bool:
    return "scaleddotproduct" in name.replace("_", "").lower()


def attention_share(model, optimizer, batch, choice) -> float:
    """The share of one profiled training step's wall time spent inside scaled_dot_product_attention,
    forward and backward (each SDPA call of the per-document loop included; an attention op nested in
    another is counted once)."""
    from torch.profiler import ProfilerActivity, profile  # deferred: only the ablation profiles a step

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        with autocast(choice):
            loss = model(**model_inputs(batch, choice.device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        wall_us = (time.perf_counter() - t0) * 1e6

    def outermost(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if _is_attention(parent.name):
                return False
            parent = parent.cpu_parent
        return True

    attention_us = sum(e.cpu_time_total for e in prof.events() if _is_attention(e.name) and outermost(e))
    return attention_us / wall_us


WORKERS = {"distlab": run_distlab, "hf_trainer": run_hf_trainer,
           "hf_trainer_bf16": lambda args: run_hf_trainer(args, bf16=True), "trl_sft_packing": run_trl}


def compare(steps: int = 40, warmup: int = 5, rounds: int = 2, micro_batch_size: int = 4, seq_len: int = 256,
            frameworks=FRAMEWORKS, timeout_s: float = 600, echo=False, device: str = "cpu", model: str | None = None):
    """Run every framework `rounds` times (alternating) and return a DataFrame of medians and ratios."""


    results: dict[str, list[float]] = {f: [] for f in frameworks}
    for r in range(rounds):
        for name in frameworks:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "result.json"
                run(python_module_cmd("distlab.bench.trainer_vs_hf", "--worker", name, "--result", str(out),
                                      "--steps", str(steps), "--warmup", str(warmup),
                                      "--micro-batch-size", str(micro_batch_size), "--seq-len", str(seq_len),
                                      "--device", device, *(["--model", model] if model else [])),
                    timeout_s=timeout_s, env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
                    echo=echo)
                res = json.loads(out.read_text())
            results[name].append(res["tokens_per_s"])
            print(f"round {r + 1}/{rounds} {name:>16}: {res['tokens_per_s']:8.0f} real tokens/s", flush=True)
    base = statistics.median(results["hf_trainer"]) if "hf_trainer" in results else None
    rows = []
    for name, values in results.items():
        med = statistics.median(values)
        rows.append({"framework": name, "tokens_per_s": med, "rounds": len(values),
                     "min": min(values), "max": max(values),
                     "vs_hf_trainer": med / base if base else float("nan")})
    df = pd.DataFrame(rows)
    if "trl_sft_packing" in results:
        df["vs_trl_packing"] = df["tokens_per_s"] / statistics.median(results["trl_sft_packing"])
    return df


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab.bench.trainer_vs_hf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    parser.add_argument("--device", default="cpu", help="cpu (one thread per run) or cuda")
    parser.add_argument("--model", help="a random preset, HF id or folder (default: the offline tiny Qwen2)")
    parser.add_argument("--csv", help="also save the framework table here (with a provenance sidecar)")
    parser.add_argument("--out", metavar="DIR",
                        help=f"save both tables in DIR with provenance sidecars: {FRAMEWORK_TABLE} and, after "
                             f"the recipe ablation runs, {RECIPE_TABLE} (`make benchmarks` writes them to figures/, "
                             "which the book's benchmark appendix shows)")
    parser.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)  # a worker's JSON result file
    args = parser.parse_args(argv)
    if args.worker:
        Path(args.result).write_text(strict_json(WORKERS[args.worker](args)))
        return 0
    df = compare(args.steps, args.warmup, args.rounds, args.micro_batch_size, args.seq_len, args.frameworks,
                 device=args.device, model=args.model)
    print(df.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    for name in df["framework"]:
        if name != "distlab":
            ratio = float(df.loc[df.framework == "distlab", "tokens_per_s"].iloc[0]) / \
                float(df.loc[df.framework == name, "tokens_per_s"].iloc[0])
            print(f"distlab / {name}: {ratio:.2f}x")
            if name == "hf_trainer":
                print(f"goal: distlab >= {GOAL_VS_HF_TRAINER}x HF Trainer (stock, fp32): "
                      f"{'met' if ratio >= GOAL_VS_HF_TRAINER else 'NOT met'}")
    arguments = {"steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
                 "micro_batch_size": args.micro_batch_size, "seq_len": args.seq_len, "frameworks": args.frameworks,
                 **({"device": args.device} if args.device != "cpu" else {}),
                 **({"model": args.model} if args.model else {})}
    from distlab.publish import freshness  # deferred: only the tables' provenance needs the digest

    run_stamp = {**freshness.benchmark_provenance(MODULE, arguments),
                 **stamp(args.model or "distlab-tiny", 1, threads_per_rank=1)}
    if args.csv:
        save_table(df, args.csv, run_stamp)
    if args.out:
        save_tables(df, Path(args.out), run_stamp, steps=args.steps, rounds=args.rounds,
                    micro_batch_size=args.micro_batch_size, seq_len=args.seq_len)
    return 0


def save_tables(frameworks: pd.DataFrame, out_dir: Path, run_stamp: dict, steps: int, rounds: int,
                micro_batch_size: int, seq_len: int) -> list[Path]:
    """Save the framework table, then run the recipe ablation and save it, both with provenance."""
    out_dir.mkdir(parents=True, exist_ok=True)
    saved = [save_table(frameworks, out_dir / FRAMEWORK_TABLE, run_stamp)]
    recipe = recipe_ablation(steps=max(4, steps // 2), rounds=rounds, micro_batch_size=micro_batch_size,
                             seq_len=seq_len)
    print(recipe.round(3).to_string(index=False), flush=True)
    saved.append(save_table(recipe.round(4), out_dir / RECIPE_TABLE, run_stamp))
    return saved


if __name__ == "__main__":
    run_main(main, sigterm_exits=True)  # a SIGTERM kills the launched process groups too
