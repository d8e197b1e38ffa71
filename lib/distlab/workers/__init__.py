"""Programs that run inside torchrun ranks (`python -m distlab.workers.<name>`).

Each one is launched from a notebook through `distlab.runner.run`, so a hang or a crash is
killed as a process group and reported with the failing rank's last lines. Rank 0 writes the
result as JSON to the path given with `--out`; the launching side parses it.

  fingerprint      every rank reports its software/hardware fingerprint; rank 0 flags mismatches
  allreduce_bench  all-reduce bandwidth over a message-size sweep (algbw and busbw, as nccl-tests)
"""
