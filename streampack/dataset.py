"""PackedDataset: shards -> PackedBatch, as a resumable ``IterableDataset``.

A thin front over :func:`streampack.graph.build.build_graph`: the constructor expands the sources,
resolves the topology and builds the graph once in the main process (where every setting is
validated); ``__iter__`` builds it again in each DataLoader worker and continues from a loaded state.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy.random  # noqa: F401  (see below)
import torch
from torch.utils.data import IterableDataset

from streampack.errors import log_worker_error
from streampack.graph.build import (
    Graph,
    build_graph,
    counting_for,
    graph_metrics,
    hold_manifest,
    manifest_of,
    needs_plan,
    restored_ends,
)
from streampack.graph.preflight import preflight
from streampack.integrations.loader import quiet_set_vital
from streampack.io.manifest import Manifest
from streampack.layout import transfer
from streampack.layout.batch import PackedBatch, pack_batch
from streampack.layout.parent_death import die_with_parent
from streampack.media.options import MediaOptions
from streampack.nodes.collate import filler_pack
from streampack.nodes.epochs import add_metrics
from streampack.nodes.window_packer import fill
from streampack.options import CostOptions, PackOptions, ReadOptions, TokenizeOptions, TopologyOptions, checked_records
from streampack.plan.epoch_plan import unplannable
from streampack.plan.passes import PassTracker
from streampack.plan.reshard import PendingResume
from streampack.plan.state import (
    FINGERPRINT_KEY,
    GRAPH_KEY,
    METRICS_KEY,
    PASSES_KEY,
    STATE_VERSION,
    VERSION_KEY,
    WORKER_KEY,
    check_current,
    check_fingerprint,
    check_version,
    dataset_record,
    record_of,
    record_text,
)
from streampack.plan.topology import current_worker, resolve_topology
from streampack.settings import Placement, Share, StreamConfig, URLs, fingerprint_settings, sources_of, tokenizer_id

# ``numpy.random`` is imported in the training process because every DataLoader worker seeds it as it
# starts: forked workers inherit it (9.5 ms of CPU per worker start instead of 22).

quiet_set_vital()  # torchdata's StatefulDataLoader(ds, ...) warns on every construction (loader.py)

_STATELESS_MAIN = ("this PackedDataset is read by DataLoader worker processes: the copy in the main process "
                   "has no position, so its state_dict() would silently restart the data. Checkpoint the loader "
                   "instead: torchdata's StatefulDataLoader(ds, batch_size=None, num_workers=N) and "
                   "loader.state_dict() (each worker's state is inside; streampack.plan.state.dataset_states() lists "
                   "them), or the streampack.integrations helpers for your trainer")


class PackedDataset(IterableDataset):
    """Packed THD batches from tar / jsonl / parquet shards on any fsspec store, with exact resumable state.

    Use with ``DataLoader(ds, batch_size=None, num_workers=N)`` or ``StatefulDataLoader``; each item is
    a :class:`~streampack.layout.batch.PackedBatch` of ``packs_per_batch`` packs of ``capacity``
    tokens. The few settings most runs set are parameters; everything else comes in one option record
    per stage (:mod:`streampack.options`), each checked when it was made. ``urls`` may map source names
    to ``urls`` or ``(urls, weight)`` for a weighted :class:`~streampack.nodes.mixture.Mixture`.

    ``epochs=None`` streams forever on every reader; ``epochs=N`` runs N epochs per fresh iteration
    (``set_epoch(p)`` picks the pass), each epoch's samples split between all readers of all ranks at
    sample granularity, balanced by tokens, read exactly once, and every rank yields the same number of
    batches (``TopologyOptions.equal_batches``: counted from the manifest and agreed through the
    ``torch.distributed`` store, with filler batches, by default; see ``docs/dataset.md``).

    ``state_dict()`` is this process's (or worker's) position: versioned, fingerprinted, plain data, bounded by the
    window; ``load_state_dict(state)`` continues bit-identically, and ``load_state_dict([every reader's state])``
    resumes on any ``dp_size`` / ``num_workers`` with every sample of the epoch trained exactly once. In the main
    process of a DataLoader with workers ``state_dict()`` raises (that copy has no position): checkpoint the
    StatefulDataLoader instead. A shard that changed since the save is refused by name (``ReadOptions.identity``).
    """

    def __init__(self, urls: URLs | Mapping[str, Any], *, capacity: int, tokenizer: Any = None,
                 epochs: int | None = None, shuffle: bool = True, seed: int = 0, packs_per_batch: int = 1,
                 stages: Sequence[Any] = (), read: ReadOptions | None = None, tokenize: TokenizeOptions | None = None,
                 packing: PackOptions | None = None, topology: TopologyOptions | None = None,
                 cost: CostOptions | None = None, media: MediaOptions | None = None) -> None:
        super().__init__()
        records = checked_records({"read": read, "tokenize": tokenize, "packing": packing, "topology": topology,
                                   "cost": cost})
        asked = records["topology"]
        self.dp_rank, self.dp_size = resolve_topology(asked.dp_rank, asked.dp_size, asked.dp_group)
        # the group is a runtime object (not picklable into workers): only its numbers are kept
        resolved = dataclasses.replace(asked, dp_group=None, dp_rank=self.dp_rank, dp_size=self.dp_size)
        self.config = StreamConfig(capacity=capacity, packs_per_batch=packs_per_batch, seed=seed, shuffle=shuffle,
                                   epochs=epochs, read=records["read"], tokenize=records["tokenize"],
                                   packing=records["packing"], topology=resolved, cost=records["cost"], media=media)
        read = self.config.read
        self.sources = sources_of(urls, opts=read.open_options(), mixture_stop=read.mixture_stop)
        if self.sources.packed is None:  # a typo fails now, not when a reader reaches the shard
            preflight(self.sources.lists, read)
        self.tokenizer, self.stages = tokenizer, list(stages)
        self._agreement: Any = None
        self._manifest = None
        self._build(Placement(dp_rank=self.dp_rank, dp_size=self.dp_size), validate=True)  # what only nodes check
        self._manifest = self._given_manifest()
        manifest = self._check_equal_batches()
        self._tokenizer_id = tokenizer_id(tokenizer)  # hashed once: state_dict() runs every batch
        self._fingerprint_texts: dict[int, str] = {}
        self._agreement = _agreement(asked.dp_group, self.dp_rank, self.dp_size, asked.agree_timeout_s,
                                     self._shared_settings(manifest))
        self._check_agreement(explicit=asked.dp_rank is not None and asked.dp_size is not None)
        self._tracker = PassTracker()
        self._graph: Graph | None = None
        self._pending: Any = None  # a loaded state, or elastic.Pending
        self._pending_generation = 0
        self._pass = 0
        self._generation = 0

    # ----------------------------------------------------------------- what users read
    @property
    def align(self) -> int:
        return self.config.topology.align

    @property
    def urls(self) -> list[str]:
        """Every shard, in order (a mixture's sources concatenated by name)."""
        return [u for s in self.sources.lists for u in s.urls]

    @property
    def mixture(self) -> dict[str, list[str]] | None:
        return {n: list(s.urls) for n, s in sorted(self.sources.mixture.items())} or None

    @property
    def mixture_weights(self) -> dict[str, float]:
        return dict(self.sources.weights)

    def set_epoch(self, epoch: int) -> None:
        """Finite mode: the pass the next fresh iteration runs (its shard order), in every worker."""
        if epoch < 0:
            raise ValueError(f"{epoch=} must be >= 0")
        self._tracker.set_next_pass(epoch)

    def fingerprint(self, num_workers: int | None = None) -> dict[str, Any]:
        """Every setting that changes the stream (compared on load)."""
        if num_workers is None:
            num_workers = current_worker().num_workers
        # decoded from the state's text, so it equals what a saved state decodes to (tuples as lists)
        return record_of(self._fingerprint_text(num_workers))

    def _fingerprint_text(self, num_workers: int) -> str:
        """The fingerprint as a state keeps it, made once per worker count: StatefulDataLoader asks for the
        state after every batch (85 µs a time, ~2% of a batch of 8 x 4096 pre-tokenized tokens)."""
        text = self._fingerprint_texts.get(num_workers)
        if text is None:
            text = self._fingerprint_texts[num_workers] = record_text(self._settings(num_workers))
        return text

    def _settings(self, num_workers: int) -> dict[str, Any]:
        mixture = ({"mixture_sources": {n: s.digest for n, s in sorted(self.sources.mixture.items())},
                    "mixture_weights": self.mixture_weights, "mixture_stop": self.sources.stop}
                   if self.sources.mixture else {})
        return {**fingerprint_settings(self.config), **mixture, "sources": self.sources.digest,
                "num_sources": len(self.urls), "tokenizer": self._tokenizer_id, "num_stages": len(self.stages),
                "dp_size": self.dp_size, "dp_rank": self.dp_rank, "num_workers": num_workers}

    def _shared_settings(self, manifest: Any) -> dict[str, Any]:
        """What every rank must have alike: the fingerprint less rank and worker count, plus the manifest's."""
        shared = {k: v for k, v in self._settings(0).items() if k not in ("dp_rank", "num_workers")}
        if manifest is not None:
            shared["manifest"] = manifest.fingerprint("size")  # not tags: node-local copies differ in mtime
        # the fingerprint records "count" as "plan" (same batches), but a "plan" rank would wait out
        # the timeout in a store round that a "count" rank never joins
        shared["equal_batches"] = self.config.topology.equal_batches
        return shared

    def _check_agreement(self, explicit: bool) -> None:
        """Refuse a finite multi-rank plan with no store to agree through: each reader would count every
        reader's batches (O(samples of the data set) per reader), which only ``equal_batches="count"`` asks for."""
        c = self.config
        if (self._agreement is not None or c.epochs is None or self.dp_size == 1 or self.sources.shards is None
                or c.topology.equal_batches != "plan" or counting_for(c, Placement(dp_size=self.dp_size)) is None):
            return
        where = ("explicit TopologyOptions(dp_rank=, dp_size=)" if explicit else "RANK/WORLD_SIZE from the launcher")
        raise ValueError(
            f"a finite epoch over dp_size={self.dp_size} ranks ({where}) is planned by the ranks agreeing on "
            f"their batch counts through torch.distributed's store, and torch.distributed is not initialized; "
            f"without a store each reader would count every reader's batches: index reads and CPU over the "
            f"whole data set ({len(self.urls)} shards) per reader and epoch. Call "
            f"torch.distributed.init_process_group() before building the dataset (any backend and init method: "
            f"its store is used; 5 store requests per reader and epoch), or pass "
            f"TopologyOptions(batches_per_epoch=N), or equal_batches='sync' and iterate "
            f"streampack.sync_batches(loader, ds), or equal_batches='count' to pay that cost (ranks simulated in "
            f"one process, small data sets)")

    def filler(self) -> PackedBatch:
        """A batch of the stream's shape that trains nothing (what ``sync_batches`` feeds a rank that ran out)."""
        c, pack = self.config, self.config.packing
        batch = pack_batch([filler_pack(c.capacity, pack.pad_id)] * c.packs_per_batch, capacity=c.capacity,
                           align=c.topology.align, pad_id=pack.pad_id, ignore_index=pack.ignore_index)
        return batch if c.cost.model is None else dataclasses.replace(batch, est_cost=0.0)

    def state_dict(self) -> dict[str, Any]:
        here = current_worker()
        if self._graph is None and here.num_workers == 0 and self._tracker.workers_iterated():
            raise RuntimeError(_STATELESS_MAIN)
        if isinstance(self._pending, dict):
            return self._pending  # saved right after a load: the loaded position
        if self._pending is not None:
            raise RuntimeError("an elastic resume was loaded but has not started: iterate first, or keep "
                               "the old states to load again")
        return {
            VERSION_KEY: STATE_VERSION,
            FINGERPRINT_KEY: self._fingerprint_text(here.num_workers),
            WORKER_KEY: {"dp_rank": self.dp_rank, "worker_id": here.id},
            PASSES_KEY: self._pass if self._graph is not None else self._tracker.next_pass(here.id),
            GRAPH_KEY: self._graph.root.state_dict() if self._graph is not None else None,
            METRICS_KEY: record_text(self.metrics()),
        }

    def load_state_dict(self, state: dict[str, Any] | Sequence[dict[str, Any]]) -> None:
        """One state (this reader's, same topology) or the states of every reader of a run (any topology)."""
        if isinstance(state, Mapping):
            check_version(state)
            check_current(state)
            saved = dataset_record(state, FINGERPRINT_KEY)
            check_fingerprint(saved, self.fingerprint(saved.get("num_workers")))  # workers: in __iter__
            self._pending = state
        else:
            self._pending = PendingResume.load(self, list(state))
        self._pending_generation = self._tracker.new_generation()
        self._generation += 1  # a live iterator must not continue from a replaced position

    def metrics(self) -> dict[str, Any]:
        """Counters of this process's graph (with workers: ``dataset_states(loader.state_dict())``' metrics)."""
        if self._graph is None:
            return {}
        now = graph_metrics(self._graph.nodes)
        plan = now.pop("plan")
        # no finished epoch, nothing to add: state_dict() runs after every batch, and the sum is half of this call
        if self._graph.loop is not None and self._graph.loop.totals:
            now = add_metrics(self._graph.loop.totals, now)
            if now.get("packing"):
                now["packing"]["fill"] = fill(now["packing"])
        return {**now, "plan": plan, "errors": self._graph.errors.as_dict(), "io": self._graph.io_stats.as_dict()}

    # ----------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[PackedBatch]:
        here = current_worker()
        if here.num_workers > 0 and multiprocessing.parent_process() is not None:  # a worker process
            die_with_parent()  # first: a worker must not outlive a killed training process
            transfer.settle_worker()
        if self._manifest is not None:  # read by the main process (another dataset's may be held since)
            hold_manifest(self.config, self.sources, self._manifest)
        pending, self._pending = self._pending, None
        if pending is not None and not self._tracker.claim(here.id, self._pending_generation):
            pending = None  # used by this reader in an earlier iteration: a fresh pass now
        state, share = pending, None
        if isinstance(pending, PendingResume):
            state, share = pending.for_reader(self, here)
        if state is not None:
            check_fingerprint(dataset_record(state, FINGERPRINT_KEY), self.fingerprint(here.num_workers))
            saved = state[WORKER_KEY]
            if saved["worker_id"] != here.id or saved["dp_rank"] != self.dp_rank:
                raise ValueError(f"state of dp_rank={saved['dp_rank']} worker_id={saved['worker_id']} "
                                 f"loaded into dp_rank={self.dp_rank} worker_id={here.id}")
        resume = state[PASSES_KEY] if state is not None else (pending.left.passes if share is not None else None)
        self._pass = self._tracker.begin(here.id, in_worker_process=here.num_workers > 0, resume=resume)
        saved_graph = state[GRAPH_KEY] if state is not None else None
        self._graph = self._build(Placement(dp_rank=self.dp_rank, dp_size=self.dp_size, worker_id=here.id,
                                            num_workers=here.readers, passes=self._pass), share=share,
                                  restored=restored_ends(saved_graph) if saved_graph is not None else None)
        if state is not None and state[GRAPH_KEY] is not None:
            self._graph.root.reset(state[GRAPH_KEY])
            # A restored graph has read exactly as far as the saved one (each node replays up to
            # its saved read position), so the saved error and I/O counts are the counts now.
            saved = dataset_record(state, METRICS_KEY)
            if saved.get("errors") is not None:
                self._graph.errors.load(saved["errors"])
            if saved.get("io") is not None:
                self._graph.io_stats.load(saved["io"])
        else:
            self._graph.root.reset(None)
        self._generation += 1
        return self._run(self._generation, self._graph, pin=self.config.packing.pin_memory and here.num_workers == 0)

    def _build(self, place: Placement, share: Share | None = None, validate: bool = False,
               restored: Any = None) -> Graph:
        return build_graph(self.config, self.sources, place, tokenizer=self.tokenizer, stages=self.stages,
                           share=share, validate=validate, agreement=self._agreement, restored=restored)

    def _check_equal_batches(self) -> Any:
        """Finite, several ranks: the manifest the plan needs (None otherwise), refused without token totals."""
        c = self.config
        if c.epochs is None or self.dp_size == 1 or self.sources.packed is not None:
            return None
        if self.sources.mixture:
            if c.topology.batches_per_epoch is None and c.topology.equal_batches != "sync":
                raise ValueError(f"a finite mixture over dp_size={self.dp_size} ranks cannot be planned (sources are "
                                 f"drawn at random): pass batches_per_epoch, or equal_batches='sync' and iterate "
                                 f"streampack.sync_batches(loader, ds)")
            return None
        manifest = self._manifest if self._manifest is not None else manifest_of(c, self.sources)
        if counting_for(c, Placement(dp_size=self.dp_size)) is not None and not manifest.known_lengths():
            raise ValueError(unplannable(manifest, self.dp_size))
        return manifest

    def _run(self, generation: int, graph: Graph, pin: bool) -> Iterator[PackedBatch]:
        pin = pin and torch.cuda.is_available()
        while True:
            if generation != self._generation:
                raise RuntimeError("this PackedDataset iterator was superseded by load_state_dict() "
                                   "or a newer iter(); create a new iterator")
            try:
                batch = next(graph.root)
            except StopIteration:
                return
            except Exception as e:
                here = current_worker()
                if here.num_workers > 0:  # torch turns it into a long traceback: one line first
                    log_worker_error(e, worker_id=here.id, num_workers=here.num_workers, dp_rank=self.dp_rank)
                raise
            yield batch.pin_memory() if pin else batch

    def before_workers(self, num_workers: int) -> None:
        """Read here, once, what each of ``num_workers`` DataLoader workers would read for itself before its
        first batch: the data set's manifest, when their epochs are planned (forked workers inherit it, spawned
        ones get it with the dataset; 5.4 ms of CPU in each worker's restore, ``benchmarks/bench_restore.py
        --phases``). :func:`~streampack.plan.state.load_loader_state` calls it."""
        place = Placement(dp_rank=self.dp_rank, dp_size=self.dp_size, num_workers=max(num_workers, 1))
        if num_workers > 0 and self._manifest is None and needs_plan(self.config, self.sources, place):
            self._manifest = manifest_of(self.config, self.sources)

    def _given_manifest(self) -> Manifest | None:
        """The ``read.manifest`` of a finite single-source stream, read once in the main process (workers get
        it with the dataset: 1 read per rank instead of 1 + W; a damaged one is refused before they start)."""
        if self.config.epochs is None or self.config.read.manifest is None or self.sources.shards is None:
            return None  # sources_of: shards are None for a mixture or offline packs
        return manifest_of(self.config, self.sources)

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers get a copy without the live graph (it is rebuilt in __iter__)
        return {**self.__dict__, "_graph": None}


def _agreement(dp_group: Any, dp_rank: int, dp_size: int, timeout_s: float | None,
               settings: dict[str, Any]) -> Any:
    """How this rank's readers agree through the job's store, after checking every rank's ``settings``."""
    if dp_size == 1:
        return None
    from streampack.plan.agree import Agreement

    return Agreement.from_dist(dp_group, dp_rank, dp_size, timeout_s=timeout_s, settings=settings)
