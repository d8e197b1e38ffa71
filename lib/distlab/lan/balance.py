"""Uneven data parallelism: how many rows of each global batch every rank takes.

A rank's share is proportional to its measured throughput (rows per second, from distlab.lan.calibrate),
so that every rank finishes its forward and backward at the same time. The gradient is unchanged by the
split: distlab.train normalises every step's loss by the global batch's label-token count and scales each
rank's summed loss by the data-parallel size before DDP averages, so the all-reduced gradient is the sum
over every token of the global batch divided by that count, however the rows are cut (tests/test_lan.py
checks it against one process to 1e-6). Ranks with more rows simply carry more tokens in that sum.
"""

from __future__ import annotations

from typing import Sequence


def rows_per_rank(total: int, shares: Sequence[float], world: int, minimum: int = 1) -> list[int]:
    """`total` rows split in proportion to `shares` (largest remainder), at least `minimum` rows per rank
    (one per micro-batch: every rank runs the same number of micro-steps, so DDP syncs once per step)."""
    if len(shares) != world:
        raise ValueError(f"rank_shares has {len(shares)} entries for {world} data-parallel ranks")
    if total < world * minimum:
        raise ValueError(f"{total} rows cannot give each of {world} ranks {minimum}")
    if min(shares) <= 0:
        raise ValueError(f"rank_shares must be positive, got {list(shares)}")
    spare = total - world * minimum  # the minimum first: no rank idles
    exact = [spare * s / sum(shares) for s in shares]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(world), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_remainder[:spare - sum(counts)]:
        counts[i] += 1
    return [c + minimum for c in counts]


def shares_from_throughput(rows_per_s: Sequence[float], digits: int = 3) -> list[float]:
    """Shares proportional to throughput, normalised to sum to 1 (rounded: they travel as --set text)."""
    total = sum(rows_per_s)
    return [round(r / total, digits) for r in rows_per_s]


def predicted_step_ratio(rows_per_s: Sequence[float], balanced: Sequence[int], naive: Sequence[int]) -> float:
    """Compute-only step time of the balanced split over the naive one (the slowest rank sets each)."""
    def step(counts):
        return max(c / r for c, r in zip(counts, rows_per_s))
    return step(balanced) / step(naive)
