"""PackedDataset: shards -> PackedBatch, as a resumable ``IterableDataset``.

A thin front over :func:`streampack.graph.build_graph`: the constructor expands the sources
once, resolves the topology once, and builds the graph once in the main process, which is
where every setting is validated (by the node that uses it). ``__iter__`` builds the same
graph in each DataLoader worker and continues from a loaded state if there is one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Iterator, Mapping, Sequence
from numbers import Real
from typing import Any

import torch
from torch.utils.data import IterableDataset

from streampack.graph import (
    Graph,
    Placement,
    ReadOptions,
    Sources,
    StreamConfig,
    build_graph,
)
from streampack.io.limits import Limits
from streampack.io.packed_format import is_packed_dataset, packed_manifest
from streampack.io.storage import OpenOptions
from streampack.io.urls import ShardList
from streampack.layout.batch import PackedBatch, alignment
from streampack.nodes.window_packer import fill
from streampack.state import (
    FINGERPRINT_KEY,
    GRAPH_KEY,
    METRICS_KEY,
    PASSES_KEY,
    STATE_VERSION,
    VERSION_KEY,
    WORKER_KEY,
    check_fingerprint,
    check_version,
)
from streampack.topology import current_worker, resolve_topology

URLs = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


class PackedDataset(IterableDataset):
    """Packed THD batches from tar / jsonl / parquet shards on any fsspec store, with exact resumable state.

    Use with ``DataLoader(ds, batch_size=None, num_workers=N)`` or
    ``StatefulDataLoader(ds, batch_size=None, num_workers=N)``; each item is a
    :class:`~streampack.layout.batch.PackedBatch` of ``packs_per_batch`` packs of ``capacity`` tokens.

    **Streams and equal batch counts.** ``epochs=None`` (default) is infinite: every worker of
    every rank streams forever, so no rank ever runs out and collectives never hang.
    ``epochs=N`` is finite: each fresh ``__iter__`` runs N epochs (pass ``p`` reads epochs
    ``[p*N, (p+1)*N)``, so a second pass reshuffles; call ``set_epoch(p)`` before creating
    workers to choose it, like ``DistributedSampler``). Ranks hold different amounts of data,
    so in finite mode with ``dp_size > 1`` you must give ``batches_per_epoch`` (per rank, a
    multiple of the worker count): every worker yields exactly ``batches_per_epoch /
    num_workers`` batches per pass, padding with *filler* batches (``doc_keys ==
    ("<filler>",)``, zero targets, counted in ``metrics()["batches"]["fillers"]``) when its data
    runs out, and raising ``ValueError`` when it has more (it never drops data silently). The
    last real batch of a finite worker may hold fewer than ``packs_per_batch`` packs.

    **Mixtures.** ``urls`` may map source names to ``urls`` (weight 1) or ``(urls, weight)``,
    e.g. ``{"web": ("web-{000..099}.tar", 0.7), "code": ("code/*.tar", 0.3)}``: one ShardReader
    per source under a :class:`~streampack.nodes.mixture.Mixture` (torchdata's
    ``MultiNodeWeightedSampler``). Finite mixtures end by ``mixture_stop``.

    **Topology.** ``dp_rank``/``dp_size`` default to ``torch.distributed`` (pass the
    data-parallel rank when TP/CP/PP groups exist), then ``RANK``/``WORLD_SIZE``; they are
    resolved when the dataset is constructed.

    **State.** ``state_dict()`` is this process's (or worker's) position: versioned,
    fingerprinted (:class:`~streampack.graph.StreamConfig`, sources, tokenizer, dp_size,
    dp_rank, num_workers), plain data, bounded by the window. ``load_state_dict`` validates it
    and the next ``__iter__`` continues exactly; a fresh ``__iter__`` without a loaded state
    starts a new pass. Loading a state invalidates any live iterator of this dataset (it
    raises ``RuntimeError`` on its next step) so two iterators never share one position. With
    StatefulDataLoader, check the worker count with :func:`streampack.state.load_loader_state`.
    """

    def __init__(self, urls: URLs | Mapping[str, Any], *, capacity: int, window: int = 1024,
                 algorithm: str = "bfd", packs_per_batch: int = 1, tokenizer: Any = None,
                 text_key: str = "text", tokens_key: str = "input_ids", overlong: str = "split",
                 cp_size: int = 1, tp_size: int = 1, seed: int = 0, shuffle: bool = True,
                 epochs: int | None = None, dp_rank: int | None = None, dp_size: int | None = None,
                 on_error: str = "raise", pad_id: int = 0, ignore_index: int = -100,
                 bos_id: int | None = None, eos_id: int | None = None, stages: Sequence[Any] = (),
                 num_threads: int = 1, tokenize_block: int = 64, max_wait: int = 8,
                 slack: int | None = None, batches_per_epoch: int | None = None,
                 labels_key: str | None = None, loss_mask_key: str | None = None,
                 sequence_parallel: bool = True, align_multiple: int = 1, allow_pipe: bool = False,
                 allow_pickle: bool = False, cache_dir: str | None = None, retries: int | None = None,
                 retry_budget: float = 120.0, connect_timeout: float = 10.0, read_timeout: float = 30.0,
                 request_deadline: float = 120.0, allow_redirects: bool = False,
                 storage_options: Mapping[str, Any] | None = None,
                 pin_memory: bool = False, mixture_stop: str = "all", vocab_size: int | None = None,
                 limits: Limits | None = None) -> None:
        super().__init__()
        if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
            raise ValueError(f"{epochs=} must be None (infinite) or an int >= 1")
        if batches_per_epoch is not None and (epochs is None or batches_per_epoch < 1):
            raise ValueError(f"{batches_per_epoch=} needs a finite stream (epochs=N) and must be >= 1")
        self.config = StreamConfig(
            capacity=capacity, window=window, algorithm=algorithm, packs_per_batch=packs_per_batch,
            align=alignment(cp_size, tp_size, sequence_parallel=sequence_parallel, multiple=align_multiple),
            text_key=text_key, tokens_key=tokens_key, labels_key=labels_key, loss_mask_key=loss_mask_key,
            overlong=overlong, seed=seed, shuffle=shuffle, epochs=epochs, on_error=on_error, pad_id=pad_id,
            ignore_index=ignore_index, bos_id=bos_id, eos_id=eos_id, max_wait=max_wait, slack=slack,
            batches_per_epoch=batches_per_epoch, vocab_size=vocab_size,
            limits=limits if limits is not None else Limits())
        self.options = ReadOptions(allow_pipe=allow_pipe, allow_pickle=allow_pickle, cache_dir=cache_dir,
                                   retries=retries, retry_budget=retry_budget, connect_timeout=connect_timeout,
                                   read_timeout=read_timeout, request_deadline=request_deadline,
                                   allow_redirects=allow_redirects, storage_options=storage_options,
                                   num_threads=num_threads, tokenize_block=tokenize_block)
        self.sources = _sources(urls, opts=self.options.open_options(), mixture_stop=mixture_stop)
        self.tokenizer, self.stages, self.pin_memory = tokenizer, list(stages), pin_memory
        self.dp_rank, self.dp_size = resolve_topology(dp_rank, dp_size)
        if epochs is not None and self.dp_size > 1 and batches_per_epoch is None:
            raise ValueError(f"finite mode (epochs={epochs}) with dp_size={self.dp_size} needs "
                             f"batches_per_epoch, or ranks may yield different batch counts and hang")
        self._build(Placement(dp_rank=self.dp_rank, dp_size=self.dp_size))  # validates every setting
        self._tokenizer_id = _tokenizer_id(tokenizer)  # hashed once: state_dict() runs every batch
        self._graph: Graph | None = None
        self._pending: dict[str, Any] | None = None
        self._pass = 0
        self._next_pass = 0
        self._generation = 0

    # ----------------------------------------------------------------- what users read
    @property
    def align(self) -> int:
        return self.config.align

    @property
    def urls(self) -> list[str]:
        """Every shard, in order (a mixture's sources concatenated by name)."""
        if self.sources.mixture:
            return [u for _, s in sorted(self.sources.mixture.items()) for u in s.urls]
        return list(self.sources.shards.urls) if self.sources.shards is not None else []

    @property
    def mixture(self) -> dict[str, list[str]] | None:
        return {n: list(s.urls) for n, s in sorted(self.sources.mixture.items())} or None

    @property
    def mixture_weights(self) -> dict[str, float]:
        return dict(self.sources.weights)

    def set_epoch(self, epoch: int) -> None:
        """Finite mode: the pass the next fresh ``__iter__`` runs (its shard order)."""
        if epoch < 0:
            raise ValueError(f"{epoch=} must be >= 0")
        self._next_pass = epoch

    def fingerprint(self, num_workers: int | None = None) -> dict[str, Any]:
        """Every setting that changes the stream (compared on load)."""
        if num_workers is None:
            num_workers = current_worker().num_workers
        mixture = ({"mixture_sources": {n: s.digest for n, s in sorted(self.sources.mixture.items())},
                    "mixture_weights": self.mixture_weights, "mixture_stop": self.sources.stop}
                   if self.sources.mixture else {})
        return {**dataclasses.asdict(self.config), **mixture, "sources": self.sources.digest,
                "num_sources": len(self.urls), "tokenizer": self._tokenizer_id,
                "num_stages": len(self.stages), "dp_size": self.dp_size, "dp_rank": self.dp_rank,
                "num_workers": num_workers}

    def state_dict(self) -> dict[str, Any]:
        if self._pending is not None:
            return self._pending  # saved right after a load: the loaded position
        here = current_worker()
        return {
            VERSION_KEY: STATE_VERSION,
            FINGERPRINT_KEY: self.fingerprint(here.num_workers),
            WORKER_KEY: {"dp_rank": self.dp_rank, "worker_id": here.id},
            PASSES_KEY: self._pass if self._graph is not None else self._next_pass,
            GRAPH_KEY: self._graph.root.state_dict() if self._graph is not None else None,
            METRICS_KEY: self.metrics(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_version(state)
        saved = state[FINGERPRINT_KEY]
        check_fingerprint(saved, self.fingerprint(saved.get("num_workers")))  # workers: in __iter__
        self._pending = state
        self._generation += 1  # a live iterator must not continue from a replaced position

    def metrics(self) -> dict[str, Any]:
        """Counters of this process's graph (with DataLoader workers, read them from the loader
        state: ``[s["metrics"] for s in streampack.state.dataset_states(loader.state_dict())]``)."""
        if self._graph is None:
            return {}
        n = self._graph.nodes
        packer = n["packer"].metrics if "packer" in n else {}
        return {
            **({"mixture": n["mixture"].metrics} if "mixture" in n else {}),
            "packing": {**packer, "fill": fill(packer)} if packer else {},
            "overlong": n["overlong"].counters.as_dict() if "overlong" in n else {},
            "errors": self._graph.errors.as_dict(),
            "io": self._graph.io_stats.as_dict(),
            "tokenize": dict(n["tokenize"].counters) if "tokenize" in n else {},
            "stages": [dict(s.counters) for s in n.get("stages", ()) if hasattr(s, "counters")],
            "batches": dict(n["collate"].counters),
        }

    # ----------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[PackedBatch]:
        here = current_worker()
        state, self._pending = self._pending, None
        if state is not None:
            check_fingerprint(state[FINGERPRINT_KEY], self.fingerprint(here.num_workers))
            saved = state[WORKER_KEY]
            if saved["worker_id"] != here.id or saved["dp_rank"] != self.dp_rank:
                raise ValueError(f"state of dp_rank={saved['dp_rank']} worker_id={saved['worker_id']} "
                                 f"loaded into dp_rank={self.dp_rank} worker_id={here.id}")
            self._pass = state[PASSES_KEY]
        else:
            self._pass = self._next_pass
        self._next_pass = self._pass + 1
        self._graph = self._build(Placement(dp_rank=self.dp_rank, dp_size=self.dp_size, worker_id=here.id,
                                            num_workers=here.readers, passes=self._pass))
        if state is not None and state[GRAPH_KEY] is not None:
            self._graph.root.reset(state[GRAPH_KEY])
            # A restored graph has read exactly as far as the saved one (each node replays up to
            # its saved read position), so the saved error counts are the counts now; errors met
            # while replaying are already in them.
            saved = state.get(METRICS_KEY) or {}
            if saved.get("errors") is not None:
                self._graph.errors.load(saved["errors"])
            if saved.get("io") is not None:
                self._graph.io_stats.load(saved["io"])
        else:
            self._graph.root.reset(None)
        self._generation += 1
        return self._run(self._generation, self._graph, pin=self.pin_memory and here.num_workers == 0)

    def _build(self, place: Placement) -> Graph:
        return build_graph(self.config, self.sources, place, options=self.options, tokenizer=self.tokenizer,
                           stages=self.stages)

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
            yield batch.pin_memory() if pin else batch

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers get a copy without the live graph (it is rebuilt in __iter__)
        return {**self.__dict__, "_graph": None}


def _sources(urls: URLs | Mapping[str, Any], *, opts: OpenOptions, mixture_stop: str) -> Sources:
    """Expand what the user named, once: a mixture mapping, a packed directory, or shards."""
    if isinstance(urls, Mapping):
        shards, weights = {}, {}
        for name, value in urls.items():
            weighted = isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], Real)
            source, weights[name] = value if weighted else (value, 1.0)
            if is_packed_dataset(source):
                raise ValueError(f"mixture source {name!r} is a `streampack pack` directory; mixtures "
                                 f"read raw shards only")
            shards[name] = ShardList.of(source, allow_pipe=opts.allow_pipe, opts=opts)
        if not shards:
            raise ValueError("a mixture needs at least one source")
        by_name = dict(sorted(weights.items(), key=lambda kv: str(kv[0])))  # mapping order never matters
        return Sources(mixture=shards, weights=by_name, stop=mixture_stop)
    if is_packed_dataset(urls):
        return Sources(packed=packed_manifest(urls), packed_urls=urls)
    return Sources(shards=ShardList.of(urls, allow_pipe=opts.allow_pipe, opts=opts))


def _tokenizer_id(tokenizer: Any) -> str | None:
    """What identifies a tokenizer in the fingerprint: a changed vocabulary changes every id."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, (str, os.PathLike)):  # the Tokenize node checked that it exists
        with open(tokenizer, "rb") as f:
            return "sha1:" + hashlib.sha1(f.read()).hexdigest()[:16]
    if hasattr(tokenizer, "to_str"):  # tokenizers.Tokenizer: its full serialized definition
        return "sha1:" + hashlib.sha1(tokenizer.to_str().encode()).hexdigest()[:16]
    name = getattr(tokenizer, "__qualname__", type(tokenizer).__qualname__)
    return f"{getattr(tokenizer, '__module__', '')}.{name}"
