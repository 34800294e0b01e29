"""Finite epochs without guesswork: who reads which samples, and how many batches each yields.

Every worker of every rank computes the same :class:`EpochPlan` from the shard indexes alone
(no communication): the epoch's samples, shard after shard in the ``(seed, epoch)`` order, are
cut into contiguous ranges balanced by token count — ranks first, then each rank's workers
(``sharding.cut_two_level``) — and, when every rank must yield the same number of batches,
each worker's packer is simulated on its known lengths (``window_packer.count_packs``: the
node's own round logic on lengths alone) to count its batches. Every rank then yields the
largest rank's count, the others completing theirs with filler batches
(:func:`equalize`). The plan also reports the lower bound ``R * ceil(total / R) - total`` on
fillers that any assignment of these batches to ``R`` ranks must pay.

Trade-off against agreeing at run time (``streampack.sync_batches``: one all-reduce of "I
still have data" per step), measured on this shared 2-core box (``python
benchmarks/bench_state.py --plan --sync``; provisional): the plan costs one index read per
shard (cached beside the shard) and a packing simulation of the whole epoch in every reader
at the start of each epoch — 0.6 µs per sample, 0.6 s per million samples whether 2, 8 or 64
ranks (1.8 s with the box loaded) — and nothing per step; it needs token lengths in the index (pre-tokenized shards) and
no stage that changes lengths. Agreeing per step works for any data (text, stages) but costs
one all-reduce per step (0.35 ms on gloo with 2 local processes, 0.9 ms loaded; NCCL is far cheaper) and needs
the training loop's cooperation. Both leave the same fillers for the same split: on 1M
lognormal samples (mean 600, capacity 4096, 2 packs per batch, 2 readers per rank) 2 over 2
ranks, 7 over 8, 117 over 64 (0.16% of 73k batches; the lower bound with batches free to
move between ranks is 0, 7 and 53). A second, count-weighted re-cut did not help reliably
(64 ranks: 113 -> 77..97; 8 ranks: 7 -> 12..17), so there is none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from streampack.io.index import ShardIndex
from streampack.nodes.sharding import (
    IndexRange,
    Span,
    cut_two_level,
    epoch_permutation,
    split_ranges,
)
from streampack.nodes.window_rounds import PackerRules, count_packs, worker_seed


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardSamples:
    """The compact part of a shard index a plan needs (numpy, not per-sample Python objects)."""

    offsets: np.ndarray
    numbers: np.ndarray
    lengths: np.ndarray
    """Token counts (-1 where the index does not know them)."""
    end: int
    damaged: bool = False
    """The shard is damaged past ``end``: the range that ends it reads on to meet (and count) the damage."""

    @classmethod
    def of(cls, index: ShardIndex) -> ShardSamples:
        return cls(offsets=np.asarray(index.offsets, dtype=np.int64), numbers=np.asarray(index.numbers, dtype=np.int64),
                   lengths=np.asarray(index.lengths, dtype=np.int64), end=int(index.end), damaged=bool(index.damage))

    def __len__(self) -> int:
        return len(self.offsets)

    def span(self, shard: int, lo: int, hi: int, epoch: int | None = None) -> Span:
        """Samples ``[lo, hi)`` as a byte range."""
        start = int(self.offsets[lo]) if lo < len(self) else self.end
        first = int(self.numbers[lo]) if lo < len(self) else (int(self.numbers[-1]) + 1 if len(self) else 0)
        end = int(self.offsets[hi]) if hi < len(self) else (None if self.damaged else self.end)
        return Span(shard=shard, start=start, first=first, end=end, epoch=epoch)

    def costs(self, lo: int = 0, hi: int | None = None, *, tokens: bool) -> np.ndarray:
        """Balancing cost of samples ``[lo, hi)``: token counts, or bytes when ``tokens`` is False."""
        hi = len(self) if hi is None else hi
        if tokens:
            return self.lengths[lo:hi]
        nxt = np.append(self.offsets[1:], self.end)
        return np.maximum(nxt[lo:hi] - self.offsets[lo:hi], 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerPlan:
    """One global worker's share of an epoch."""

    spans: list[Span]
    batches: int | None
    """Batches its own data makes (None when not counted)."""
    quota: int | None
    """Batches it yields, fillers included (None: as many as its data makes)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EpochPlan:
    epoch: int
    workers: list[WorkerPlan]
    """By global worker."""
    fillers: int
    """Filler batches over all ranks."""
    min_fillers: int
    """Fewest fillers any assignment of these batches to the ranks needs."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Counting:
    """What counting batches needs: the packer's rules, the overlong policy, packs per batch."""

    rules: PackerRules
    """The packer's rules; ``seed`` is the stream seed (each worker packs with ``worker_seed``)."""
    max_len: int
    policy: str
    packs_per_batch: int

    def for_worker(self, global_worker: int) -> PackerRules:
        return replace(self.rules, seed=worker_seed(self.rules.seed, global_worker))


def chunk_lengths(lengths: np.ndarray, max_len: int, policy: str) -> np.ndarray:
    """The document lengths ``lengths`` become under the overlong policy, in stream order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if policy == "drop":
        return lengths[lengths <= max_len]
    if policy != "split":
        return np.minimum(lengths, max_len)
    reps = np.maximum(-(-lengths // max_len), 1)
    out = np.full(int(reps.sum()), max_len, dtype=np.int64)
    out[np.cumsum(reps) - 1] = lengths - (reps - 1) * max_len
    return out


def count_batches(counting: Counting, global_worker: int, stream: np.ndarray, carry: np.ndarray | None = None) -> int:
    """Batches one worker's packer and collate make from documents of raw ``stream`` lengths
    (the overlong policy is applied here) after ``carry`` (already cut) lengths."""
    chunks = chunk_lengths(stream, counting.max_len, counting.policy)
    packs = count_packs(counting.for_worker(global_worker), chunks, carry)
    return -(-packs // counting.packs_per_batch)


def equalize(batches: Sequence[int], ranks: int) -> tuple[list[int], int, int]:
    """Quotas making every rank's total the largest rank's: ``(quota per worker, fillers,
    fewest fillers possible)``. A rank's fillers go one by one to its worker with the fewest
    batches so far (so DataLoader round-robin keeps them at the end of the epoch)."""
    per_rank = len(batches) // ranks
    quotas = list(batches)
    totals = [sum(batches[r * per_rank:(r + 1) * per_rank]) for r in range(ranks)]
    target = max(totals, default=0)
    for r, total in enumerate(totals):
        for _ in range(target - total):
            w = min(range(r * per_rank, (r + 1) * per_rank), key=lambda i: (quotas[i], i))
            quotas[w] += 1
    grand = sum(totals)
    return quotas, ranks * target - grand, ranks * -(-grand // ranks) - grand


class EpochPlanner:
    """Plans finite epochs for ``dp_size`` ranks of ``num_workers`` readers each.

    ``index(shard)`` gives a shard's index (loaded once per process and kept in compact
    form). ``counting`` None plans who reads what without counting batches (one rank, or
    ranks that agree at run time).
    """

    def __init__(self, num_shards: int, index: Callable[[int], ShardIndex], *, seed: int, shuffle: bool,
                 dp_size: int, num_workers: int, counting: Counting | None) -> None:
        self.num_shards, self._load = num_shards, index
        self.seed, self.shuffle, self.dp_size, self.num_workers = seed, shuffle, dp_size, num_workers
        self.counting = counting
        self._samples: dict[int, ShardSamples] = {}
        self._plans: dict[int, EpochPlan] = {}

    def samples(self, shard: int) -> ShardSamples:
        if shard not in self._samples:
            self._samples[shard] = ShardSamples.of(self._load(shard))
        return self._samples[shard]

    def known_lengths(self) -> bool:
        """Whether every sample's token count is in the index (needed to count batches)."""
        return all((self.samples(s).lengths >= 0).all() for s in range(self.num_shards))

    def plan(self, epoch: int) -> EpochPlan:
        if epoch not in self._plans:
            self._plans = {epoch: self._make(epoch)}  # one epoch at a time is all a reader needs
        return self._plans[epoch]

    def _make(self, epoch: int) -> EpochPlan:
        order = epoch_permutation(self.num_shards, seed=self.seed, epoch=epoch, shuffle=self.shuffle).tolist()
        if self.dp_size * self.num_workers == 1 and self.counting is None:
            # one reader reads every shard whole: nothing to split or count, so no index (building
            # the indexes read every shard once more before the first batch: 2.8 s of a 5.9 s
            # epoch of 60,000 samples in 8 tar shards, benchmarks/bench_pipeline.py)
            spans = [Span(shard=s) for s in order]
            return EpochPlan(epoch=epoch, workers=[WorkerPlan(spans=spans, batches=None, quota=None)],
                             fillers=0, min_fillers=0)
        tokens = self.counting is not None or self.known_lengths()
        ranges = [IndexRange(shard=s, lo=0, hi=len(self.samples(s))) for s in order]
        costs = np.concatenate([self.samples(s).costs(tokens=tokens) for s in order] or [np.zeros(0, np.int64)])
        bounds = cut_two_level(costs, self.dp_size, self.num_workers)
        pieces = [split_ranges(ranges, int(bounds[g]), int(bounds[g + 1])) for g in range(len(bounds) - 1)]
        spans = [[self.samples(p.shard).span(p.shard, p.lo, p.hi) for p in ps] for ps in pieces]
        if self.counting is None:
            return EpochPlan(epoch=epoch, workers=[WorkerPlan(spans=s, batches=None, quota=None) for s in spans],
                             fillers=0, min_fillers=0)
        batches = [count_batches(self.counting, g, self.range_lengths(ps)) for g, ps in enumerate(pieces)]
        quotas, fillers, least = equalize(batches, self.dp_size)
        return EpochPlan(epoch=epoch, workers=[WorkerPlan(spans=s, batches=b, quota=q)
                                               for s, b, q in zip(spans, batches, quotas)],
                         fillers=fillers, min_fillers=least)

    def range_lengths(self, pieces: Sequence[IndexRange]) -> np.ndarray:
        return np.concatenate([self.samples(p.shard).lengths[p.lo:p.hi] for p in pieces] or [np.zeros(0, np.int64)])
