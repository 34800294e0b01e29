"""Which samples each global worker reads in each epoch: pure assignment arithmetic.

Epoch ``e`` orders the shards by a permutation seeded by ``(seed, e)``, the same on every rank. Infinite streams assign
by shard (:func:`assign_shards`: whole shards at positions ``g, g + G, ...`` while there are at least ``G`` shards, so
no shard index is read; else one part of one shard). Finite epochs assign by sample (:class:`PrefixCut`): the epoch's
samples are cut into ``G`` contiguous ranges of nearly equal cost (tokens, or bytes), ranks first and then each rank's
workers, which keeps filler batches few. **Cost per reader** (N shards): the permutation and the shard prefix sums are O(N) (~0.2 µs per shard at
N=10^5, ``benchmarks/bench_scale.py``); one reader's range is 4 ``searchsorted`` plus one index per boundary shard
(at most 4), never O(samples) or O(G · N).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from streampack.plan.state import require_fields


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardSpan:
    """One unit of work of :func:`assign_shards`: a whole shard (``parts == 1``) or one part."""

    shard: int
    """Index of the shard in the expanded URL list."""
    part: int
    parts: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Span:
    """A contiguous byte range of one shard, as the format reader takes it."""

    shard: int
    start: int = 0
    """Offset of the first sample (bytes; uncompressed bytes for ``.gz``)."""
    first: int = 0
    """Number of that sample (tar ordinal / jsonl line)."""
    end: int | None = None
    """Offset to stop at (exclusive); None reads to the end of the shard."""
    epoch: int | None = None
    """Epoch these samples belong to, when not the one being read (an elastic resume reads
    what old readers had left of earlier epochs)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexRange:
    """Samples ``[lo, hi)`` of one shard, in shard-index positions."""

    shard: int
    lo: int
    hi: int


def epoch_permutation(num_shards: int, *, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """int64 ``[num_shards]``: the shard order of ``epoch`` (same on every rank and worker)."""
    if seed < 0 or epoch < 0:
        raise ValueError(f"{seed=} and {epoch=} must be >= 0")
    if not shuffle:
        return np.arange(num_shards, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return rng.permutation(num_shards).astype(np.int64)


def assign_shards(
    num_shards: int, *, seed: int, epoch: int, shuffle: bool, global_worker: int, global_workers: int
) -> list[ShardSpan]:
    """The spans global worker ``global_worker`` reads in ``epoch``, in reading order."""
    if num_shards < 1:
        raise ValueError(f"{num_shards=} must be >= 1")
    if not 0 <= global_worker < global_workers:
        raise ValueError(f"need 0 <= {global_worker=} < {global_workers=}")
    perm = epoch_permutation(num_shards, seed=seed, epoch=epoch, shuffle=shuffle)
    if num_shards >= global_workers:
        return [ShardSpan(shard=int(s), part=0, parts=1) for s in perm[global_worker::global_workers]]
    pos = global_worker % num_shards
    parts = global_workers // num_shards + (1 if pos < global_workers % num_shards else 0)
    return [ShardSpan(shard=int(perm[pos]), part=global_worker // num_shards, parts=parts)]


SPAN_COLUMNS = ("shard", "start", "first", "end", "epoch")
"""The fields of a span in a state (``-1`` stands for None in ``end`` and ``epoch``): each kept
under its name (:func:`spans_to_state`, :func:`span_to_state`), never as a row of a matrix."""


def spans_to_state(spans: Sequence[Span]) -> dict[str, Any]:
    """``{field: int64 tensor}``: the spans' fields, one tensor each."""
    import torch

    return {c: torch.tensor([_none_to(getattr(s, c)) for s in spans], dtype=torch.int64) for c in SPAN_COLUMNS}


def spans_from_state(columns: Mapping[str, Any]) -> list[Span]:
    """Inverse of :func:`spans_to_state`."""
    require_fields(columns, SPAN_COLUMNS, "a span in a state")
    lists = [np.asarray(columns[c], dtype=np.int64).tolist() for c in SPAN_COLUMNS]
    return [_span_of(dict(zip(SPAN_COLUMNS, values))) for values in zip(*lists)]


def span_to_state(span: Span) -> dict[str, int]:
    """One span as ``{field: int}``."""
    return {c: _none_to(getattr(span, c)) for c in SPAN_COLUMNS}


def span_from_state(fields: Mapping[str, Any]) -> Span:
    """Inverse of :func:`span_to_state`."""
    require_fields(fields, SPAN_COLUMNS, "a span in a state")
    return _span_of({c: int(fields[c]) for c in SPAN_COLUMNS})


def _span_of(named: Mapping[str, int]) -> Span:
    return Span(shard=named["shard"], start=named["start"], first=named["first"],
                end=None if named["end"] < 0 else named["end"], epoch=None if named["epoch"] < 0 else named["epoch"])


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WorkEnds:
    """A planned epoch's spans in O(1): the first, the last and how many (those between are whole shards),
    so an elastic resume rebuilds a reader's plan with no index read."""

    head: Span
    tail: Span
    spans: int


def order_positions(order: np.ndarray) -> np.ndarray:
    """int64 ``[N]``: the position of each shard in the epoch's ``order`` (its inverse permutation)."""
    where = np.empty_like(order)
    where[order] = np.arange(len(order))
    return where


def spans_from_ends(ends: WorkEnds, order: np.ndarray, where: np.ndarray, samples: np.ndarray) -> list[Span] | None:
    """A planned epoch's spans from their ends: the head, the whole non-empty shards between head and tail in the
    epoch's ``order`` (``where``: :func:`order_positions` of it; ``samples``: every shard's sample count), the tail;
    None if they do not add up to ``ends.spans`` (the ends were not cut from this order). No index read; O(own
    spans) given ``where``, which is O(N) once per epoch."""
    if ends.spans == 1:
        return [ends.head]
    middle = order[where[ends.head.shard] + 1:where[ends.tail.shard]]
    middle = middle[np.asarray(samples)[middle] > 0]
    if len(middle) + 2 != ends.spans:
        return None
    return [ends.head, *(Span(shard=int(s)) for s in middle), ends.tail]


def _none_to(value: int | None) -> int:
    return -1 if value is None else int(value)


class PrefixCut:
    """The epoch's samples (shards in ``order``) cut into contiguous ranges, ranks first and then each rank's
    workers: boundary ``k`` of ``parts`` in a range is the prefix whose cost is nearest ``k / parts`` of the range's
    cost (ties to the shorter prefix). Computed for one reader from shard totals (``samples``, ``costs``), opening only
    a shard a boundary falls in (``local(s)``: its per-sample costs); ``tests/unit/plan/test_sharding.py`` compares it
    with that cut over every sample's cost."""

    def __init__(self, order: np.ndarray, samples: np.ndarray, costs: np.ndarray,
                 local: Callable[[int], np.ndarray]) -> None:
        self.order = np.asarray(order, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(np.asarray(samples, dtype=np.int64)[self.order])])
        self.prefix = np.concatenate([[0], np.cumsum(np.asarray(costs, dtype=np.int64)[self.order])])
        self._local = local
        self._local_prefix: dict[int, np.ndarray] = {}

    @property
    def total(self) -> int:
        """Samples in the epoch."""
        return int(self.starts[-1])

    def bounds(self, ranks: int, workers: int, global_worker: int) -> tuple[int, int]:
        """Sample positions ``[lo, hi)`` of ``global_worker``."""
        r, w = divmod(global_worker, workers)
        rank_lo, rank_hi = self.boundary(0, self.total, ranks, r), self.boundary(0, self.total, ranks, r + 1)
        return self.boundary(rank_lo, rank_hi, workers, w), self.boundary(rank_lo, rank_hi, workers, w + 1)

    def boundary(self, lo: int, hi: int, parts: int, k: int) -> int:
        """Boundary ``k`` of ``parts`` in sample positions ``[lo, hi)`` (the cut is monotone in ``k``, so one
        boundary can be computed alone)."""
        if k <= 0 or k >= parts:
            return lo if k <= 0 else hi
        base = self.value(lo)
        target = float(self.value(hi) - base) * k / parts
        above = min(max(self._first_at_least(target, base), lo), hi)
        below = max(above - 1, lo)
        nearer_below = (target - (self.value(below) - base)) <= ((self.value(above) - base) - target)
        return below if nearer_below else above

    def pieces(self, lo: int, hi: int) -> list[IndexRange]:
        """The shard pieces covering sample positions ``[lo, hi)`` (empty pieces left out)."""
        first = int(np.searchsorted(self.starts, lo, side="right")) - 1
        last = int(np.searchsorted(self.starts, hi, side="left"))
        out = []
        for q in range(max(first, 0), min(last, len(self.order))):
            a, b = max(lo, int(self.starts[q])), min(hi, int(self.starts[q + 1]))
            if a < b:
                out.append(IndexRange(shard=int(self.order[q]), lo=a - int(self.starts[q]), hi=b - int(self.starts[q])))
        return out

    def value(self, pos: int) -> int:
        """The cost of the epoch's first ``pos`` samples."""
        q = int(np.searchsorted(self.starts, pos, side="right")) - 1
        if q >= len(self.order):
            return int(self.prefix[-1])
        i = pos - int(self.starts[q])
        return int(self.prefix[q]) if i == 0 else int(self.prefix[q]) + int(self._prefix_of(q)[i])

    def _first_at_least(self, target: float, base: int) -> int:
        """The first position ``pos`` with ``value(pos) - base >= target``."""
        j = int(np.searchsorted(self.prefix - base, target, side="left"))
        if j == 0:
            return 0
        if j > len(self.order):
            return self.total
        q = j - 1
        inside = int(np.searchsorted(int(self.prefix[q]) - base + self._prefix_of(q), target, side="left"))
        return int(self.starts[q]) + inside

    def _prefix_of(self, q: int) -> np.ndarray:
        shard = int(self.order[q])
        if shard not in self._local_prefix:
            costs = np.asarray(self._local(shard), dtype=np.int64)
            n, total = int(self.starts[q + 1] - self.starts[q]), int(self.prefix[q + 1] - self.prefix[q])
            if len(costs) != n or int(costs.sum()) != total:
                raise ValueError(f"shard {shard}'s index has {len(costs)} samples of total cost {int(costs.sum())}; "
                                 f"the manifest says {n} and {total}: rebuild it with `streampack index`")
            self._local_prefix[shard] = np.concatenate([[0], np.cumsum(costs)])
        return self._local_prefix[shard]
