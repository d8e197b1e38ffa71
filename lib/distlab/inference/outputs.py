"""Reading a pipeline-inference run back: what a job wrote into its out-dir (summary, completions, each
stage's timeline and memory), its latency statistics and each stage's busy fraction, and whether two runs
gave the same answers. Completions are read through distlab.inference.resume, so the torn last line a
killed job may leave is never taken for an answer. The stage timeline is drawn by distlab.chapters.ch06.
`run_here` starts such a run on this machine (torchrun, one thread per rank) for the benchmarks and chapters."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from distlab.inference.resume import COMPLETIONS, read_log
from distlab.launch import process

MIB = 2 ** 20


def run_here(ranks: int, out_dir: str | Path, args: list[str], module: str = "distlab.inference",
             timeout_s: float = 600) -> Path:
    """Run a decoding entry point (distlab.inference, or distlab.inference.tp_decode) on `ranks` local
    processes under torchrun, one thread each (OMP_NUM_THREADS=1: ranks do not fight over cores), writing
    into out_dir; its log is out_dir/launch.log. Returns out_dir."""
    out_dir = Path(out_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           "-m", module, "--out-dir", str(out_dir), "--threads", "1", *args]
    process.run(cmd, timeout_s=timeout_s, log_path=out_dir / "launch.log", echo=False, env={"OMP_NUM_THREADS": "1"})
    return out_dir


def completions(out_dir: str | Path) -> list[dict]:
    """The complete completion rows a run (finished or not) left in out_dir, in the order they were written."""
    return read_log(Path(out_dir) / COMPLETIONS).rows


def token_mismatches(rows: list[dict], reference: list[dict]) -> list[str]:
    """Prompt ids whose tokens differ from the reference's, or that one side lacks (empty: identical)."""
    got, want = ({r["id"]: r["tokens"] for r in rs} for rs in (rows, reference))
    return sorted(pid for pid in set(got) | set(want) if got.get(pid) != want.get(pid))


def load_run(out_dir: str | Path) -> dict:
    """{'summary': dict, 'completions': DataFrame, 'stages': [stage dicts by rank], 'memory': DataFrame}."""
    out_dir = Path(out_dir)
    summary_path = out_dir / "summary.json"
    if not summary_path.is_file():
        raise FileNotFoundError(f"{out_dir}: no summary.json (the job did not finish; see its rank logs)")
    summary = json.loads(summary_path.read_text())
    rows = completions(out_dir)
    stages = [json.loads((out_dir / f"stage{r}.json").read_text()) for r in range(summary["stages"])]
    def rss_delta(m):
        return (m["rss_after_load"] - m["rss_before_load"]) / MIB

    memory = pd.DataFrame([{"stage": s["rank"], "layers": len(s["layers"]),
                            "stage_params_mib": s["memory"]["stage_param_bytes"] / MIB,
                            "checkpoint_mib": s["memory"]["checkpoint_bytes"] / MIB,
                            "read_mib": s["memory"]["read_bytes"] / MIB,
                            "rss_load_delta_mib": rss_delta(s["memory"]),
                            "peak_rss_mib": s["memory"]["peak_rss"] / MIB} for s in stages])
    return {"summary": summary, "completions": pd.DataFrame(rows), "stages": stages, "memory": memory}


def latency_stats(run: dict) -> dict:
    """Tokens/s and the mean time to first token / per-token latency over the run's prompts."""
    c = run["completions"]
    return {"tokens_per_s": run["summary"]["tokens_per_s"], "ttft_s": float(c["ttft_s"].mean()),
            "per_token_s": float(c["per_token_s"].dropna().mean()) if c["per_token_s"].notna().any() else float("nan"),
            "wall_s": run["summary"]["wall_s"], "new_tokens": run["summary"]["new_tokens"]}


def busy_fraction(stage: dict) -> float:
    """Share of the stage's wall time spent in its own forwards (the rest: waiting for a neighbour)."""
    busy = sum(e["end"] - e["start"] for e in stage["events"])
    span = max(e["end"] for e in stage["events"]) - min(e["start"] for e in stage["events"])
    return busy / span if span > 0 else 0.0

