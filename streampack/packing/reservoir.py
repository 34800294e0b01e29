"""``Reservoir``: one reader's ready packs and the histogram of every pack cost it has seen.

The node (:class:`~streampack.nodes.window_packer.WindowPacker` with ``balance``) and the
simulator (``benchmarks/bench_balance.py``) both hold their packs in one, so the simulated
emission is the node's. The rules it applies are in :mod:`streampack.packing.schedule`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

import numpy as np

from streampack.packing.schedule import (
    BINS,
    Balance,
    CostScale,
    Schedule,
    choose,
    quantile_floor,
    schedule_point,
    schedule_start,
    target_quantiles,
)

T = TypeVar("T")


class Reservoir(Generic[T]):
    """The ready packs of one reader and the histogram of every pack cost it has seen.

    ``add(items, y)`` puts packs (any objects) with their normalized costs ``y``; ``take()`` emits the one the schedule
    picks for the next slot. ``first_batch``: batches this reader yielded before (earlier epochs of the pass), so its
    steps stay aligned with the other ranks'; ``counts``: a histogram to start from (the previous epoch's).
    """

    def __init__(self, balance: Balance, schedule: Schedule, scale: CostScale, *, first_batch: int = 0,
                 counts: np.ndarray | None = None) -> None:
        self.balance, self.schedule, self.scale = balance, schedule, scale
        self.floor = quantile_floor(balance.reservoir, schedule.ranks)
        self.hold = balance.hold(schedule.packs_per_batch)
        self.first_batch = first_batch
        self.counts = np.zeros(BINS, dtype=np.int64) if counts is None else np.array(counts, dtype=np.int64)
        self.items: list[T] = []
        self.costs: list[float] = []
        self.born: list[int] = []
        self.emitted = 0
        self._start = schedule_start(schedule.seed)
        self._cum: np.ndarray | None = None  # cumulative counts, until the next add

    def __len__(self) -> int:
        return len(self.items)

    @property
    def batch(self) -> int:
        """The batch (of this reader, counted over the pass) the next pack goes to."""
        return self.first_batch + self.emitted // self.schedule.packs_per_batch

    def load(self, *, counts: np.ndarray, first_batch: int, emitted: int) -> None:
        """Restore the counters of a saved reservoir (its packs are then ``add``-ed with ``count=False``)."""
        self.counts = np.array(counts, dtype=np.int64)
        self.first_batch, self.emitted, self._cum = int(first_batch), int(emitted), None

    def add(self, items: Sequence[T], y: np.ndarray, *, born: Sequence[int] | None = None, count: bool = True) -> None:
        """Hold ``items`` (normalized costs ``y``); ``count`` them in the histogram unless they
        were counted before (a restore)."""
        y = np.asarray(y, dtype=np.float64)
        assert len(items) == y.size, (len(items), y.size)
        self.items += list(items)
        self.costs += y.tolist()
        self.born += [self.batch] * len(items) if born is None else [int(b) for b in born]
        if count:
            self.counts += np.bincount(self.scale.bins(y), minlength=BINS)
            self._cum = None

    def target(self) -> float:
        """The normalized cost level the next slot aims at."""
        k = self.schedule.packs_per_batch
        u = schedule_point(self.schedule.seed, self.schedule.step(self.batch), self._start)
        q = target_quantiles(self.balance, u, k, self.floor)[self.emitted % k]
        if self._cum is None:
            self._cum = np.cumsum(self.counts)
        return float(self.scale.levels(self._cum, np.array([q]))[0])

    def take(self) -> tuple[T, int, bool]:
        """``(item, steps it waited, forced)`` for the next slot; the reservoir must not be empty."""
        assert self.items, "take() from an empty reservoir"
        ages = self.batch - np.asarray(self.born, dtype=np.int64)
        index, forced = choose(np.asarray(self.costs)[None], ages[None], np.ones((1, len(self.items)), dtype=bool),
                               np.array([self.target()]), hold=self.hold, tolerance=self.balance.tolerance)
        i = int(index[0])
        waited = int(ages[i])
        self.costs.pop(i)
        self.born.pop(i)
        self.emitted += 1
        return self.items.pop(i), waited, bool(forced[0])
