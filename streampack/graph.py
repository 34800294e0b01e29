"""The one graph builder: settings -> the node graph one reader (a DataLoader worker) runs.

::

    ShardReader ─┬─> [Mixture] -> [Tokenize] -> [your stages] -> OverlongNode -> WindowPacker -> ThdCollate
    (one per source)
    PackedShardReader (``streampack pack`` output) ───────────────────────────────────────────> ThdCollate

:class:`StreamConfig` holds every setting that shapes the stream (it is what a resume state is
fingerprinted on); :class:`ReadOptions` holds the ones that do not (retries, caching, thread
counts). The builder hands each node only the values that node uses; each node validates its
own values in its constructor, so building a graph once in the main process (what
``PackedDataset.__init__`` does) is the validation, and nothing is checked twice.

``around`` lets a caller wrap any named stage with torchdata's own nodes, e.g.
``around={"tokenize": lambda n: Prefetcher(n, 16)}``; the wrapped node's state nests in the
graph's state like any other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torchdata.nodes import BaseNode

from streampack.errors import ErrorCounter
from streampack.io.limits import Limits
from streampack.io.packed_format import Manifest
from streampack.io.retry import IOStats, RetryPolicy
from streampack.io.storage import OpenOptions
from streampack.io.urls import ShardList
from streampack.layout.batch import PackedBatch
from streampack.nodes.collate import ThdCollate
from streampack.nodes.mixture import Mixture
from streampack.nodes.overlong import OverlongNode
from streampack.nodes.packed_reader import PackedShardReader
from streampack.nodes.reader import ShardReader
from streampack.nodes.stages import build_stages
from streampack.nodes.tokenize import Tokenize
from streampack.nodes.window_packer import WindowPacker
from streampack.sample import Sample

Wrap = Callable[[BaseNode[Any]], BaseNode[Any]]
STAGES = ("reader", "tokenize", "stages", "overlong", "packer", "collate")
"""Names ``around`` may wrap, in flow order (``reader`` = the reader or the mixture)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Sources:
    """What to read, expanded once: plain shards, a weighted mixture, or offline packs."""

    shards: ShardList | None = None
    mixture: Mapping[str, ShardList] = field(default_factory=dict)
    weights: Mapping[str, float] = field(default_factory=dict)
    """Mixture weights by source name (checked by :class:`~streampack.nodes.mixture.Mixture`)."""
    stop: str = "all"
    """When a finite mixture ends (see :class:`~streampack.nodes.mixture.Mixture`)."""
    packed: Manifest | None = None
    packed_urls: Any = None
    """What the user named for ``packed`` (a directory, its manifest, or some of its shards)."""

    @property
    def digest(self) -> str:
        if self.packed is not None:
            return f"packed:{self.packed.digest}"
        if self.mixture:
            return ";".join(f"{n}={s.digest}" for n, s in sorted(self.mixture.items()))
        assert self.shards is not None
        return self.shards.digest


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamConfig:
    """Every setting that changes the stream of batches (a resume state is fingerprinted on
    these; see ``PackedDataset`` for what each means)."""

    capacity: int
    window: int = 1024
    algorithm: str = "bfd"
    packs_per_batch: int = 1
    align: int = 1
    text_key: str = "text"
    tokens_key: str = "input_ids"
    labels_key: str | None = None
    loss_mask_key: str | None = None
    overlong: str = "split"
    seed: int = 0
    shuffle: bool = True
    epochs: int | None = None
    """Epochs per pass (None = infinite)."""
    on_error: str = "raise"
    pad_id: int = 0
    ignore_index: int = -100
    bos_id: int | None = None
    eos_id: int | None = None
    max_wait: int = 8
    slack: int | None = None
    batches_per_epoch: int | None = None
    vocab_size: int | None = None
    """Token ids (read or tokenized) must be below it; None = below 2**31."""
    limits: Limits = Limits()
    """Bytes per line / member / sample and json depth a reader accepts (they decide which
    samples are kept, so they are part of the fingerprint)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadOptions:
    """Settings that do not change the stream: how shards are fetched and how fast."""

    allow_pipe: bool = False
    allow_pickle: bool = False
    cache_dir: str | None = None
    retries: int | None = None
    retry_budget: float = 120.0
    connect_timeout: float = 10.0
    read_timeout: float = 30.0
    request_deadline: float = 120.0
    allow_redirects: bool = False
    storage_options: Mapping[str, Any] | None = None
    num_threads: int = 1
    tokenize_block: int = 64

    def open_options(self) -> OpenOptions:
        """How the readers fetch shards (validated here: bad values raise ``ValueError``)."""
        return OpenOptions(retry=RetryPolicy(budget=self.retry_budget, retries=self.retries),
                           connect_timeout=self.connect_timeout, read_timeout=self.read_timeout,
                           request_deadline=self.request_deadline, allow_redirects=self.allow_redirects,
                           storage_options=dict(self.storage_options or {}), allow_pipe=self.allow_pipe)


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """Which reader this graph is: data-parallel rank and DataLoader worker."""

    dp_rank: int = 0
    dp_size: int = 1
    worker_id: int = 0
    num_workers: int = 1
    """Readers on this rank (``max(DataLoader num_workers, 1)``)."""
    passes: int = 0
    """Finite mode: completed passes before this one (pass ``p`` reads epochs ``[p*N, (p+1)*N)``)."""

    @property
    def global_worker(self) -> int:
        return self.dp_rank * self.num_workers + self.worker_id

    @property
    def global_workers(self) -> int:
        return self.dp_size * self.num_workers


@dataclass(frozen=True, slots=True, kw_only=True)
class Graph:
    """A built graph: its root and its named nodes (for metrics and restores)."""

    root: BaseNode[PackedBatch]
    nodes: Mapping[str, Any]
    errors: ErrorCounter
    io_stats: IOStats = field(default_factory=IOStats)
    """Reads, retries and faults of every shard read (``metrics()["io"]``)."""


def build_samples(config: StreamConfig, sources: Sources, place: Placement, *, options: ReadOptions = ReadOptions(),
                  tokenizer: Any = None, stages: Sequence[Any] = (), errors: ErrorCounter | None = None,
                  around: Mapping[str, Wrap] | None = None,
                  io_stats: IOStats | None = None) -> tuple[BaseNode[Sample], dict[str, Any]]:
    """The sample half of the graph: reader(s) -> [mixture] -> [tokenize] -> [stages]."""
    errors = errors if errors is not None else ErrorCounter()
    io_stats = io_stats if io_stats is not None else IOStats()
    open_options = options.open_options()
    wrap = _wrapper(around)
    epochs, start = _epochs(config, place)
    readers = {name: ShardReader(
        shards, seed=config.seed, shuffle=config.shuffle, epochs=epochs, start_epoch=start, dp_rank=place.dp_rank,
        dp_size=place.dp_size, worker_id=place.worker_id, num_workers=place.num_workers,
        tokens_key=config.tokens_key, text_key=config.text_key, labels_key=config.labels_key,
        loss_mask_key=config.loss_mask_key, on_error=config.on_error, errors=errors,
        allow_pipe=options.allow_pipe, allow_pickle=options.allow_pickle, cache_dir=options.cache_dir,
        open_options=open_options, io_stats=io_stats, vocab_size=config.vocab_size, limits=config.limits)
        for name, shards in (sources.mixture or {"": sources.shards}).items()}
    nodes: dict[str, Any] = {"reader": next(iter(readers.values())), "errors": errors, "io": io_stats}
    node: BaseNode[Sample] = nodes["reader"]
    if sources.mixture:
        node = nodes["mixture"] = Mixture(readers, sources.weights, seed=config.seed, worker=place.global_worker,
                                          num_workers=place.global_workers, stop=sources.stop)
    node = wrap("reader", node)
    if tokenizer is not None:
        node = nodes["tokenize"] = Tokenize(node, tokenizer, bos_id=config.bos_id, eos_id=config.eos_id,
                                            block_size=options.tokenize_block, num_threads=options.num_threads,
                                            on_error=config.on_error, errors=errors, vocab_size=config.vocab_size)
        node = wrap("tokenize", node)
    node, nodes["stages"] = build_stages(node, stages)
    return wrap("stages", node), nodes


def build_graph(config: StreamConfig, sources: Sources, place: Placement, *, options: ReadOptions = ReadOptions(),
                tokenizer: Any = None, stages: Sequence[Any] = (),
                around: Mapping[str, Wrap] | None = None) -> Graph:
    """The whole graph of one reader, ending in :class:`~streampack.nodes.collate.ThdCollate`."""
    errors, io_stats = ErrorCounter(), IOStats()
    wrap = _wrapper(around)
    if sources.packed is not None:  # `streampack pack` output: no tokenizing or packing
        epochs, start = _epochs(config, place)
        node: BaseNode[Any] = PackedShardReader(
            sources.packed_urls, capacity=config.capacity, align=config.align, seed=config.seed,
            shuffle=config.shuffle, epochs=epochs, start_epoch=start, dp_rank=place.dp_rank, dp_size=place.dp_size, worker_id=place.worker_id, num_workers=place.num_workers)
        nodes: dict[str, Any] = {"reader": node, "errors": errors}
        node = wrap("reader", node)
    else:
        node, nodes = build_samples(config, sources, place, options=options, tokenizer=tokenizer, stages=stages,
                                    errors=errors, around=around, io_stats=io_stats)
        node = nodes["overlong"] = OverlongNode(node, config.capacity, config.overlong)
        node = wrap("overlong", node)
        node = nodes["packer"] = WindowPacker(
            node, capacity=config.capacity, window=config.window, algorithm=config.algorithm, align=config.align,
            seed=config.seed * 1_000_003 + place.global_worker, max_wait=config.max_wait, slack=config.slack,
            shuffle=config.shuffle)
        node = wrap("packer", node)
    node = nodes["collate"] = ThdCollate(
        node, capacity=config.capacity, packs_per_batch=config.packs_per_batch, align=config.align,
        pad_id=config.pad_id, ignore_index=config.ignore_index, num_batches=_quota(config, place),
        errors=errors, dp_rank=place.dp_rank, worker_id=place.worker_id)
    return Graph(root=wrap("collate", node), nodes=nodes, errors=errors, io_stats=io_stats)


def _epochs(config: StreamConfig, place: Placement) -> tuple[int | None, int]:
    """(end epoch, first epoch) of this pass: pass ``p`` reads ``[p*N, (p+1)*N)``."""
    if config.epochs is None:
        return None, 0
    return (place.passes + 1) * config.epochs, place.passes * config.epochs


def _quota(config: StreamConfig, place: Placement) -> int | None:
    """Batches per reader per pass when ``batches_per_epoch`` (per rank) is set."""
    if config.epochs is None or config.batches_per_epoch is None:
        return None
    if config.batches_per_epoch % place.num_workers:
        raise ValueError(f"batches_per_epoch={config.batches_per_epoch} must be a multiple "
                         f"of num_workers={place.num_workers}")
    return config.batches_per_epoch // place.num_workers * config.epochs


def _wrapper(around: Mapping[str, Wrap] | None) -> Callable[[str, BaseNode[Any]], BaseNode[Any]]:
    around = dict(around or {})
    unknown = sorted(set(around) - set(STAGES))
    if unknown:
        raise ValueError(f"around names unknown stages {unknown}; stages are {list(STAGES)}")
    return lambda name, node: around[name](node) if name in around else node
