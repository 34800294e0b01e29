"""Cost-balanced emission: which ready pack a reader emits at each step, with no communication.

(Design notes and measured trade-offs: filled in below once measured.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

GOLDEN = (math.sqrt(5) - 1) / 2
"""Step of the schedule's low-discrepancy sequence (any run of n steps covers [0, 1) evenly)."""
BINS = 1024
"""Histogram bins of normalized pack cost between ``CostLevels.lo`` and 1."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Balance:
    """Options of cost-balanced emission (``PackedDataset(balance=...)``)."""

    reservoir: int = 64
    """Ready packs each reader holds to choose from (more: better balance, more latency and
    host memory; the resume state stores them as references)."""
    max_hold: int | None = None
    """Steps (batches of this reader) after which a waiting pack goes at the first step it
    does not make a straggler; after twice as many it goes at the first step whose target
    it does not exceed (counted in ``metrics()["packing"]["forced_by_hold"]``). Default
    ``max(8, 2 * ceil(reservoir / packs_per_batch))``: a pack waits ``reservoir /
    packs_per_batch`` steps on average."""
    tail: float = 0.1
    """Share of the costliest packs whose levels the schedule serves faster than they arrive."""
    over: float = 0.2
    """How much faster: the schedule targets the tail's levels ``1 + over`` times as often as
    they arrive, so heavy packs never pile up in a reader (a pile-up would force one out at a
    light step, the one event that makes a straggler)."""
    tolerance: float = 0.02
    """A pack up to this share lighter than the best match may go instead, the oldest first
    (bounds waiting at ~the cost of that share of balance)."""

    def __post_init__(self) -> None:
        if isinstance(self.reservoir, bool) or not isinstance(self.reservoir, int) or self.reservoir < 1:
            raise ValueError(f"reservoir={self.reservoir!r} must be an int >= 1")
        if self.max_hold is not None and (isinstance(self.max_hold, bool) or not isinstance(self.max_hold, int)
                                          or self.max_hold < 1):
            raise ValueError(f"max_hold={self.max_hold!r} must be None or an int >= 1")
        if not (0 < self.tail < 1 and self.over >= 0 and self.tail * (1 + self.over) < 1):
            raise ValueError(f"need 0 < tail < 1, over >= 0 and tail * (1 + over) < 1; got "
                             f"tail={self.tail!r}, over={self.over!r}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance={self.tolerance!r} must be in [0, 1)")

    def hold(self, packs_per_batch: int) -> int:
        if self.max_hold is not None:
            return self.max_hold
        return max(8, 2 * -(-self.reservoir // packs_per_batch))


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """Where one reader's steps sit in the schedule every rank shares."""

    seed: int = 0
    """The stream's seed (the same on every rank; not the per-worker packing seed)."""
    packs_per_batch: int = 1
    lane: int = 0
    """This reader's index among its rank's readers (the DataLoader worker id)."""
    lanes: int = 1
    """Readers per rank: a DataLoader hands out their batches in turn, so the rank's step of
    this reader's batch ``b`` is ``b * lanes + lane`` on every rank."""
    ranks: int = 1
    """Data-parallel ranks (sets the lowest quantile worth aiming at)."""

    def __post_init__(self) -> None:
        if not (self.packs_per_batch >= 1 and self.lanes >= 1 and 0 <= self.lane < self.lanes and self.ranks >= 1):
            raise ValueError(f"need packs_per_batch, lanes, ranks >= 1 and 0 <= lane < lanes; got {self!r}")

    def step(self, batch: int) -> int:
        return batch * self.lanes + self.lane


def schedule_start(seed: int) -> float:
    """``u0``: where the schedule of ``seed`` starts."""
    return float(np.random.default_rng([int(seed), 0x5CED]).random())


def schedule_point(seed: int, step: int, start: float | None = None) -> float:
    """``u`` in [0, 1) of global step ``step``: ``frac(u0(seed) + step * GOLDEN)`` — the same on
    every rank, evenly spread over any window of steps (``start``: ``schedule_start(seed)``)."""
    u0 = schedule_start(seed) if start is None else start
    return (u0 + math.fmod(step * GOLDEN, 1.0)) % 1.0


def quantile_floor(reservoir: int, ranks: int) -> float:
    """The lowest quantile worth aiming at: below it, some of ``ranks`` readers of ``reservoir``
    ready packs each would hold none (chance ``(1 - q) ** reservoir`` per reader, kept under
    ``0.1 / ranks``), and those would emit a heavier pack than the others at that step."""
    return min(0.5, 1 - (0.1 / max(ranks, 1)) ** (1 / reservoir))


def target_quantiles(balance: Balance, u: float, k: int, floor: float = 0.0) -> np.ndarray:
    """float64 ``[k]``: the cost quantile each of a batch's ``k`` packs aims at.

    Stratified (``(j + u) / k`` for slot j), so a batch of ``k`` packs holds one from each
    k-th of the cost distribution; then the tail (survival below ``tail * (1 + over)``) is
    served ``1 + over`` times as often as it arrives, and the body is spread over the
    quantiles ``[floor, 1 - tail]``.
    """
    survival = 1 - (np.arange(k) + u) / k
    cut = balance.tail * (1 + balance.over)
    body = balance.tail + (survival - cut) * (1 - floor - balance.tail) / (1 - cut)
    return 1 - np.where(survival < cut, survival / (1 + balance.over), body)


@dataclass(frozen=True, slots=True, kw_only=True)
class CostScale:
    """Normalized cost ``y = cost / full`` (``full``: one document filling the pack), and
    the histogram range ``[lo, 1]`` (half the linear cost of a full pack; lower clamps)."""

    full: float
    lo: float

    @classmethod
    def of(cls, linear: float, attention: float, capacity: int) -> CostScale:
        full = linear * capacity + attention * float(capacity) ** 2
        if full <= 0:
            raise ValueError(f"the cost model gives a full pack of {capacity=} no cost")
        return cls(full=full, lo=0.5 * linear * capacity / full)

    def bins(self, y: np.ndarray) -> np.ndarray:
        """Histogram bin of each normalized cost (int64)."""
        b = np.floor((np.asarray(y, dtype=np.float64) - self.lo) / (1 - self.lo) * BINS)
        return np.clip(b, 0, BINS - 1).astype(np.int64)

    def levels(self, counts: np.ndarray, q: np.ndarray) -> np.ndarray:
        """Normalized cost at quantiles ``q`` (``[..., k]``) of histograms ``counts``
        (int ``[..., BINS]``): the upper edge of the first bin reaching ``q`` of the total."""
        return self.levels_of(np.cumsum(counts, axis=-1), q)

    def levels_of(self, cum: np.ndarray, q: np.ndarray) -> np.ndarray:
        """:meth:`levels` from cumulative counts ``cum`` (``np.cumsum(counts, axis=-1)``)."""
        need = q * cum[..., -1:]
        b = (cum[..., None, :] < need[..., :, None]).sum(-1)
        return self.lo + (np.minimum(b, BINS - 1) + 1) / BINS * (1 - self.lo)


def choose(costs: np.ndarray, ages: np.ndarray, valid: np.ndarray, target: np.ndarray, *,
           hold: int, tolerance: float) -> tuple[np.ndarray, np.ndarray]:
    """One pick per row (a reader): ``(index [rows], forced [rows])``.

    ``costs`` / ``ages`` / ``valid``: ``[rows, n]`` normalized cost, steps waited and which
    slots hold a pack (each row holds at least one); ``target``: ``[rows]`` level to aim at.
    The best match is the heaviest pack not above the target (or the lightest if all are
    above); any pack within ``tolerance`` below it may go instead: one that has waited
    ``hold`` steps first, else the oldest. A pack that has waited ``2 * hold`` steps goes at
    the first step whose target it does not exceed, whatever else is ready (``forced``): never
    above the target, so it never makes a straggler.
    """
    below = valid & (costs <= target[:, None])
    best = np.where(below, costs, -np.inf).max(1)
    lightest = np.where(valid, costs, np.inf).min(1)
    has = np.isfinite(best)
    ref = np.where(has, best, lightest)
    upper = np.where(has, target, lightest)[:, None]
    fits = valid & (costs <= upper)
    near = fits & (costs >= ref[:, None] * (1 - tolerance))
    overdue = near & (ages >= hold)
    expired = fits & (ages >= 2 * hold)
    forced = expired.any(1)
    pool = np.where(forced[:, None], expired, np.where(overdue.any(1)[:, None], overdue, near))
    # the oldest of the pool (ties: the heavier, then the lower slot)
    index = np.where(pool, ages * 4.0 + costs, -np.inf).argmax(1)
    assert bool(valid[np.arange(costs.shape[0]), index].all()), "picked an empty slot"
    return index, forced


T = TypeVar("T")


class Reservoir(Generic[T]):
    """The ready packs of one reader and the histogram of every pack cost it has seen.

    ``add(items, y)`` puts packs (any objects) with their normalized costs ``y``; ``take()``
    emits the one the schedule picks for the next slot. ``first_batch``: batches this
    reader yielded before (earlier epochs of the pass), so its steps stay aligned with the
    other ranks'; ``counts``: a histogram to start from (the previous epoch's).
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
        """Restore the counters of a saved reservoir (its packs are then ``add``-ed with
        ``count=False``)."""
        self.counts = np.array(counts, dtype=np.int64)
        self.first_batch, self.emitted, self._cum = int(first_batch), int(emitted), None

    def add(self, items: Sequence[T], y: np.ndarray, *, born: Sequence[int] | None = None,
            count: bool = True) -> None:
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
        return float(self.scale.levels_of(self._cum, np.array([q]))[0])

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
