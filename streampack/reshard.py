"""Resharding: one new reader's share of what an old run had left (:mod:`streampack.elastic`).

A finite stream is cut at sample granularity, balanced by token count (ranks first, then
each rank's workers), and every new reader's batches are counted with the packer's own round
logic (``window_rounds.count_packs``) so every new rank yields the same number of batches in
the resumed epoch (logged, with the fillers it costs). An infinite stream deals whole spans
round-robin (no index needs reading) and the carried samples in equal runs. Offline packs are
dealt by batches of ``packs_per_batch``, ranks first, as ``PackedShardReader`` deals an epoch.

:class:`PendingResume` is what ``PackedDataset.load_state_dict([...])`` keeps until the
dataset's ``__iter__`` knows this reader's worker count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from streampack.elastic import (
    TOPOLOGY_KEYS,
    Remaining,
    remaining,
    shard_samples,
    topology_of,
)
from streampack.graph import counting_for
from streampack.logs import get_logger
from streampack.nodes.epoch_plan import Counting, ShardSamples, chunk_lengths, equalize
from streampack.nodes.sharding import IndexRange, Span, cut_two_level, split_ranges
from streampack.nodes.window_rounds import PackerRules, count_packs
from streampack.settings import Placement, ReadOptions, Share, Sources, StreamConfig
from streampack.state import (
    FINGERPRINT_KEY,
    WORKER_KEY,
    check_fingerprint,
    check_version,
    concat_tables,
    table_lengths,
    table_size,
    table_slice,
)
from streampack.topology import Worker

_log = get_logger(__name__)


def share(left: Remaining, config: StreamConfig, sources: Sources, options: ReadOptions,
          place: Placement) -> Share:
    """This new reader's part of ``left`` (``place`` is the new topology)."""
    if sources.packed is not None:
        return _share_packs(left, config, place)
    if config.epochs is None:
        return _share_infinite(left, place)
    return _ShareFinite(left, config, sources, options, place).share()


def _share_infinite(left: Remaining, place: Placement) -> Share:
    carry = concat_tables([r.carry for r in left.readers])
    spans = [s for r in left.readers for s in r.spans]
    g, n = place.global_worker, place.global_workers
    lo, hi = table_size(carry) * g // n, table_size(carry) * (g + 1) // n
    return Share(epoch=left.epoch, spans=spans[g::n], carry=table_slice(carry, lo, hi))


def _share_packs(left: Remaining, config: StreamConfig, place: Placement) -> Share:
    packs = np.concatenate([r.packs for r in left.readers if r.packs is not None] or [np.zeros(0, np.int64)])
    ppb, ranks, workers = config.packs_per_batch, place.dp_size, place.num_workers
    units = np.arange(-(-len(packs) // ppb))
    counts = []
    mine = np.zeros(0, dtype=np.int64)
    for g in range(place.global_workers):
        rank, worker = divmod(g, workers)
        sel = units[(units % ranks == rank) & ((units // ranks) % workers == worker)]
        idx = (sel[:, None] * ppb + np.arange(ppb)).ravel()
        got = packs[idx[idx < len(packs)]]
        counts.append(-(-len(got) // ppb))
        if g == place.global_worker:
            mine = got
    quota = equalize(counts, ranks)[0][place.global_worker] if config.epochs is not None and ranks > 1 else None
    return Share(epoch=left.epoch, packs=mine, quota=quota)


class _ShareFinite:
    """Sample-granular, token-balanced cut of a finite stream's remaining samples."""

    def __init__(self, left: Remaining, config: StreamConfig, sources: Sources, options: ReadOptions,
                 place: Placement) -> None:
        self.left, self.config, self.sources, self.options, self.place = left, config, sources, options, place
        assert sources.shards is not None
        self.urls = sources.shards.urls
        self._samples: dict[int, ShardSamples] = {}

    def samples(self, shard: int) -> ShardSamples:
        if shard not in self._samples:
            self._samples[shard] = shard_samples(self.urls[shard], self.config, self.options)
        return self._samples[shard]

    def _range(self, span: Span) -> IndexRange:
        s = self.samples(span.shard)
        lo = int(np.searchsorted(s.offsets, span.start, side="left"))
        hi = len(s) if span.end is None else int(np.searchsorted(s.offsets, span.end, side="left"))
        return IndexRange(shard=span.shard, lo=lo, hi=max(lo, hi), epoch=span.epoch)

    def share(self) -> Share:
        carries = [r.carry for r in self.left.readers]
        ranges = [[self._range(s) for s in r.spans] for r in self.left.readers]
        tokens = all((self.samples(p.shard).lengths >= 0).all() for rs in ranges for p in rs)
        pieces, costs = [], []  # the remaining work in order: (kind, which, local index) runs
        for carry, rs in zip(carries, ranges):
            lengths = table_lengths(carry)
            pieces.append(("carry", carry, len(lengths)))
            costs.append(lengths.astype(np.float64) if tokens else np.ones(len(lengths)))
            for p in rs:
                pieces.append(("range", p, len(p)))
                costs.append(self.samples(p.shard).costs(p.lo, p.hi, tokens=tokens).astype(np.float64))
        bounds = cut_two_level(np.concatenate(costs or [np.zeros(0)]), self.place.dp_size, self.place.num_workers)
        parts = [self._part(pieces, int(bounds[g]), int(bounds[g + 1])) for g in range(self.place.global_workers)]
        counting = counting_for(self.config, self.place)
        quota = None
        if counting is not None:
            if not tokens:
                raise ValueError("cannot plan equal batch counts: the shard index has no token lengths")
            batches = [self._count(counting, g, carry, rs) for g, (carry, rs) in enumerate(parts)]
            quotas, fillers, least = equalize(batches, self.place.dp_size)
            quota = quotas[self.place.global_worker]
            _log.info("elastic resume: %d old readers -> %d; epoch %d re-planned: %d batches per rank, "
                      "%d fillers over all ranks (fewest possible %d)", self.left.old_dp_size * self.left.old_readers,
                      self.place.global_workers, self.left.epoch, sum(quotas) // self.place.dp_size, fillers, least)
        carry, rs = parts[self.place.global_worker]
        spans = [self.samples(p.shard).span(p.shard, p.lo, p.hi, p.epoch) for p in rs]
        return Share(epoch=self.left.epoch, spans=spans, carry=carry, quota=quota)

    def _part(self, pieces: list[tuple[str, Any, int]], lo: int, hi: int) -> tuple[dict[str, Any], list[IndexRange]]:
        carries, ranges, pos = [], [], 0
        for kind, what, n in pieces:
            a, b = max(lo, pos), min(hi, pos + n)
            if a < b:
                if kind == "carry":
                    carries.append(table_slice(what, a - pos, b - pos))
                else:
                    ranges.extend(split_ranges([what], a - pos, b - pos))
            pos += n
        return concat_tables(carries), ranges

    def _count(self, counting: Counting, g: int, carry: Mapping[str, Any], ranges: list[IndexRange]) -> int:
        rules: PackerRules = counting.for_worker(g)
        stream = np.concatenate([self.samples(p.shard).lengths[p.lo:p.hi] for p in ranges] or [np.zeros(0, np.int64)])
        packs = count_packs(rules, chunk_lengths(stream, counting.max_len, counting.policy), table_lengths(carry))
        return -(-packs // counting.packs_per_batch)


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
        dp_size, num_workers = topology_of(states)
        keep = lambda fp: {k: v for k, v in fp.items() if k not in TOPOLOGY_KEYS}  # noqa: E731
        check_fingerprint(keep(states[0][FINGERPRINT_KEY]), keep(ds.fingerprint(num_workers)))
        pending = cls(states=states, dp_size=dp_size, num_workers=num_workers)
        if dp_size != ds.dp_size:  # a new topology whatever the worker count: plan it here, once
            pending.left = remaining(states, ds.config, ds.sources, ds.options, ds.stages)
        return pending

    def for_reader(self, ds: Any, here: Worker) -> tuple[dict[str, Any] | None, Share | None]:
        """This reader's own state on the same topology, else its elastic share."""
        if (self.dp_size, self.num_workers) == (ds.dp_size, here.num_workers):
            for s in self.states:
                if (s[WORKER_KEY]["dp_rank"], s[WORKER_KEY]["worker_id"]) == (ds.dp_rank, here.id):
                    return s, None
        if self.left is None:
            self.left = remaining(self.states, ds.config, ds.sources, ds.options, ds.stages)
        place = Placement(dp_rank=ds.dp_rank, dp_size=ds.dp_size, worker_id=here.id, num_workers=here.readers,
                          passes=self.left.passes)
        mine = share(self.left, ds.config, ds.sources, ds.options, place)
        carried = 0 if mine.carry is None else table_size(mine.carry)
        _log.info("elastic resume: %d old readers (dp_size=%d x %d) -> reader %d of %d reads %d carried sample(s) "
                  "and %d span(s) / %d pack(s) in epoch %d", self.left.old_dp_size * self.left.old_readers,
                  self.left.old_dp_size, self.left.old_readers, place.global_worker, place.global_workers, carried,
                  len(mine.spans), 0 if mine.packs is None else len(mine.packs), mine.epoch)
        return None, mine
