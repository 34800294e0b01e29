"""Cost-balanced emission: which ready pack a reader emits at each step, with no communication.

Every rank computes the same schedule of cost quantiles from ``(seed, step)``; each reader turns them into cost levels
with its histogram of pack costs and picks from its :class:`~streampack.packing.reservoir.Reservoir` (the rules:
``docs/algorithms.md``, "Compute-balanced packing"). With a reservoir of 64 the straggler factor at 1,024 ranks and
128k is 1.035, against 2.51 in token order.

Host memory: ``reservoir x capacity`` tokens per reader. State: the reservoir's documents as
references (56 bytes each), a histogram of ``BINS`` counts (8 KB) and each pack's step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

GOLDEN = (math.sqrt(5) - 1) / 2
"""Step of the schedule's low-discrepancy sequence (any run of n steps covers [0, 1) evenly)."""
BINS = 1024
"""Histogram bins of normalized pack cost between ``CostScale.lo`` and 1."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Balance:
    """Options of cost-balanced emission (``PackedDataset(balance=...)``)."""

    reservoir: int = 64
    """Ready packs each reader holds to choose from (more: better balance, more latency and
    host memory; the resume state stores them as references)."""
    max_hold: int | None = None
    """Steps after which a waiting pack goes at the first step whose level it does not exceed
    (``metrics()["packing"]["forced_by_hold"]``); default ``max(16, 4 * ceil(reservoir / packs_per_batch))``."""
    tail: float = 0.1
    """Share of the costliest packs whose levels the schedule serves faster than they arrive."""
    over: float = 0.2
    """The tail's levels are targeted ``1 + over`` times as often as they arrive, so heavy packs never
    pile up in a reader (a pile-up forces one out at a light step: a straggler)."""
    tolerance: float = 0.02
    """A pack up to this share lighter than the best match may go instead, the oldest first
    (bounds waiting at ~the cost of that share of balance)."""
    seeded: bool = True
    """Start every reader's cost histogram from the same sample of the shard indexes' lengths
    (:mod:`streampack.plan.cost_seed`), so the ranks' levels agree from step 0, not after ~2,000 packs."""

    def __post_init__(self) -> None:
        if isinstance(self.reservoir, bool) or not isinstance(self.reservoir, int) or self.reservoir < 1:
            raise ValueError(f"reservoir={self.reservoir!r} must be an int >= 1")
        if self.max_hold is not None and (isinstance(self.max_hold, bool) or not isinstance(self.max_hold, int)
                                          or self.max_hold < 1):
            raise ValueError(f"max_hold={self.max_hold!r} must be None or an int >= 1")
        if not (0 < self.tail < 1 and self.over >= 0 and self.tail * (1 + self.over) < 1):
            raise ValueError(f"need 0 < tail < 1, over >= 0 and tail * (1 + over) < 1; got "
                             f"tail={self.tail!r}, over={self.over!r}")
        if not isinstance(self.seeded, bool):
            raise TypeError(f"seeded={self.seeded!r} must be a bool")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance={self.tolerance!r} must be in [0, 1)")

    def hold(self, packs_per_batch: int) -> int:
        if self.max_hold is not None:
            return self.max_hold
        return max(16, 4 * -(-self.reservoir // packs_per_batch))


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
    """float64 ``[k]``: the cost quantile each of a batch's ``k`` packs aims at: stratified ``(j + u) / k``,
    the tail (survival below ``tail * (1 + over)``) served ``1 + over`` times as often as it arrives,
    the body spread over ``[floor, 1 - tail]``."""
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

    def levels(self, cum: np.ndarray, q: np.ndarray) -> np.ndarray:
        """Normalized cost at quantiles ``q`` (``[..., k]``) of histograms with cumulative counts ``cum``
        (int ``[..., BINS]``, ``np.cumsum(counts, axis=-1)``): the upper edge of the first bin reaching ``q`` of the
        total."""
        need = q * cum[..., -1:]
        b = (cum[..., None, :] < need[..., :, None]).sum(-1)
        return self.lo + (np.minimum(b, BINS - 1) + 1) / BINS * (1 - self.lo)


def choose(costs: np.ndarray, ages: np.ndarray, valid: np.ndarray, target: np.ndarray, *,
           hold: int, tolerance: float) -> tuple[np.ndarray, np.ndarray]:
    """One pick per row (a reader): ``(index [rows], forced [rows])``. ``costs`` / ``ages`` / ``valid``
    are ``[rows, n]`` (normalized cost, steps waited, which slots hold a pack), ``target`` ``[rows]``:
    the heaviest pack not above the target (else the lightest), or the oldest within ``tolerance``
    below it; a pack held ``hold`` steps goes at the first step whose target it does not exceed."""
    below = valid & (costs <= target[:, None])
    best = np.where(below, costs, -np.inf).max(1)
    lightest = np.where(valid, costs, np.inf).min(1)
    has = np.isfinite(best)
    ref = np.where(has, best, lightest)
    upper = np.where(has, target, lightest)[:, None]
    fits = valid & (costs <= upper)
    near = fits & (costs >= ref[:, None] * (1 - tolerance))
    expired = fits & (ages >= hold)
    forced = expired.any(1)
    pool = np.where(forced[:, None], expired, near)
    # the oldest of the pool (ties: the heavier, then the lower slot)
    index = np.where(pool, ages * 4.0 + costs, -np.inf).argmax(1)
    assert bool(valid[np.arange(costs.shape[0]), index].all()), "picked an empty slot"
    return index, forced
