"""The one graph builder: settings -> the node graph one reader (a DataLoader worker) runs.

::

    BlockReader ─┬─> [Mixture] -> [Tokenize] -> [stages] -> OverlongNode -> WindowPacker -> [DecodeImages] -> ThdCollate
    (one per source: token blocks straight to OverlongNode when nothing sits between)
    PackedShardReader (``streampack pack`` output) ────────────────────────────────────────────────────> ThdCollate

A finite stream (``epochs=N``) runs that chain once per epoch under an :class:`~streampack.nodes.epochs.EpochLoop`,
each epoch read as :class:`~streampack.plan.epoch_plan.EpochPlanner` planned it over the data set's manifest
(:func:`manifest_of`); an infinite stream is one chain. Building a graph costs no request but the manifest's (1 read
per process) and its planner's. Each node takes its stage's record from :class:`StreamConfig`, checked once where it
was made. ``around`` wraps any named stage with torchdata's own nodes, e.g.
``around={"tokenize": lambda n: Prefetcher(n, 16)}``; the wrapped node's state nests like any other.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from streampack.errors import ErrorCounter, ErrorPolicy
from streampack.io.index import index_decode
from streampack.io.manifest import Manifest, is_current, obtain_manifest
from streampack.io.retry import IOStats
from streampack.layout.batch import PackedBatch
from streampack.media.node import DecodeImages, vision_layout
from streampack.media.stage import ExpandImages
from streampack.nodes.block_reader import BlockReader
from streampack.nodes.collate import ThdCollate
from streampack.nodes.epochs import EpochLoop
from streampack.nodes.mixture import Mixture
from streampack.nodes.overlong import OverlongNode
from streampack.nodes.packed_reader import PackedShardReader
from streampack.nodes.reader import ENDS_KEY, KIND_KEY, ShardReader
from streampack.nodes.reader import KIND as READER_KIND
from streampack.nodes.stages import NodeStage, build_stages
from streampack.nodes.tokenize import Tokenize
from streampack.nodes.window_packer import Balancing, WindowPacker, fill
from streampack.options.read import ReadOptions
from streampack.packing.schedule import Schedule
from streampack.packing.window_rounds import worker_seed
from streampack.plan.cost_seed import seed_levels
from streampack.plan.epoch_plan import Agree, Counting, EpochPlanner
from streampack.plan.quota import LateQuota
from streampack.plan.replay import Replayer, ReplaySpec
from streampack.plan.sharding import Span, WorkEnds
from streampack.plan.state import nested
from streampack.sample import Sample
from streampack.settings import Placement, Share, Sources, StreamConfig

Wrap = Callable[[BaseNode[Any]], BaseNode[Any]]
STAGES = ("reader", "tokenize", "stages", "overlong", "packer", "collate")
"""Names ``around`` may wrap, in flow order (``reader`` = the reader or the mixture)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Graph:
    """A built graph: its root and its named nodes (for metrics and restores; a finite stream
    updates them in place as epochs pass)."""

    root: BaseNode[PackedBatch]
    nodes: dict[str, Any]
    errors: ErrorCounter
    io_stats: IOStats
    """Requests, retries and faults of this reader's I/O (shared by every epoch's chain)."""
    loop: EpochLoop[PackedBatch] | None = None


def replayable(stages: Sequence[Any]) -> bool:
    """Whether carried samples can be re-read per sample: only function stages (a node stage
    may hold its own buffer, so its output cannot be recomputed sample by sample)."""
    return all(not isinstance(s, (NodeStage, type)) for s in stages)


def build_samples(config: StreamConfig, sources: Sources, place: Placement, *,
                  tokenizer: Any = None, stages: Sequence[Any] = (), policy: ErrorPolicy | None = None,
                  around: Mapping[str, Wrap] | None = None, epoch: int | None = None,
                  work: list[Span] | None = None, keep_work: bool = False,
                  io_stats: IOStats | None = None,
                  identities: Mapping[int, Any] | None = None,
                  manifest: Manifest | None = None) -> tuple[BaseNode[Sample], dict[str, Any]]:
    """The sample half of the graph: reader(s) -> [mixture] -> [tokenize] -> [stages].
    ``epoch`` reads that one epoch (``work``: its spans) instead of the pass's epochs;
    ``manifest`` is what planned them (the reader checks its shards and its state against it).
    A reader reads its shards as token blocks when its documents go straight to the overlong
    node and its format has blocks (:class:`~streampack.nodes.block_reader.BlockReader`), and
    sample by sample otherwise."""
    options = config.read
    policy = policy if policy is not None else options.error_policy()
    io_stats = io_stats if io_stats is not None else IOStats()
    open_options = options.open_options()  # made once: every source's reader fetches the same way
    wrap = _wrapper(around)
    end, start = _epochs(config, place) if epoch is None else (epoch + 1 if config.epochs else None, epoch)
    readers = {name: BlockReader(
        shards, seed=config.seed, shuffle=config.shuffle, epochs=end, start_epoch=start, place=place, read=options,
        error_policy=policy, open_options=open_options, io_stats=io_stats, source=i,
        work=None if work is None else {start: work}, keep_work=keep_work, saved_identities=identities,
        manifest=manifest, media=config.media)
        for i, (name, shards) in enumerate(sorted(sources.mixture.items()) or [("", sources.shards)])}
    nodes: dict[str, Any] = {"reader": next(iter(readers.values())), "readers": list(readers.values()),
                             "errors": policy.errors, "io": io_stats}
    node: BaseNode[Sample] = nodes["reader"]
    if sources.mixture:
        node = nodes["mixture"] = Mixture(readers, sources.weights, seed=config.seed, worker=place.global_worker,
                                          num_workers=place.global_workers, stop=sources.stop)
    node = wrap("reader", node)
    if tokenizer is not None:
        node = nodes["tokenize"] = Tokenize(node, tokenizer, config.tokenize, error_policy=policy,
                                            vocab_size=options.vocab_size, max_len=config.capacity, media=config.media)
        node = wrap("tokenize", node)
    node, nodes["stages"] = build_stages(node, stages)
    return wrap("stages", node), nodes


def build_graph(config: StreamConfig, sources: Sources, place: Placement, *, tokenizer: Any = None,
                stages: Sequence[Any] = (), around: Mapping[str, Wrap] | None = None, share: Share | None = None,
                validate: bool = False, agreement: Any = None, restored: Mapping[int, WorkEnds] | None = None) -> Graph:
    """The whole graph of one reader, ending in :class:`~streampack.nodes.collate.ThdCollate`;
    ``share`` starts it from an elastic resume's share. A finite stream builds each epoch's
    chain when the epoch starts; ``validate`` builds the first one at once (without planning
    it), so every setting is checked here. ``agreement`` (a ``streampack.plan.agree.Agreement``, or
    None) is how a planned epoch's readers agree on their batch counts. ``restored``: the planned
    epochs' ends of the state this graph is about to be reset to (:func:`restored_ends`), whose spans
    are rebuilt from the manifest instead of cut again (the reader's reset then checks the manifest
    against the one the state was cut from)."""
    if config.cost.balance is not None and sources.packed is not None:
        raise ValueError("balance='cost' orders the packs of the streaming packer; a `streampack pack` "
                         "directory holds packs made offline: read raw shards to balance them")
    errors, io_stats = ErrorCounter(), IOStats()
    build = _Builder(config, sources, place, tokenizer, stages, around, errors, share, io_stats, agreement,
                     restored)
    if config.epochs is None or (sources.mixture and sources.packed is None):
        root, nodes = build.chain(None)
        return Graph(root=root, nodes=nodes, errors=errors, io_stats=io_stats)
    nodes = {}  # the live epoch's, kept up to date by the loop
    last, first = _epochs(config, place)
    assert last is not None
    if share is not None:
        first = share.epoch
    if validate:
        build.chain(first, planned=False)
    loop = EpochLoop(build.chain, first=first, last=last, nodes=nodes,
                     metrics=lambda n: {k: v for k, v in graph_metrics(n).items() if k not in ("errors", "plan")})
    return Graph(root=loop, nodes=nodes, errors=errors, io_stats=io_stats, loop=loop)


class _Builder:
    """Builds the chain of one epoch (or the one chain of an infinite stream)."""

    def __init__(self, config: StreamConfig, sources: Sources, place: Placement, tokenizer: Any,
                 stages: Sequence[Any], around: Mapping[str, Wrap] | None, errors: ErrorCounter,
                 share: Share | None, io_stats: IOStats, agreement: Any,
                 restored: Mapping[int, WorkEnds] | None = None) -> None:
        self.config, self.sources, self.place = config, sources, place
        self.restored = dict(restored or {})
        self.tokenizer, self.around, self.errors, self.share = tokenizer, around, errors, share
        self.policy = config.read.error_policy(errors)  # every node of this reader's graph takes it
        self.stages = list(stages)
        if config.media is not None:  # images first; carried image samples are re-read, never stored as bytes
            if not replayable(stages):
                raise ValueError("media= needs function stages only: a node stage makes resume states store samples, "
                                 "and a state never stores image bytes")
            self.stages = [ExpandImages(config.media, error_policy=self.policy), *stages]
        self.io_stats, self.agreement = io_stats, agreement
        self.wrap = _wrapper(around)
        self._planner: EpochPlanner | None = None
        self._last: tuple[WindowPacker, ThdCollate] | None = None  # the previous epoch's, for balance
        self.counting = counting_for(config, place) if config.epochs is not None else None
        self.needs_plan = needs_plan(config, sources, place)

    @property
    def planner(self) -> EpochPlanner:
        if self._planner is None:
            self._planner = make_planner(self.config, self.sources, self.place, self.io_stats,
                                         agreement=self.agreement)
            assert self._planner is not None
        return self._planner

    def chain(self, epoch: int | None, planned: bool = True) -> tuple[BaseNode[PackedBatch], dict[str, Any]]:
        config = self.config
        share = self.share if self.share is not None and (epoch is None or epoch == self.share.epoch) else None
        info: dict[str, Any] = {"epoch": epoch}  # metrics()["plan"]; a late quota fills it in when it settles
        if self.sources.packed is not None:
            node, nodes, quota = self._packed(epoch, share)
        else:
            node, nodes, quota = self._samples(epoch, share, planned, info)
        node = nodes["collate"] = ThdCollate(
            node, layout=config.batch_layout(), num_batches=quota,
            surplus_hint=_SURPLUS_HINT if config.topology.batches_per_epoch is None else "raise batches_per_epoch",
            errors=self.errors, dp_rank=self.place.dp_rank, worker_id=self.place.worker_id,
            cost_model=config.cost.model,
            vision_layout=None if config.media is None else vision_layout(config.media))
        if planned and "packer" in nodes:
            self._last = (nodes["packer"], node)
        if not isinstance(quota, LateQuota):
            info["quota"] = quota
        nodes["plan"] = info
        return self.wrap("collate", node), nodes

    def _packed(self, epoch: int | None, share: Share | None) -> tuple[BaseNode[Any], dict[str, Any], int | None]:
        config, place = self.config, self.place
        end, start = (None, 0) if epoch is None else (epoch + 1, epoch)
        if share is not None:
            start = share.epoch
        reader = PackedShardReader(
            self.sources.packed_urls, layout=config.batch_layout(), seed=config.seed,
            shuffle=config.shuffle, epochs=end, start_epoch=start, place=place,
            work=None if share is None else {share.epoch: share.packs})
        quota = None
        if epoch is not None:
            quota = share.quota if share is not None else _worker_quota(config, place)
            if quota is None and place.dp_size > 1:
                quota = reader.quotas(epoch)[place.global_worker]
        return self.wrap("reader", reader), {"reader": reader, "errors": self.errors, "io": self.io_stats}, quota

    def _samples(self, epoch: int | None, share: Share | None, planned: bool,
                 info: dict[str, Any]) -> tuple[BaseNode[Any], dict[str, Any], int | LateQuota | None]:
        config, place = self.config, self.place
        work: list[Span] | None = None
        quota: int | LateQuota | None = None
        if share is not None:
            work, quota = share.spans, share.quota
            if isinstance(quota, LateQuota):
                quota.report_to(info)
        elif epoch is not None and not self.sources.mixture and planned:
            quota = _worker_quota(config, place)
            if self.needs_plan:
                ends = self.restored.pop(epoch, None)  # the first chain of a restore only
                saved = None if ends is None else self.planner.spans_from_ends(epoch, ends)
                plan = self.planner.plan(epoch, place.global_worker, info=info if quota is None else None,
                                         spans=saved)
                work = plan.spans
                quota = quota if quota is not None else plan.quota
        elif self.sources.mixture and config.epochs is not None:  # one chain for the pass: its epochs' batches
            quota = _worker_quota(config, place)
            quota = None if quota is None else quota * config.epochs
        node, nodes = build_samples(config, self.sources, place, tokenizer=self.tokenizer,
                                    stages=self.stages, policy=self.policy, around=self.around,
                                    epoch=share.epoch if share is not None and epoch is None else epoch,
                                    work=work, keep_work=share is not None, io_stats=self.io_stats,
                                    identities=None if share is None else share.identities,
                                    manifest=self.planner.shards if epoch is not None and (
                                        (self.needs_plan and planned) or share is not None) else None)
        replayer = Replayer(self._replay_spec(nodes)) if replayable(self.stages) else None
        node = nodes["overlong"] = OverlongNode(node, config.capacity, config.packing.overlong, replay=replayer,
                                                media=config.media, error_policy=self.policy)
        node = self.wrap("overlong", node)
        node = nodes["packer"] = WindowPacker(
            node, rules=config.packer_rules(packer_seed(config, place)), shuffle=config.shuffle, replay=replayer,
            carry=None if share is None else share.carry, balance=self._balance())
        node = self.wrap("packer", node)
        if config.media is not None:  # pack first, decode after: only emitted packs' pixels
            node = nodes["decode_images"] = DecodeImages(node, config.media, error_policy=self.policy)
        return node, nodes, quota

    def _balance(self) -> Balancing | None:
        """The packer's cost-balanced emission: an epoch continues the previous epoch's schedule
        position (its batches, fillers included) and cost histogram."""
        config, place = self.config, self.place
        if config.cost.balance is None:
            return None
        first, levels = 0, None
        if self._last is not None and self._last[0].reservoir is not None:
            packer, collate = self._last
            first = packer.reservoir.first_batch + collate.counters["batches"]
            levels = packer.reservoir.counts.copy()
        else:
            levels = self._seed_once  # called when the packer starts fresh, never on a restore
        schedule = Schedule(seed=config.seed, packs_per_batch=config.packs_per_batch, lane=place.worker_id,
                            lanes=place.num_workers, ranks=place.dp_size)
        return Balancing(balance=config.cost.balance, cost_model=config.cost.model, schedule=schedule,
                         first_batch=first, levels=levels, media=config.media)

    def _seed_once(self) -> np.ndarray | None:
        return None if self._seed_levels is None else self._seed_levels.copy()

    @functools.cached_property  # one seed per reader: every epoch's and every rebuilt chain's start
    def _seed_levels(self) -> np.ndarray | None:
        return seed_levels(self.config, self.sources, self.place, planner=lambda: self.planner,
                           io_stats=self.io_stats)

    def _replay_spec(self, nodes: Mapping[str, Any]) -> ReplaySpec:
        config, options = self.config, self.config.read
        encoder = nodes["tokenize"].encoder if "tokenize" in nodes else None
        media = None if config.media is None else config.media.reading(options.open_options())  # this run's settings
        return ReplaySpec(
            sources=self.sources.lists, decode=dataclasses.replace(options.decode(), media=media),  # re-read as first read
            opts=options.open_options(), encoder=encoder,
            stages=list(self.stages), max_len=config.capacity, policy=config.packing.overlong,
            media=config.media,
            verify=lambda source, shard: nodes["readers"][source].verify_shard(shard))

_SURPLUS_HINT = ("the epoch plan counted fewer batches from the shard index than the data made: samples "
                 "were skipped (on_error='skip') or a stage changed lengths; pass batches_per_epoch, or "
                 "equal_batches='sync' with streampack.sync_batches in the training loop")


def make_planner(config: StreamConfig, sources: Sources, place: Placement,
                 io_stats: IOStats | None = None, *, agreement: Any = None, count: bool = True,
                 agree: Agree | None = None) -> EpochPlanner | None:
    """The planner of one reader of a finite single-source stream (None for mixtures and
    offline packs), over the data set's manifest (:func:`manifest_of`). ``count`` False plans
    spans only; ``agree`` replaces the store agreement made from ``agreement`` (used for the counts
    only with ``equal_batches="plan"``)."""
    if sources.mixture or sources.packed is not None or sources.shards is None:
        return None
    options = config.read
    manifest = manifest_of(config, sources, io_stats)
    decode, opts = index_decode(options.decode()), options.open_options()
    counting = counting_for(config, place) if count else None
    # equal_batches="count" leaves agree None: the planner counts every reader's batches itself
    if agree is None and agreement is not None and counting is not None and config.topology.equal_batches == "plan":
        from streampack.plan.agree import agree_counts  # lazily: only a distributed run has an agreement

        def agree(key: str, dp_rank: int, worker_id: int, num_workers: int, n: int) -> Any:
            return agree_counts(agreement, key=key, dp_rank=dp_rank, worker_id=worker_id,
                                num_workers=num_workers, count=n)
    chunks = None
    if counting is not None and config.media is not None:  # the index knows text lengths only
        from streampack.media.plan_lengths import MediaLengths

        chunks = MediaLengths(manifest, config.media, options, io_stats).chunks
    return EpochPlanner(manifest, lambda i: manifest.load_index(i, decode, opts), seed=config.seed,
                        shuffle=config.shuffle, dp_size=place.dp_size, num_workers=place.num_workers,
                        counting=counting, agree=agree, chunks=chunks)


def restored_ends(graph_state: Any) -> dict[int, WorkEnds]:
    """The planned epochs' ends a saved graph state's reader recorded (``{}``: none, or a mixture's readers, which
    are not planned)."""
    readers = [node for node in nested(graph_state) if node.get(KIND_KEY) == READER_KIND]
    return ShardReader.undelivered(readers[0]).ends if len(readers) == 1 and readers[0].get(ENDS_KEY) else {}


def needs_plan(config: StreamConfig, sources: Sources, place: Placement) -> bool:
    """Whether the reader at ``place`` reads an epoch plan cut from the manifest. One reader that counts
    nothing reads every shard whole in the epoch's order: no plan, no manifest (building it would read
    every shard once more before the first batch: 2.8 s of a 5.9 s epoch of 60,000 samples in 8 tar
    shards, benchmarks/bench_pipeline.py)."""
    return (config.epochs is not None and sources.shards is not None and not sources.mixture
            and sources.packed is None and (place.global_workers > 1 or counting_for(config, place) is not None))


_GIVEN: dict[tuple[str, str, str], Manifest] = {}


def manifest_of(config: StreamConfig, sources: Sources, io_stats: IOStats | None = None) -> Manifest:
    """The data set's manifest: ``config.read.manifest``, else built once for local shards; remote
    shards without one are refused, naming ``streampack index``. Read once per process and held
    (:func:`hold_manifest`; DataLoader workers get the one ``PackedDataset`` read with the dataset);
    a held local one is re-checked on every call with one ``stat`` per shard, so a rewritten shard
    is seen, instead of read again."""
    assert sources.shards is not None
    options = config.read
    held = _GIVEN.get(_given_key(sources, options))
    if held is not None and (options.manifest is not None or is_current(held, held.urls, options.open_options(),
                                                                        io_stats)):
        return held
    manifest = obtain_manifest(list(sources.shards.urls), location=options.manifest, cache_dir=options.cache_dir,
                               decode=index_decode(options.decode()), opts=options.open_options(), stats=io_stats)
    hold_manifest(config, sources, manifest)
    return manifest


def hold_manifest(config: StreamConfig, sources: Sources, manifest: Manifest) -> None:
    """Make ``manifest`` (read by another process: the dataset a DataLoader worker got carries it)
    what :func:`manifest_of` returns in this process, so the worker does not read it again."""
    _GIVEN.clear()  # one data set at a time
    _GIVEN[_given_key(sources, config.read)] = manifest


def _given_key(sources: Sources, options: ReadOptions) -> tuple[str, str, str]:
    assert sources.shards is not None
    return str(options.manifest), sources.shards.digest, repr(index_decode(options.decode()))


def counting_for(config: StreamConfig, place: Placement) -> Counting | None:
    """What a plan needs to count batches, when ranks must yield equal counts by plan."""
    topology = config.topology
    if place.dp_size == 1 or topology.batches_per_epoch is not None or topology.equal_batches == "sync":
        return None
    return Counting(rules=config.packer_rules(config.seed), max_len=config.capacity, policy=config.packing.overlong,
                    packs_per_batch=config.packs_per_batch)


def packer_seed(config: StreamConfig, place: Placement) -> int:
    return worker_seed(config.seed, place.global_worker)


def graph_metrics(nodes: Mapping[str, Any]) -> dict[str, Any]:
    """Counters of a graph's named nodes (see ``PackedDataset.metrics``)."""
    packer = nodes["packer"].metrics if "packer" in nodes else {}
    return {
        **({"mixture": nodes["mixture"].metrics} if "mixture" in nodes else {}),
        "packing": {**packer, "fill": fill(packer)} if packer else {},
        "overlong": nodes["overlong"].counters.as_dict() if "overlong" in nodes else {},
        "tokenize": dict(nodes["tokenize"].counters) if "tokenize" in nodes else {},
        "stages": [dict(s.counters) for s in nodes.get("stages", ()) if hasattr(s, "counters")],
        "batches": dict(nodes["collate"].counters) if "collate" in nodes else {},
        "plan": dict(nodes.get("plan", {})),
    }


def _epochs(config: StreamConfig, place: Placement) -> tuple[int | None, int]:
    """(end epoch, first epoch) of this pass: pass ``p`` reads ``[p*N, (p+1)*N)``."""
    if config.epochs is None:
        return None, 0
    return (place.passes + 1) * config.epochs, place.passes * config.epochs


def _worker_quota(config: StreamConfig, place: Placement) -> int | None:
    """One reader's share of ``batches_per_epoch`` (None: not set)."""
    per_rank = config.topology.batches_per_epoch
    if per_rank is None:
        return None
    if per_rank % place.num_workers:
        raise ValueError(f"batches_per_epoch={per_rank} must be a multiple of num_workers={place.num_workers}")
    return per_rank // place.num_workers


def _wrapper(around: Mapping[str, Wrap] | None) -> Callable[[str, BaseNode[Any]], BaseNode[Any]]:
    around = dict(around or {})
    unknown = sorted(set(around) - set(STAGES))
    if unknown:
        raise ValueError(f"around names unknown stages {unknown}; stages are {list(STAGES)}")
    return lambda name, node: around[name](node) if name in around else node
