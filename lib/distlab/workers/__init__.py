"""Programs that run inside torchrun ranks (`python -m distlab.workers.<name>`).

Each one is launched from a notebook through `distlab.launch.process.run`, so a hang or a crash is
killed as a process group and reported with the failing rank's last lines. Rank 0 writes the
result as JSON (`write_result`) to the path given with `--out`; the launching side parses it.

  fingerprint      every rank reports its software/hardware fingerprint; rank 0 flags mismatches
  allreduce_bench  all-reduce bandwidth over a message-size sweep (algbw and busbw, as nccl-tests)
  layer_times      forward+backward time of each model part on each host (chapter 05's pipeline split)
  step_bytes       the bytes one optimizer step sends under ddp, fsdp, tp, and tp + sequence or vocabulary
                   parallelism (ch. 07)
  launcher         launching them under torchrun: run_worker, run_fingerprint, run_allreduce_bench
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distlab.jsonio import strict_json


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Rank 0's JSON result, written to a temporary file and renamed: the launcher never reads a
    half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(strict_json(result, indent=1) + "\n")
    tmp.replace(path)
