"""Resharding: one new reader's share of what an old run had left (:mod:`streampack.plan.elastic`).

A finite stream is cut at sample granularity, balanced by token count (ranks first) from the pieces' totals (the
manifest's for whole shards, a byte-share estimate for parts: no index read but at the <= 4 pieces a new reader's
boundaries fall in); each new reader's quota is late and pinned (``plan.quota``). An infinite stream deals whole spans
round-robin and the carried samples in equal runs; offline packs are dealt by batches of ``packs_per_batch``, ranks
first, as ``PackedShardReader`` deals an epoch.

**Cost per new reader** (G_old old readers, N shards): CPU and memory O(N + G_old · (window + 3));
before its first batch the indexes of <= 4 boundary pieces, after it those of its own ~N/G shards and
one store round; :func:`~streampack.plan.elastic.remaining` adds <= G_old + 1 index reads per process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from streampack.graph.build import make_planner
from streampack.logs import get_logger
from streampack.nodes.packed_reader import deal
from streampack.plan.elastic import TOPOLOGY_KEYS, Remaining, remaining, topology_of
from streampack.plan.epoch_plan import ShardSamples, equalize
from streampack.plan.quota import LateQuota, Settled
from streampack.plan.sharding import Span
from streampack.plan.state import (
    FINGERPRINT_KEY,
    WORKER_KEY,
    check_current,
    check_fingerprint,
    check_version,
    concat_tables,
    dataset_record,
    table_lengths,
    table_size,
    table_slice,
)
from streampack.plan.topology import Worker
from streampack.settings import Placement, Share, Sources, StreamConfig

_log = get_logger(__name__)


def share(left: Remaining, config: StreamConfig, sources: Sources, place: Placement, *, agreement: Any = None,
          agree: Any = None) -> Share:
    """This new reader's part of ``left`` (``place``: in the new topology)."""
    if sources.packed is not None:
        return _share_packs(left, config, place)
    if config.epochs is None:
        return _share_infinite(left, place)
    return _ShareFinite(left, config, sources, place, agreement=agreement, agree=agree).share()


def _share_infinite(left: Remaining, place: Placement) -> Share:
    carry = concat_tables([r.carry for r in left.readers])
    spans = [s for r in left.readers for s in r.spans]
    g, n = place.global_worker, place.global_workers
    lo, hi = table_size(carry) * g // n, table_size(carry) * (g + 1) // n
    return Share(epoch=left.epoch, spans=spans[g::n], carry=table_slice(carry, lo, hi), identities=left.identities)


def _share_packs(left: Remaining, config: StreamConfig, place: Placement) -> Share:
    packs = np.concatenate([r.packs for r in left.readers if r.packs is not None] or [np.zeros(0, np.int64)])
    ppb, ranks = config.packs_per_batch, place.dp_size
    dealt = [deal(packs, ppb, ranks, place.num_workers, g) for g in range(place.global_workers)]
    quota = None
    if config.epochs is not None and ranks > 1:
        quota = equalize([-(-len(d) // ppb) for d in dealt], ranks)[0][place.global_worker]
    return Share(epoch=left.epoch, packs=dealt[place.global_worker], quota=quota)


Point = tuple[int, int]
"""``(piece, sample inside it)``; a piece's end is written ``(piece + 1, 0)``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Piece:
    """One run of the remaining work, in order: an old reader's carried samples, or one span."""

    carry: Mapping[str, Any] | None = None
    span: Span | None = None
    cost: int = 0
    """Its balancing cost: exact for carried samples and whole shards (the manifest's total), the
    shard's total times the span's share of its bytes for a part of a shard (no index read)."""


class _PieceCut:
    """:class:`~streampack.plan.sharding.PrefixCut`'s cut over the pieces' costs, one reader at a time, opening only
    the pieces a boundary falls in (their per-sample costs scaled in integers, so every reader computes the same
    points)."""

    def __init__(self, costs: list[int], local: Any) -> None:
        self.costs = np.asarray(costs, dtype=np.int64)
        self.prefix = np.concatenate([[0], np.cumsum(self.costs)])
        self._local, self._opened = local, {}

    @property
    def end(self) -> Point:
        return (len(self.costs), 0)

    def bounds(self, ranks: int, workers: int, g: int) -> tuple[Point, Point]:
        r, w = divmod(g, workers)
        lo, hi = self.boundary((0, 0), self.end, ranks, r), self.boundary((0, 0), self.end, ranks, r + 1)
        return self.boundary(lo, hi, workers, w), self.boundary(lo, hi, workers, w + 1)

    def boundary(self, lo: Point, hi: Point, parts: int, k: int) -> Point:
        if k <= 0 or k >= parts:
            return lo if k <= 0 else hi
        base = self.value(lo)
        target = float(self.value(hi) - base) * k / parts
        if target <= 0:
            return lo
        j = int(np.searchsorted(self.prefix - base, target, side="left"))
        q = j - 1  # j >= 1: value(lo) - base == 0 < target
        values = self._values(q) - base
        i = int(np.searchsorted(values, target, side="left"))
        if len(values) == 1:  # an empty piece that was given a cost: its start is its end
            return (q + 1, 0)
        below, above = (q, i - 1), self._norm(q, i)
        nearer_below = (target - (self.value(below) - base)) <= ((self.value(above) - base) - target)
        return self._norm(*below) if nearer_below else above

    def value(self, point: Point) -> int:
        q, i = point
        return int(self.prefix[q]) if i == 0 else int(self._values(q)[i])

    def size(self, q: int) -> int:
        return len(self._values(q)) - 1

    def _norm(self, q: int, i: int) -> Point:
        return (q + 1, 0) if i >= self.size(q) else (q, i)

    def _values(self, q: int) -> np.ndarray:
        """int64 ``[n + 1]``: the cost before each sample of piece ``q``, scaled to its cost."""
        if q not in self._opened:
            local = np.concatenate([[0], np.cumsum(np.asarray(self._local(q), dtype=np.int64))])
            n, cost = len(local) - 1, int(self.costs[q])
            inner = (cost * local) // local[-1] if local[-1] > 0 else (cost * np.arange(n + 1)) // max(n, 1)
            inner[-1] = cost
            self._opened[q] = int(self.prefix[q]) + inner
        return self._opened[q]


class _ShareFinite:
    """Sample-granular, token-balanced cut of a finite stream's remaining samples (cost: module docstring,
    P = N + 3 G_old pieces)."""

    def __init__(self, left: Remaining, config: StreamConfig, sources: Sources, place: Placement, *,
                 agreement: Any = None, agree: Any = None) -> None:
        self.left, self.config, self.sources, self.place = left, config, sources, place
        self.planner = make_planner(config, sources, place, agreement=agreement, agree=agree)
        assert self.planner is not None
        self.manifest = self.planner.shards
        self.tokens = self.manifest.known_lengths()
        self.pieces = [p for r in left.readers for p in self._pieces(r.carry, r.spans)]
        self.cut = _PieceCut([p.cost for p in self.pieces], self._local)

    def _pieces(self, carry: Mapping[str, Any], spans: list[Span]) -> list[_Piece]:
        lengths = table_lengths(carry)
        out = [_Piece(carry=carry, cost=int(lengths.sum()) if self.tokens else len(lengths))]
        for s in spans:
            total = int(self.manifest.costs(tokens=self.tokens)[s.shard])
            if (s.start, s.first, s.end) != (0, 0, None):  # a part of a shard: its share of the bytes
                width = int(self.manifest.byte_costs[s.shard])
                end = width if s.end is None else s.end
                total = total * min(max(end - s.start, 0), width) // max(width, 1)
            out.append(_Piece(span=s, cost=total))
        return out

    def _range(self, span: Span) -> tuple[ShardSamples, int, int]:
        s = self.planner.samples(span.shard)
        return (s, *s.range_of(span))

    def _local(self, q: int) -> np.ndarray:
        piece = self.pieces[q]
        if piece.carry is not None:
            lengths = table_lengths(piece.carry)
            return lengths if self.tokens else np.ones(len(lengths), np.int64)
        assert piece.span is not None
        s, lo, hi = self._range(piece.span)
        return s.costs(lo, hi, tokens=self.tokens)

    def part(self, g: int) -> tuple[dict[str, Any], list[Span]]:
        """Reader ``g``'s carried samples and spans (a piece it reads whole is kept as it is: no index)."""
        (p_lo, i_lo), (p_hi, i_hi) = self.cut.bounds(self.place.dp_size, self.place.num_workers, g)
        carries, spans = [], []
        for q in range(p_lo, min(p_hi + 1, len(self.pieces))):
            a, whole_end = (i_lo if q == p_lo else 0), q < p_hi
            if not whole_end and i_hi == 0:
                break
            piece = self.pieces[q]
            if piece.carry is not None:
                b = table_size(piece.carry) if whole_end else i_hi
                carries.append(table_slice(piece.carry, a, b))
                continue
            assert piece.span is not None
            if a == 0 and whole_end:
                spans.append(piece.span)  # read as it is: no index needed
                continue
            s, lo, hi = self._range(piece.span)
            b = hi if whole_end else lo + i_hi
            if lo + a < b:
                spans.append(s.span(piece.span.shard, lo + a, b, piece.span.epoch))
        return concat_tables(carries), spans

    def share(self) -> Share:
        """This reader's share, with its late, pinned quota (``plan.quota``)."""
        place, planner = self.place, self.planner
        carry, spans = self.part(place.global_worker)
        quota = None
        if planner.counting is not None:
            g = place.global_worker
            quota = LateQuota(count=lambda: planner.count_spans(g, spans, table_lengths(carry)),
                              settle=self._settle, background=planner.agree is not None, pin=True)
        return Share(epoch=self.left.epoch, spans=spans, carry=carry, quota=quota, identities=self.left.identities)

    def _settle(self, mine: int) -> Settled:
        place, planner, counts = self.place, self.planner, {self.place.global_worker: mine}

        def count(g: int) -> int:  # without an agreement every new reader is counted here
            carry, spans = self.part(g)
            counts[g] = planner.count_spans(g, spans, table_lengths(carry))
            return counts[g]

        settled = planner.settle(f"elastic/{self.left.epoch}", place.global_worker, mine, count)
        if settled.fillers is None:
            return settled
        _log.info("elastic resume: %d old readers -> %d; epoch %d re-planned: %d batches per rank, "
                  "%d fillers over all ranks (fewest possible %d)", self.left.old_dp_size * self.left.old_readers,
                  place.global_workers, self.left.epoch, (sum(counts.values()) + settled.fillers) // place.dp_size,
                  settled.fillers, settled.min_fillers)
        return settled


@dataclass(slots=True)
class PendingResume:
    """A loaded list of states, waiting for the dataset's ``__iter__`` to know this reader's
    worker count: then it hands back this reader's own state (same topology) or its share."""

    states: list[dict[str, Any]]
    dp_size: int
    num_workers: int
    left: Remaining | None = None

    @classmethod
    def load(cls, ds: Any, states: list[dict[str, Any]]) -> PendingResume:
        for s in states:
            check_version(s)
            check_current(s)
        dp_size, num_workers = topology_of(states)
        keep = lambda fp: {k: v for k, v in fp.items() if k not in TOPOLOGY_KEYS}  # noqa: E731
        check_fingerprint(keep(dataset_record(states[0], FINGERPRINT_KEY)), keep(ds.fingerprint(num_workers)))
        pending = cls(states=states, dp_size=dp_size, num_workers=num_workers)
        if dp_size != ds.dp_size:  # a new topology whatever the worker count: plan it here, once
            pending.left = remaining(states, ds.config, ds.sources, ds.stages)
        return pending

    def for_reader(self, ds: Any, here: Worker) -> tuple[dict[str, Any] | None, Share | None]:
        """This reader's own state on the same topology, else its elastic share."""
        if (self.dp_size, self.num_workers) == (ds.dp_size, here.num_workers):
            for s in self.states:
                if (s[WORKER_KEY]["dp_rank"], s[WORKER_KEY]["worker_id"]) == (ds.dp_rank, here.id):
                    return s, None
        if self.left is None:
            self.left = remaining(self.states, ds.config, ds.sources, ds.stages)
        place = Placement(dp_rank=ds.dp_rank, dp_size=ds.dp_size, worker_id=here.id, num_workers=here.readers,
                          passes=self.left.passes)
        mine = share(self.left, ds.config, ds.sources, place, agreement=ds._agreement)
        carried = 0 if mine.carry is None else table_size(mine.carry)
        _log.info("elastic resume: %d old readers (dp_size=%d x %d) -> reader %d of %d reads %d carried sample(s) "
                  "and %d span(s) / %d pack(s) in epoch %d", self.left.old_dp_size * self.left.old_readers,
                  self.left.old_dp_size, self.left.old_readers, place.global_worker, place.global_workers, carried,
                  len(mine.spans), 0 if mine.packs is None else len(mine.packs), mine.epoch)
        return None, mine
