"""Cost-balanced emission: which ready pack a reader emits at each step, with no communication.

**Why.** Packs hold the same tokens, not the same work: causal attention grows with ``Σ L²``,
so with a Llama-3-8B shape a 128k pack of one document costs 3.3x a pack of short ones. In
data-parallel training every step waits for the slowest rank, and with 1,024 ranks some rank
nearly always holds a heavy pack: the straggler factor (max over ranks / mean, per step) is
2.5 at 128k and 1.35 at 32k with today's packer (``benchmarks/bench_balance.py``).

**Design.** The packs are the ones the window packer makes anyway (fill and batch counts do
not change); only their order — and with ``packs_per_batch = k > 1`` their grouping — does.
Every rank computes the same schedule from ``(seed, step)`` alone: global step ``s`` gets the
point ``u = frac(u0(seed) + s * GOLDEN)`` (any run of n steps covers [0, 1) evenly), each of
the batch's k slots a quantile (stratified: ``(j + u) / k``, so a batch holds one pack of each
k-th of the cost distribution), reshaped so that the costliest ``tail`` of the levels is aimed
at ``1 + over`` times as often as such packs arrive and the lowest quantiles, where some of
``ranks`` readers would hold no pack, are skipped. A reader turns the quantile into a cost level
with the histogram of every pack cost it has seen — every rank's stream has the same length
distribution, so the histograms converge to the same levels — and emits from its
:class:`~streampack.packing.reservoir.Reservoir` of ready packs the heaviest one not above the level (any within
``tolerance`` below it may go instead, the oldest first). So at each step every rank emits a
pack of about the same cost, and hardly any rank exceeds the level: that is the straggler.

**Latency.** A pack waits ``reservoir / k`` steps on average (Little's law); among the packs
within tolerance of the best match the oldest goes. After ``max_hold`` steps a pack goes at the
first step whose level it does not exceed, whatever else is ready (counted as ``forced``): an
old heavy pack never leaves at a light step, the one event that makes a straggler.

**Why these rules** (``python benchmarks/bench_balance.py``, 1,024 ranks, 128k, k = 1): the
straggler factor is 1.035 with a reservoir of 64 packs and warm histograms, against 2.51
emitting in token order; a reservoir of 32 gives 1.072 and 128 gives 1.021 for 1.6x the state
(the simulator's table and the rules tried and dropped: ``benchmarks/README.md``,
"Compute-balanced packing", and ``docs/changelog.md``).

**Seeded** (``Balance.seeded``): every reader starts from one histogram, the same on every rank
(:mod:`streampack.plan.cost_seed`: the packer's own packs of one sample of the shard indexes'
lengths, counted as 20,000 packs), so the levels agree from step 0 — a cold start differs not by
too few packs but by each reader's levels coming from its own few. End to end, 16 ranks of
``PackedDataset`` at 128k, steps 0–500 (``benchmarks/bench_balance_e2e.py``): straggler 1.027
seeded, 1.064 cold.

Host memory: the reservoir's packs, ``reservoir x capacity`` tokens per reader (64 MB of int64
ids at 128k). State: the reservoir's documents as references (56 bytes each), a histogram of
``BINS`` counts (8 KB) and each pack's step. Building it costs 7.7 ms per ``state_dict()`` at
128k (0.9 ms at 4k): it re-lists ~3,300 held documents, cheap next to a 128k training step.
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
    """Steps (batches of this reader) after which a waiting pack goes at the first step whose
    level it does not exceed, whatever else is ready (counted in
    ``metrics()["packing"]["forced_by_hold"]``). Default ``max(16, 4 * ceil(reservoir /
    packs_per_batch))``: a pack waits ``reservoir / packs_per_batch`` steps on average."""
    tail: float = 0.1
    """Share of the costliest packs whose levels the schedule serves faster than they arrive."""
    over: float = 0.2
    """How much faster: the schedule targets the tail's levels ``1 + over`` times as often as
    they arrive, so heavy packs never pile up in a reader (a pile-up would force one out at a
    light step, the one event that makes a straggler)."""
    tolerance: float = 0.02
    """A pack up to this share lighter than the best match may go instead, the oldest first
    (bounds waiting at ~the cost of that share of balance)."""
    seeded: bool = True
    """Start every reader's cost histogram from the packs of one length sample of the data set's
    shard indexes, the same on every rank (:mod:`streampack.plan.cost_seed`), so the levels agree
    from step 0; False starts it empty (the ranks agree only after ~2,000 packs each)."""

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
    above); any pack within ``tolerance`` below it may go instead, and the oldest of those
    goes. A pack that has waited ``hold`` steps goes at the first step whose target it does not
    exceed, whatever else is ready (``forced``): never above the target, so it never makes a
    straggler.
    """
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
