"""Elastic resume: the states of every reader of a run on ``(dp_size=a, num_workers=b)`` -> each reader's
share on ``(c, d)``, with every sample of the epoch read exactly once.

What an old reader had not handed to the trainer is what its nodes' ``undelivered`` methods say
(:mod:`streampack.plan.cursor`): its carried samples (as references) and every sample after its frontier, up to ``E*``,
the latest frontier epoch of all readers. :func:`remaining` gathers that from the old states (no shard read: <= G_old +
1 index reads for the old plans' boundaries, O(N + G_old) CPU and memory); :mod:`streampack.plan.reshard` cuts it into
the new readers' shares, read in epoch ``E*`` before the new topology's plan continues from ``E* + 1``. A nested state
of another version and a shard whose identity changed are refused by name. Mixtures (the draw sequence is per reader)
and graphs with a user node stage (its buffer cannot be split) are refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from streampack.graph.build import make_planner, replayable
from streampack.io import shard_identity
from streampack.io.index import load_or_build_index
from streampack.io.storage import ShardStat
from streampack.nodes.epochs import EpochLoop
from streampack.nodes.overlong import OverlongNode
from streampack.nodes.packed_reader import PackedShardReader
from streampack.nodes.reader import KIND as READER_KIND
from streampack.nodes.reader import ShardReader, check_manifest
from streampack.nodes.window_packer import WindowPacker
from streampack.plan.cursor import Pulled, Undelivered
from streampack.plan.sharding import ShardSpan, Span, WorkEnds, assign_shards
from streampack.plan.state import (
    FINGERPRINT_KEY,
    GRAPH_KEY,
    PASSES_KEY,
    WORKER_KEY,
    check_node_versions,
    dataset_record,
    nested,
    samples_to_table,
)
from streampack.settings import Placement, Sources, StreamConfig

TOPOLOGY_KEYS = ("dp_size", "dp_rank", "num_workers")


@dataclass(frozen=True, slots=True, kw_only=True)
class OldReader:
    """What one old reader had left: carried samples, then spans (or offline packs)."""

    carry: Mapping[str, Any]
    spans: list[Span] = field(default_factory=list)
    packs: np.ndarray | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Remaining:
    """The unread part of a run, from the states of all its readers."""

    epoch: int
    """``E*``: the epoch the new readers read it in."""
    passes: int
    old_dp_size: int
    old_readers: int
    readers: list[OldReader]
    """By old global worker."""
    identities: Mapping[int, ShardStat] = field(default_factory=dict)
    """The identities the old readers recorded: a new reader refuses a changed shard when it opens it."""


def topology_of(states: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
    """``(dp_size, num_workers)`` of the states, checked to be every reader of one run, each once."""
    if not states:
        raise ValueError("an elastic resume needs the states of every reader of the old run; got none")
    prints = [dataset_record(s, FINGERPRINT_KEY) for s in states]
    first = {k: v for k, v in prints[0].items() if k not in TOPOLOGY_KEYS}
    for p in prints[1:]:
        rest = {k: v for k, v in p.items() if k not in TOPOLOGY_KEYS}
        if rest != first:
            diff = sorted(k for k in set(rest) | set(first) if rest.get(k) != first.get(k))
            raise ValueError(f"the states come from different runs (settings {diff} differ)")
    sizes = {(p["dp_size"], p["num_workers"]) for p in prints}
    if len(sizes) != 1:
        raise ValueError(f"the states mix topologies {sorted(sizes)}")
    dp_size, num_workers = sizes.pop()
    readers = max(num_workers, 1)
    seen = sorted((s[WORKER_KEY]["dp_rank"], s[WORKER_KEY]["worker_id"]) for s in states)
    want = [(r, w) for r in range(dp_size) for w in range(readers)]
    if seen != want:
        missing, extra = sorted(set(want) - set(seen)), sorted({x for x in seen if seen.count(x) > 1 or x not in want})
        raise ValueError(f"an elastic resume needs the state of every reader of the old run exactly once "
                         f"(dp_size={dp_size} x {readers} readers): missing {missing}, duplicated or foreign {extra}")
    if len({s[PASSES_KEY] for s in states}) != 1:
        raise ValueError("the states are from different passes of the data")
    return dp_size, num_workers


def find_state(tree: Any, kind: str) -> dict[str, Any] | None:
    """The first node state of ``kind`` nested anywhere in ``tree``."""
    return next((dict(node) for node in nested(tree) if node.get("kind") == kind), None)


def remaining(states: Sequence[Mapping[str, Any]], config: StreamConfig, sources: Sources,
              stages: Sequence[Any]) -> Remaining:
    """What the old run's readers had left (see the module docstring)."""
    if sources.mixture:
        raise ValueError("elastic resume of a mixture is not supported (each reader's draw sequence belongs to "
                         "its topology): resume on the same dp_size and num_workers")
    if not replayable(stages):
        raise ValueError("elastic resume needs stages that are plain functions: a BaseNode stage may hold samples "
                         "of its own that cannot be split between new readers; resume on the same topology")
    dp_size, num_workers = topology_of(states)
    readers = max(num_workers, 1)
    ordered = sorted(states, key=lambda s: (s[WORKER_KEY]["dp_rank"], s[WORKER_KEY]["worker_id"]))
    for s in ordered:
        check_node_versions(s[GRAPH_KEY], f"dp_rank={s[WORKER_KEY]['dp_rank']} worker_id={s[WORKER_KEY]['worker_id']}")
    passes = int(ordered[0][PASSES_KEY])
    old = _OldPlans(config, sources, dp_size, readers, passes)
    options = config.read
    identities = saved_identities(ordered, sources)
    mode = options.open_options().identity
    if old.planner is not None and mode != "off":  # the manifest names every shard's identity now: no request
        for s in ordered:  # the old plans are cut from this manifest: it must be the one they were saved under
            reader = find_state(s[GRAPH_KEY], READER_KIND)
            check_manifest(ShardReader.undelivered(reader).manifest if reader else None, old.planner.shards,
                           options.open_options(), recorded=identities, states="the states were")
        for shard, ident in identities.items():
            shard_identity.check(_url(sources, shard), ident, old.planner.shards.recorded(shard, mode), mode,
                                 since="the states were saved", prefix="cannot resume: ",
                                 consequence="; their positions point into the old contents")
    frontiers = [old.frontier(g, s[GRAPH_KEY]) for g, s in enumerate(ordered)]
    last = max(f.epoch for f in frontiers)
    out = [old.left(g, f, last) for g, f in enumerate(frontiers)]
    return Remaining(epoch=last, passes=passes, old_dp_size=dp_size, old_readers=readers, readers=out,
                     identities=identities)


def saved_identities(states: Sequence[Mapping[str, Any]], sources: Sources) -> dict[int, ShardStat]:
    """The shard identities the old readers recorded, checked to agree with each other."""
    out: dict[int, ShardStat] = {}
    for s in states:
        reader = find_state(s[GRAPH_KEY], READER_KIND)
        for shard, ident in (ShardReader.undelivered(reader).identities if reader else {}).items():
            if out.setdefault(shard, ident) != ident:
                raise ValueError(f"the old readers recorded two identities of shard {_url(sources, shard)!r} "
                                 f"({out[shard]} and {ident}): it changed during the run; cannot resume on it")
    return out


def _url(sources: Sources, shard: int) -> str:
    return sources.shards.urls[shard] if sources.shards is not None and shard < len(sources.shards.urls) else str(shard)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Frontier:
    epoch: int
    origin: Pulled | None
    """The last sample pulled, or None (nothing yet this epoch)."""
    position: int = 0
    """Offline packs: packs read in ``epoch``."""
    carry: Mapping[str, Any] | None = None
    work: dict[int, Any] = field(default_factory=dict)
    ends: dict[int, WorkEnds] = field(default_factory=dict)
    """The reader's planned spans of an epoch in O(1) (no index read to rebuild them)."""
    done: bool = False


class _OldPlans:
    """The old topology's plans, to know what each old reader had left."""

    def __init__(self, config: StreamConfig, sources: Sources, dp_size: int, readers: int, passes: int) -> None:
        self.config, self.sources, self.options = config, sources, config.read
        self.dp_size, self.readers, self.passes = dp_size, readers, passes
        self.place = Placement(dp_size=dp_size, num_workers=readers, passes=passes)
        self.planner = make_planner(config, sources, self.place, count=False) if config.epochs else None
        first = passes * config.epochs if config.epochs else 0
        self.first, self.last = first, (first + config.epochs if config.epochs else None)
        self._packed: PackedShardReader | None = None

    def frontier(self, g: int, graph: Any) -> _Frontier:
        if graph is None:
            return _Frontier(epoch=self.first, origin=None, carry=None)
        chain = graph
        if self.config.epochs is not None:  # an EpochLoop
            epoch, chain = int(graph[EpochLoop.EPOCH_KEY]), graph[EpochLoop.CHAIN_KEY]
            if chain is None:
                return _Frontier(epoch=min(epoch, self.last - 1), origin=None, done=epoch >= self.last)
        if self.sources.packed is not None:
            reader = find_state(chain, PackedShardReader.KIND)
            assert reader is not None
            place = PackedShardReader.undelivered(reader)
            return _Frontier(epoch=place.epoch, origin=None, position=place.position, work=place.work)
        reader, overlong, packer = (find_state(chain, k) for k in (READER_KIND, OverlongNode.KIND, WindowPacker.KIND))
        assert reader is not None and overlong is not None and packer is not None, "not a PackedDataset graph state"
        plan = ShardReader.undelivered(reader)
        split = OverlongNode.undelivered(overlong, capacity=self.config.capacity, policy=self.config.packing.overlong)
        left = Undelivered.compose(split.pulled, WindowPacker.undelivered(packer).carry, split.carry)
        origin = left.pulled
        epoch = int(graph[EpochLoop.EPOCH_KEY]) if self.config.epochs is not None else (
            origin.epoch if origin is not None else plan.start_epoch)
        return _Frontier(epoch=epoch, origin=origin, carry=left.carry, work=plan.work, ends=plan.ends)

    def left(self, g: int, f: _Frontier, last: int) -> OldReader:
        carry = f.carry if f.carry is not None else samples_to_table([])
        if f.done:
            return OldReader(carry=carry, packs=np.zeros(0, np.int64) if self.sources.packed is not None else None)
        if self.sources.packed is not None:
            packs = [self._packs(g, f.epoch, f.work)[f.position:]]
            packs += [self._packs(g, e, f.work) for e in range(f.epoch + 1, last + 1)]
            return OldReader(carry=carry, packs=np.concatenate(packs))
        spans = self._after(self._spans(g, f.epoch, f.work, f.ends), f.origin)
        for e in range(f.epoch + 1, last + 1):
            spans += self._spans(g, e, f.work, f.ends)
        return OldReader(carry=carry, spans=spans)

    def _tagged(self, spans: list[Span], epoch: int) -> list[Span]:
        """``spans`` with the epoch their samples belong to."""
        return [s if s.epoch is not None else replace(s, epoch=epoch) for s in spans]

    def _packs(self, g: int, epoch: int, work: Mapping[int, Any]) -> np.ndarray:
        if epoch in work:
            return np.asarray(work[epoch], dtype=np.int64)
        if self._packed is None:
            self._packed = PackedShardReader(
                self.sources.packed_urls, layout=self.config.batch_layout(), seed=self.config.seed,
                shuffle=self.config.shuffle, epochs=None if self.last is None else self.last, place=self.place)
        return self._packed.dealt(epoch, g)

    def _spans(self, g: int, epoch: int, work: Mapping[int, list[Span]],
               ends: Mapping[int, WorkEnds] | None = None) -> list[Span]:
        if epoch in work:
            return self._tagged(list(work[epoch]), epoch)
        if self.planner is not None and ends and epoch in ends:
            rebuilt = self._from_ends(epoch, ends[epoch])
            if rebuilt is not None:
                return self._tagged(rebuilt, epoch)
        if self.planner is not None:
            return self._tagged(self.planner.spans(epoch, g), epoch)
        assert self.sources.shards is not None
        return self._tagged([Span(shard=s.shard) if s.parts == 1 else self._part(s) for s in assign_shards(
            len(self.sources.shards), seed=self.config.seed, epoch=epoch, shuffle=self.config.shuffle,
            global_worker=g, global_workers=self.dp_size * self.readers)], epoch)

    def _part(self, s: ShardSpan) -> Span:
        """Part ``s.part`` of ``s.parts`` of a shard, from its index as the reader cuts it."""
        url = self.sources.shards.urls[s.shard]  # type: ignore[union-attr]
        index = load_or_build_index(url, decode=self.options.decode(), opts=self.options.open_options(),
                                    cache_dir=self.options.cache_dir, positions_only=True)
        start, end, first = index.part(s.part, s.parts)
        return Span(shard=s.shard, start=start, first=first, end=end)

    def _from_ends(self, epoch: int, ends: WorkEnds) -> list[Span] | None:
        """A planned epoch's spans from their ends (:func:`~streampack.plan.sharding.spans_from_ends`)."""
        assert self.planner is not None
        return self.planner.spans_from_ends(epoch, ends)

    def _after(self, spans: list[Span], origin: Pulled | None) -> list[Span]:
        """``spans`` (tagged with their epochs) after the sample ``origin`` (all when None)."""
        if origin is None:
            return spans
        for i, s in enumerate(spans):
            if (s.epoch, s.shard) == (origin.epoch, origin.shard) and s.start <= origin.offset and (
                    s.end is None or origin.offset < s.end):
                rest = replace(s, start=origin.next_offset, first=origin.next_number)
                return ([rest] if s.end is None or origin.next_offset < s.end else []) + spans[i + 1:]
        raise ValueError(f"the state's last sample (shard {origin.shard} @ {origin.offset}, epoch {origin.epoch}) "
                         f"is not in its reader's plan: the states were saved with other settings or shards")

