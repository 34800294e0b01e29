"""Finite epochs without guesswork: which samples one reader reads, and how many batches it yields.

Each reader plans only its own share of an epoch from the data set's manifest: the epoch's shards in the ``(seed,
epoch)`` order are cut into contiguous sample ranges balanced by token count, ranks first, then each rank's workers
(:class:`~streampack.plan.sharding.PrefixCut`, opening only the <= 4 shards its boundaries fall in). When every rank
must yield the same number of batches, the plan carries a late quota (:mod:`streampack.plan.quota`): after the first
batch, in the background, the reader counts its own batches through the packer's round logic and the readers agree on
the counts (:mod:`streampack.plan.agree`); the quota says how many fillers make its rank's total the largest rank's.
``equal_batches="count"`` has each reader count every reader's batches instead (O(T)).

**Cost per reader and epoch** (N shards, T samples, G readers; ``benchmarks/bench_scale.py``): before
the first batch, 1 manifest read per process and at most 4 boundary shards' indexes, CPU
~0.06-0.4 µs · N; after it, in the background, the indexes of its own ~N/G shards (not kept),
~1-6 µs · T/G of packer count and 5 store requests; memory ~122 B · N for the manifest + ~48 B · T/G
at the count's peak. At N=10^5, T=10^9, G=8,192: 5 requests before the first batch, 18 after, 0.2-0.7 s
of CPU, ~17 MB.

The plan leaves exactly the fillers the cut needs (``docs/dataset.md``); a second, count-weighted re-cut did not
reduce them reliably, so there is none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from streampack.io.index import ShardIndex, unknown_lengths_hint
from streampack.packing.window_rounds import PackerRules, count_packs, worker_seed
from streampack.plan.agree import RankCounts
from streampack.plan.quota import LateQuota, Settled
from streampack.plan.sharding import (
    IndexRange,
    PrefixCut,
    Span,
    WorkEnds,
    epoch_permutation,
    order_positions,
    spans_from_ends,
)


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
                   lengths=np.asarray(index.lengths, dtype=np.int32), end=int(index.end), damaged=bool(index.damage))

    def __len__(self) -> int:
        return len(self.offsets)

    def range_of(self, span: Span) -> tuple[int, int]:
        """The samples ``[lo, hi)`` a span of this shard reads."""
        lo = int(np.searchsorted(self.offsets, span.start, side="left"))
        hi = len(self) if span.end is None else int(np.searchsorted(self.offsets, span.end, side="left"))
        return lo, max(lo, hi)

    def span(self, shard: int, lo: int, hi: int, epoch: int | None = None) -> Span:
        """Samples ``[lo, hi)`` as a byte range."""
        start = int(self.offsets[lo]) if lo < len(self) else self.end
        first = int(self.numbers[lo]) if lo < len(self) else (int(self.numbers[-1]) + 1 if len(self) else 0)
        end = int(self.offsets[hi]) if hi < len(self) else (None if self.damaged else self.end)
        return Span(shard=shard, start=start, first=first, end=end, epoch=epoch)

    def costs(self, lo: int = 0, hi: int | None = None, *, tokens: bool) -> np.ndarray:
        """Balancing cost of samples ``[lo, hi)``: token counts, or bytes when ``tokens`` is False."""
        hi = len(self) if hi is None else hi
        if tokens:  # a refused record (BAD_LENGTH) costs nothing, as in the manifest's shard totals
            return np.maximum(self.lengths[lo:hi], 0)
        nxt = np.append(self.offsets[1:], self.end)
        return np.maximum(nxt[lo:hi] - self.offsets[lo:hi], 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReaderPlan:
    """One global reader's share of an epoch."""

    epoch: int
    spans: list[Span]
    quota: LateQuota | None
    """Batches it yields, fillers included, settled when first needed (None: as many as its data makes)."""


Agree = Callable[[str, int, int, int, int], RankCounts]
"""``agree(key, dp_rank, worker_id, num_workers, count)``: every rank's total of its readers'
``count`` reduced to the largest (``target``) and this rank's per-worker counts (``workers``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Counting:
    """What counting batches needs: the packer's rules, the overlong policy, packs per batch."""

    rules: PackerRules
    """The packer's rules; ``seed`` is the stream seed (each worker packs with ``worker_seed``)."""
    max_len: int
    policy: str
    packs_per_batch: int


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
    """Batches one worker makes from raw ``stream`` lengths after ``carry`` (already cut) lengths."""
    stream = np.asarray(stream)
    stream = stream[stream > 0]  # an empty or refused record (0, BAD_LENGTH) never reaches the packer
    return count_chunks(counting, global_worker, chunk_lengths(stream, counting.max_len, counting.policy), carry)


def count_chunks(counting: Counting, global_worker: int, chunks: np.ndarray, carry: np.ndarray | None = None) -> int:
    """:func:`count_batches` of documents already cut by the overlong policy."""
    packs = count_packs(replace(counting.rules, seed=worker_seed(counting.rules.seed, global_worker)), chunks, carry)
    return -(-packs // counting.packs_per_batch)


def rank_quotas(workers: Sequence[int], target: int) -> list[int]:
    """One rank's quotas: ``target - sum(workers)`` fillers given one by one to the worker with the fewest
    batches so far (so DataLoader round-robin keeps them at the end of the epoch)."""
    quotas = list(workers)
    for _ in range(target - sum(workers)):
        w = min(range(len(quotas)), key=lambda i: (quotas[i], i))
        quotas[w] += 1
    return quotas


def equalize(batches: Sequence[int], ranks: int) -> tuple[list[int], int, int]:
    """Quotas making every rank's total the largest rank's: ``(quota per worker, fillers,
    fewest fillers possible)`` (:func:`rank_quotas` for each rank)."""
    per_rank = len(batches) // ranks
    groups = [list(batches[r * per_rank:(r + 1) * per_rank]) for r in range(ranks)]
    target = max((sum(g) for g in groups), default=0)
    quotas = [q for g in groups for q in rank_quotas(g, target)]
    grand = sum(batches)
    return quotas, ranks * target - grand, ranks * -(-grand // ranks) - grand


class EpochPlanner:
    """Plans finite epochs for one reader of ``dp_size`` ranks x ``num_workers`` readers.

    ``shards``: the manifest; ``index(shard)`` loads one shard's index (only the shards read or cut);
    ``counting`` None plans without counting batches; ``agree`` (:data:`Agree`) equalizes the counts
    from this reader's own (without it every reader counts every reader's); ``chunks(shard, samples, lo, hi,
    max_len, policy)`` replaces the documents the index's lengths become (a media stream's, cut around its images:
    :mod:`streampack.media.plan_lengths`).
    """

    def __init__(self, shards: Any, index: Callable[[int], ShardIndex], *, seed: int, shuffle: bool,
                 dp_size: int, num_workers: int, counting: Counting | None, agree: Agree | None = None,
                 chunks: Callable[[int, ShardSamples, int, int, int, str], np.ndarray] | None = None) -> None:
        self.shards, self._load, self._media_chunks = shards, index, chunks
        self.num_shards = len(shards.urls)
        self.seed, self.shuffle, self.dp_size, self.num_workers = seed, shuffle, dp_size, num_workers
        self.counting, self.agree = counting, agree
        if counting is not None and not shards.known_lengths():
            raise ValueError(unplannable(shards, dp_size))
        self.tokens = counting is not None or shards.known_lengths()
        self._samples: dict[int, ShardSamples] = {}
        self._cut: tuple[int, PrefixCut] | None = None
        self._counts: dict[tuple[int, int], int] = {}
        self._plan: ReaderPlan | None = None
        self._plan_of: tuple[int, int] | None = None
        self._order: tuple[int, np.ndarray, np.ndarray] | None = None

    def samples(self, shard: int) -> ShardSamples:
        if shard not in self._samples:
            self._samples[shard] = ShardSamples.of(self._load(shard))
        return self._samples[shard]

    def cut(self, epoch: int) -> PrefixCut:
        """The epoch's order and shard prefix sums (one epoch kept at a time)."""
        if self._cut is None or self._cut[0] != epoch:
            order = epoch_permutation(self.num_shards, seed=self.seed, epoch=epoch, shuffle=self.shuffle)
            self._samples.clear()  # the last epoch's shards: memory stays O(own share)
            self._counts = {k: v for k, v in self._counts.items() if k[0] == epoch}
            self._cut = (epoch, PrefixCut(order, self.shards.samples, self.shards.costs(tokens=self.tokens),
                                          lambda s: self.samples(s).costs(tokens=self.tokens)))
        return self._cut[1]

    def ranges(self, epoch: int, global_worker: int) -> list[IndexRange]:
        """Reader ``global_worker``'s samples in ``epoch``, shard piece by shard piece."""
        cut = self.cut(epoch)
        return cut.pieces(*cut.bounds(self.dp_size, self.num_workers, global_worker))

    def spans(self, epoch: int, global_worker: int) -> list[Span]:
        """Its byte ranges: a whole shard needs no index (read to its end); a part is cut through that shard's index."""
        out = []
        for p in self.ranges(epoch, global_worker):
            whole = p.lo == 0 and p.hi == int(self.shards.samples[p.shard])
            out.append(Span(shard=p.shard) if whole else self.samples(p.shard).span(p.shard, p.lo, p.hi))
        return out

    def count(self, epoch: int, global_worker: int) -> int:
        """Batches reader ``global_worker`` makes in ``epoch`` (:meth:`count_spans` of its plan, once)."""
        key = (epoch, global_worker)
        if key not in self._counts:
            self._counts[key] = self.count_spans(global_worker, self.spans(epoch, global_worker))
        return self._counts[key]

    def count_spans(self, global_worker: int, spans: Sequence[Span], carry: np.ndarray | None = None) -> int:
        """Batches reader ``global_worker`` makes from ``spans`` after ``carry`` (chunk lengths already in
        its window); the indexes read here are not kept (memory O(T/G) lengths)."""
        assert self.counting is not None
        chunks = []
        for span in spans:
            samples = self._samples.get(span.shard) or ShardSamples.of(self._load(span.shard))
            chunks.append(self._chunks(span.shard, samples, *samples.range_of(span)))
        return count_chunks(self.counting, global_worker, np.concatenate(chunks or [np.zeros(0, np.int64)]), carry)

    def _chunks(self, shard: int, samples: ShardSamples, lo: int, hi: int) -> np.ndarray:
        """The document lengths samples ``lo:hi`` of ``shard`` become under the overlong policy (a media stream's
        ``chunks`` cuts them itself, around images)."""
        assert self.counting is not None
        max_len, policy = self.counting.max_len, self.counting.policy
        if self._media_chunks is not None:
            return self._media_chunks(shard, samples, lo, hi, max_len, policy)
        stream = samples.lengths[lo:hi]
        return chunk_lengths(stream[stream > 0], max_len, policy)  # 0: a record the reader skips

    def spans_from_ends(self, epoch: int, ends: WorkEnds) -> list[Span] | None:
        """The spans a state recorded as their ends (``ShardReader``'s ``work_ends``), rebuilt from the epoch's order
        and the manifest's sample counts with no index read (:func:`~streampack.plan.sharding.spans_from_ends`)."""
        if self._order is None or self._order[0] != epoch:  # once per epoch: an elastic resume asks for every reader
            order = epoch_permutation(self.num_shards, seed=self.seed, epoch=epoch, shuffle=self.shuffle)
            self._order = (epoch, order, order_positions(order))
        _, order, where = self._order
        return spans_from_ends(ends, order, where, self.shards.samples)

    def plan(self, epoch: int, global_worker: int, info: dict[str, Any] | None = None,
             spans: list[Span] | None = None) -> ReaderPlan:
        """Reader ``global_worker``'s spans and (when batches are counted) its late quota. ``spans``: the ones a
        restored state recorded (:meth:`spans_from_ends`), taken instead of cutting the epoch again, which reads
        the index of every shard a boundary falls in (up to 4) before a restored reader's first batch
        (``benchmarks/bench_restore.py --phases``, "of which plan")."""
        if self._plan is None or self._plan_of != (epoch, global_worker) or spans is not None:
            spans = spans if spans is not None else self.spans(epoch, global_worker)
            quota = None
            if self.counting is not None:
                quota = LateQuota(count=lambda: self.count_spans(global_worker, spans),
                                  settle=lambda mine: self.settle(f"plan/{epoch}", global_worker, mine,
                                                                  lambda h: self.count(epoch, h)),
                                  background=self.agree is not None, info=info)
            self._plan, self._plan_of = ReaderPlan(epoch=epoch, spans=spans, quota=quota), (epoch, global_worker)
        return self._plan

    def settle(self, key: str, g: int, mine: int, count: Callable[[int], int]) -> Settled:
        """Reader ``g``'s quota from its own batch count ``mine``: agreed in store round ``key`` (O(1) requests, no
        one else's data), else from ``count(h)`` of every other reader ``h`` (O(T))."""
        rank, worker = divmod(g, self.num_workers)
        if self.agree is not None:
            got = self.agree(key, rank, worker, self.num_workers, mine)
            quotas = rank_quotas(list(got.workers), int(got.target))
            return Settled(quota=quotas[worker], batches=mine, rank_fillers=int(got.target) - sum(got.workers))
        counts = [mine if h == g else count(h) for h in range(self.dp_size * self.num_workers)]
        quotas, fillers, least = equalize(counts, self.dp_size)
        group = slice(rank * self.num_workers, (rank + 1) * self.num_workers)
        return Settled(quota=quotas[g], batches=mine, rank_fillers=sum(quotas[group]) - sum(counts[group]),
                       fillers=fillers, min_fillers=least)


def unplannable(shards: Any, dp_size: int) -> str:
    """Why equal batch counts cannot be planned for these shards, naming them."""
    unknown = [shards.urls[i] for i in np.flatnonzero(np.asarray(shards.tokens) < 0)]
    return (f"finite epochs over dp_size={dp_size} ranks are planned from the shards' token lengths, which "
            f"{len(unknown)} of {len(shards.urls)} shards do not have ({unknown_lengths_hint(unknown)}; tokens "
            f"field '{getattr(shards, 'tokens_key', 'input_ids')}'), e.g. {unknown[:3]}: pass equal_batches='sync' and "
            f"iterate streampack.sync_batches(loader, ds) (one all-reduce per step), or batches_per_epoch")
