"""Pipeline inference throughput: 2 stages with micro-batches in flight against 1 stage, side by side in
one run, one thread per stage, over model widths from the tiny model up (the crossover: where a stage's
compute outweighs a hand-off), plus 2 stages with one micro-batch at a time (the Slurm inference report's design, where
only one stage works at any moment).

    python -m distlab.bench.pipeline_inference [--widths 256,512,1024] [--layers 8] [--new-tokens 16]

Each model is a seeded random-init Qwen2 of that width saved once under build/models/ (throughput needs
no trained weights); every run is a torchrun launch of distlab.inference with OMP_NUM_THREADS=1.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from distlab.cli import run_main
from distlab.inference.outputs import run_here
from distlab.inference.stage_weights import random_checkpoint
from distlab.jsonio import strict_json
from distlab.paths import BUILD_DIR

MODES = {"1 stage": (1, None), "2 stages, in flight": (2, None), "2 stages, one at a time": (2, 1)}


def shape(width: int, layers: int) -> dict:
    heads = max(2, width // 64)
    return dict(hidden_size=width, intermediate_size=int(width * 2.6875) // 8 * 8, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=2 if heads % 2 == 0 else 1)


def run_one(model_dir: Path, stages: int, in_flight: int | None, out_dir: Path, prompts: int, batch_size: int,
            new_tokens: int, timeout_s: float = 600) -> dict:
    args = ["--model", str(model_dir), "--num-prompts", str(prompts), "--batch-size", str(batch_size),
            "--max-new-tokens", str(new_tokens)] + (["--in-flight", str(in_flight)] if in_flight else [])
    run_here(stages, out_dir, args, timeout_s=timeout_s)
    return json.loads((out_dir / "summary.json").read_text())


def bench(widths=(256, 512, 1024), layers: int = 8, prompts: int = 8, batch_size: int = 2,
          new_tokens: int = 16, out_dir: Path = BUILD_DIR / "bench" / "pipeline_inference", echo=print) -> list[dict]:
    """One row per (width, mode): tokens/s, and the ratio to 1 stage at that width."""
    rows = []
    for width in widths:
        model = random_checkpoint(f"bench-w{width}-l{layers}", **shape(width, layers))
        base = None
        for mode, (stages, in_flight) in MODES.items():
            s = run_one(model, stages, in_flight, out_dir / f"w{width}" / mode.replace(" ", "_").replace(",", ""),
                        prompts, batch_size, new_tokens)
            base = base or s["tokens_per_s"]
            rows.append({"width": width, "layers": layers, "mode": mode, "stages": stages,
                         "tokens_per_s": s["tokens_per_s"], "ratio_vs_1_stage": s["tokens_per_s"] / base,
                         "wall_s": s["wall_s"], "new_tokens": s["new_tokens"]})
            if echo:
                echo(f"width {width:5d}  {mode:24s} {s['tokens_per_s']:8.1f} tokens/s  "
                     f"x{s['tokens_per_s'] / base:.2f} vs 1 stage")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(strict_json(rows, indent=1))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m distlab.bench.pipeline_inference",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="256,512,1024")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    try:
        widths = [int(w) for w in args.widths.split(",")]
    except ValueError:
        print(f"--widths {args.widths!r}: a comma list of integers")
        return 2
    rows = bench(widths, args.layers, args.prompts, args.batch_size, args.new_tokens)
    widest = [r for r in rows if r["width"] == max(widths)]
    ratio = {r["mode"]: r["ratio_vs_1_stage"] for r in widest}
    print(f"widest model ({max(widths)}): 2 stages in flight / 1 stage = {ratio['2 stages, in flight']:.2f}x "
          f"(ideal on 2 cores: 2x); one at a time = {ratio['2 stages, one at a time']:.2f}x")
    return 0


if __name__ == "__main__":
    run_main(main, sigterm_exits=True)  # a SIGTERM kills the launched process groups too
