"""Which rows of the training set each rank uses at each optimizer step (`StepBatches`), and uneven data
parallelism: how many rows of each global batch every rank takes (`rows_per_rank`).

A step's global batch is the same whatever the world size; ranks only cut it differently. Under
uneven shares (chapter 05's heterogeneous hosts) a rank's share is proportional to its measured
throughput (rows per second, from distlab.lan.calibrate), so that every rank finishes its forward and
backward at the same time. The gradient is unchanged by the split: distlab.train normalises every step's
loss by the global batch's label-token count and scales each rank's summed loss by the data-parallel
size before DDP averages, so the all-reduced gradient is the sum over every token of the global batch
divided by that count, however the rows are cut (tests/clusters/test_lan_runs.py checks it against one process to
1e-6). Ranks with more rows simply carry more tokens in that sum.
"""

from __future__ import annotations

from typing import Sequence

from torch.utils.data import DistributedSampler


def rows_per_rank(total: int, shares: Sequence[float], world: int, minimum: int = 1) -> list[int]:
    """`total` rows split in proportion to `shares` (largest remainder), then every rank below `minimum` raised
    to it with rows from the rank holding the most (one row per micro-batch: every rank runs the same number of
    micro-steps, so DDP syncs once per step). Proportion first: giving each rank its minimum before the split
    would hand the slow ranks more than their share."""
    if len(shares) != world:
        raise ValueError(f"rank_shares has {len(shares)} entries for {world} data-parallel ranks")
    if total < world * minimum:
        raise ValueError(f"{total} rows cannot give each of {world} ranks {minimum}")
    if min(shares) <= 0:
        raise ValueError(f"rank_shares must be positive, got {list(shares)}")
    exact = [total * s / sum(shares) for s in shares]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(world), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_remainder[:total - sum(counts)]:
        counts[i] += 1
    for i in range(world):
        while counts[i] < minimum:  # the donor keeps at least `minimum`: total >= world x minimum
            counts[max(range(world), key=counts.__getitem__)] -= 1
            counts[i] += 1
    return counts


def shares_from_throughput(rows_per_s: Sequence[float], digits: int = 3) -> list[float]:
    """Shares proportional to throughput, normalised to sum to 1 (rounded: they travel as --set text)."""
    total = sum(rows_per_s)
    return [round(r / total, digits) for r in rows_per_s]


def compute_seconds(rows_per_s: Sequence[float], counts: Sequence[int]) -> float:
    """A step's compute time when rank i takes counts[i] rows at rows_per_s[i]: the slowest rank sets it."""
    return max(c / r for c, r in zip(counts, rows_per_s))


def predicted_step_ratio(rows_per_s: Sequence[float], balanced: Sequence[int], naive: Sequence[int]) -> float:
    """Compute-only step time of the balanced split over the naive one."""
    return compute_seconds(rows_per_s, balanced) / compute_seconds(rows_per_s, naive)


def step_ratio_with_fixed(rows_per_s: Sequence[float], balanced: Sequence[int], naive: Sequence[int],
                          naive_step_s: float) -> tuple[float, float]:
    """(balanced / naive step time with a step's fixed part in both, that part in seconds). The fixed part F
    is what the measured naive step holds beyond its compute at the measured speeds: the all-reduce, the
    optimizer step and the loop's own work, which no split of the rows shortens. (C_b + F) / (C_n + F).
    A naive step shorter than its compute at those speeds (a host faster than its calibration) gives F = 0."""
    balanced_s, naive_s = compute_seconds(rows_per_s, balanced), compute_seconds(rows_per_s, naive)
    fixed = max(0.0, naive_step_s - naive_s)
    return (balanced_s + fixed) / (naive_s + fixed), fixed


def ideal_step_ratio(speeds: Sequence[float]) -> float:
    """Balanced / naive step time when compute is all a step costs. Naive: every rank takes the same rows,
    so the slowest sets the pace (throughput world x min speed); balanced: every rank finishes together
    (throughput the sum of the speeds). One host 2x slower: 2 x 0.5 / 1.5 = 2/3; 100/50/50: 0.75."""
    return len(speeds) * min(speeds) / sum(speeds)


def ideal_speedups(speeds: Sequence[float]) -> dict[str, float]:
    """Throughput of the cluster over its fastest host alone, compute only: `even` (equal rows: world x the
    slowest speed) and `balanced` (rows by speed: the sum of the speeds, the ideal)."""
    fastest = max(speeds)
    return {"even": len(speeds) * min(speeds) / fastest, "balanced": sum(speeds) / fastest}


class StepBatches:
    """Which rows each rank uses at each optimizer step, with DistributedSampler underneath.

    At step k the global batch is the k-th run of micro x accumulation x world rows of the
    epoch's seeded permutation, whatever the world size, and rank r takes every world-th one
    (DistributedSampler's rule). Epochs end at the last full step (the remainder is counted, not
    silently mixed across epochs). The position is a small state dict for checkpoints."""

    def __init__(self, n_items: int, micro: int, accum: int, world: int, rank: int, seed: int,
                 shares: list[float] | None = None):
        per_step = micro * accum * world
        if n_items < per_step:
            raise ValueError(f"{n_items} training items cannot fill one global batch of {per_step} "
                             f"(micro {micro} x accumulation {accum} x world {world})")
        self.micro, self.accum = micro, accum
        # Uneven data parallelism (chapter 05): the same global batch, cut into contiguous slices by
        # `shares`; every rank walks the whole permutation (a one-replica sampler) and takes its slice.
        self.span, self.slice = micro * accum, None
        if shares:
            counts = rows_per_rank(per_step, shares, world, minimum=accum)
            self.span, self.slice = per_step, (sum(counts[:rank]), sum(counts[:rank + 1]))
            world, rank = 1, 0
        self.sampler = DistributedSampler(range(n_items), num_replicas=world, rank=rank, shuffle=True,
                                          seed=seed, drop_last=True)
        self.steps_per_epoch = len(self.sampler) // self.span
        self.dropped_per_epoch = n_items - self.steps_per_epoch * per_step
        self.epoch, self.step_in_epoch = 0, 0
        self._order: list[int] | None = None

    def next_step(self) -> list[list[int]]:
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch, self._order = self.epoch + 1, 0, None
        if self._order is None:
            self.sampler.set_epoch(self.epoch)
            self._order = list(self.sampler)
        start = self.step_in_epoch * self.span
        rows = self._order[start:start + self.span]
        self.step_in_epoch += 1
        if self.slice is not None:  # this rank's slice, in `accum` near-equal micro-batches
            mine = rows[self.slice[0]:self.slice[1]]
            return [mine[i * len(mine) // self.accum:(i + 1) * len(mine) // self.accum] for i in range(self.accum)]
        return [rows[i:i + self.micro] for i in range(0, self.span, self.micro)]

    @property
    def rows_per_step(self) -> int:
        """The rows this rank contributes to each optimizer step (its slice under rank_shares)."""
        return self.slice[1] - self.slice[0] if self.slice is not None else self.span

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.step_in_epoch, self._order = state["epoch"], state["step_in_epoch"], None
