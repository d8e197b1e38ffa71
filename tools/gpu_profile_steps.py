"""Where a GPU training step's time goes: the kernels' busy time against the steps' wall time.

    python tools/gpu_profile_steps.py [--set key=value ...]

Runs a few full fine-tuning steps of the qwen2.5-0.5b-random preset (packed rows, bf16 autocast) under
torch.profiler and prints the top kernels by GPU time, the GPU's busy seconds and the steps' wall
seconds. Busy far under wall means the host (Python, launches, synchronisations) sets the pace.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from distlab.config import load_config, parse_override
from distlab.metrics import read_log
from distlab.paths import REPO_ROOT
from distlab.train import train

parser = argparse.ArgumentParser()
parser.add_argument("--set", action="append", default=[])
args = parser.parse_args()
settings = {"model": "qwen2.5-0.5b-random", "device": "cuda", "dtype": "bf16-autocast", "lora": False,
            "seq_len": 1024, "micro_batch_size": 8, "max_steps": 8, "logging_steps": 1, "eval_at_start": False,
            "eval_at_end": False, "save_model": False, "progress": False, "num_threads": None, "resume": False,
            **dict(parse_override(s) for s in args.set)}
with tempfile.TemporaryDirectory() as tmp:
    cfg = load_config(REPO_ROOT / "lib/distlab/configs/tiny_lora.yaml", {**settings, "output_dir": tmp})
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train(cfg)
    steps = read_log(Path(tmp) / "train_log.jsonl")
events = prof.key_averages()
print(events.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))
# kernels and copies only: an operator's row repeats the time of the kernels it launched
busy = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
wall = sum(s["step_time_s"] for s in steps)
launches = sum(e.count for e in events if e.self_device_time_total > 0)
print(f"{len(steps)} steps: wall {wall:.2f}s; GPU busy {busy:.2f}s (whole run, model build included); "
      f"{launches} device ops; tokens/s per step: {[round(s['tokens_per_s']) for s in steps]}")
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
