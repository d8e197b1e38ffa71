"""Every rank computes `envcheck.fingerprint()`; rank 0 gathers them and flags differences.

Launched by `distlab.workers.launcher.run_fingerprint` (one node or several; see its docstring):

    torchrun --standalone --nproc-per-node 2 -m distlab.workers.fingerprint --out fp.json

Test knob: with DISTLAB_FINGERPRINT_FAKE_RANK1="field=value" (or just "value", meaning the
torch version) rank 1 reports that value instead of its own, which must show up as a MISMATCH.
"""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist

from distlab.cli import run_main
from distlab.measure import envcheck
from distlab.workers import write_result


def perturbed_for_test(fp: dict[str, str], rank: int) -> dict[str, str]:
    fake = os.environ.get(envcheck.FAKE_RANK1_ENV)
    if rank != 1 or not fake:
        return fp
    field, value = fake.split("=", 1) if "=" in fake else ("torch", fake)
    return {**fp, field: value}


def format_table(rows: list[dict]) -> str:
    """A fixed-width text table (rank 0's stdout is read in a terminal or a notebook log)."""
    columns = list(rows[0])
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]

    def line(values: list[str]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip()

    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, cells)])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="JSON written by rank 0")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    args = ap.parse_args(argv)

    if args.backend == "nccl":  # all_gather_object stages through the current CUDA device
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        mine = perturbed_for_test(envcheck.fingerprint(), rank)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            rows = envcheck.compare_fingerprints(gathered)
            print(format_table(rows), flush=True)
            bad = [r["field"] for r in rows if r["MISMATCH"]]
            verdict = f"MISMATCH in {', '.join(bad)}" if bad else "all must-match fields agree"
            print(f"fingerprint: {world} ranks, {verdict}", flush=True)
            write_result(args.out, {"world_size": world, "fingerprints": gathered, "rows": rows,
                                    "mismatched_fields": bad})
        dist.barrier()  # nobody exits (and tears down the store) before rank 0 is done
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
