"""PackedDataset: shards -> PackedBatch, as a resumable ``IterableDataset``.

Graph (built inside ``__iter__`` in every DataLoader worker; one node per stage)::

    ShardReader -> [Tokenize] -> [user stages] -> OverlongNode -> WindowPacker -> ThdCollate

With ``urls`` a mapping (a weighted mixture), the first stage is one ShardReader per source
under a :class:`~streampack.pipeline.mixture.MixtureNode`; the rest of the graph is the same.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping, Sequence
from numbers import Real
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.nodes import BaseNode

from streampack import packing
from streampack.batch import PackedBatch, alignment
from streampack.overlong import check_policy
from streampack.pipeline.collate import ThdCollate
from streampack.pipeline.errors import ON_ERROR_CHOICES, ErrorCounter
from streampack.pipeline.mixture import MixtureNode, check_weights
from streampack.pipeline.overlong_node import OverlongNode
from streampack.pipeline.packed_source import (
    PackedShardReader,
    check_layout,
    is_packed_dataset,
    packed_manifest,
)
from streampack.pipeline.sharding import resolve_topology
from streampack.pipeline.source import ShardReader
from streampack.pipeline.stages import build_stages, check_stages
from streampack.pipeline.tokenize import Tokenize
from streampack.pipeline.urls import expand_urls
from streampack.pipeline.window_packer import WindowPacker, fill
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


class PackedDataset(IterableDataset):
    """Packed THD batches from sharded tar / jsonl data, with exact resumable state.

    Use with ``DataLoader(ds, batch_size=None, num_workers=N)`` or
    ``StatefulDataLoader(ds, batch_size=None, num_workers=N)``; each item is a
    :class:`~streampack.batch.PackedBatch` of ``packs_per_batch`` packs of ``capacity`` tokens.

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
    per source under a :class:`~streampack.pipeline.mixture.MixtureNode`, ``epochs=None`` only.

    **Topology.** ``dp_rank``/``dp_size`` default to ``torch.distributed`` (pass the
    data-parallel rank when TP/CP/PP groups exist), then ``RANK``/``WORLD_SIZE``; they are
    resolved when the dataset is constructed.

    **State.** ``state_dict()`` is this process's (or worker's) position: versioned,
    fingerprinted (sources, capacity, window, algorithm, alignment, seed, dp_size, dp_rank,
    num_workers, ...), plain data, bounded by the window. ``load_state_dict`` validates it and
    the next ``__iter__`` continues exactly; a fresh ``__iter__`` without a loaded state starts a
    new pass. Loading a state invalidates any live iterator of this dataset (it raises
    ``RuntimeError`` on its next step) so two iterators never share one position. With
    StatefulDataLoader, check the worker count with :func:`streampack.state.load_loader_state`.
    """

    def __init__(self, urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | Mapping[str, Any], *,
                 capacity: int, window: int = 1024, algorithm: str = "bfd",
                 packs_per_batch: int = 1, tokenizer: Any = None, text_key: str = "text",
                 tokens_key: str = "input_ids", overlong: str = "split", cp_size: int = 1,
                 tp_size: int = 1, seed: int = 0, shuffle: bool = True, epochs: int | None = None,
                 dp_rank: int | None = None, dp_size: int | None = None, on_error: str = "raise",
                 pad_id: int = 0, ignore_index: int = -100, bos_id: int | None = None,
                 eos_id: int | None = None, stages: Sequence[Any] = (), num_threads: int = 1,
                 tokenize_block: int = 64, max_wait: int = 8, slack: int | None = None,
                 batches_per_epoch: int | None = None, labels_key: str | None = None,
                 loss_mask_key: str | None = None, sequence_parallel: bool = True,
                 align_multiple: int = 1, allow_pipe: bool = False, allow_pickle: bool = False,
                 cache_dir: str | None = None, retries: int = 3, pin_memory: bool = False) -> None:
        super().__init__()
        self.align = alignment(cp_size, tp_size, sequence_parallel=sequence_parallel, multiple=align_multiple)
        _validate(capacity=capacity, align=self.align, window=window, algorithm=algorithm,
                  packs_per_batch=packs_per_batch, overlong=overlong, on_error=on_error,
                  epochs=epochs, max_wait=max_wait, batches_per_epoch=batches_per_epoch,
                  tokenizer=tokenizer, stages=stages, cp_size=cp_size, tp_size=tp_size)
        # {name: urls | (urls, weight)}: a weighted mixture, one ShardReader per source
        self.mixture: dict[str, list[str]] | None = None
        # Output of `streampack pack` (a directory with manifest.json): read packs as they are.
        self.prepacked = None
        if isinstance(urls, Mapping):
            self.mixture, self.mixture_weights = _mixture(urls, epochs=epochs, allow_pipe=allow_pipe)
            self.urls = [u for source in self.mixture.values() for u in source]
        else:
            if is_packed_dataset(urls):
                manifest = packed_manifest(urls)
                check_layout(manifest, capacity, self.align)  # refuse now, not inside a worker
                self.prepacked = manifest.digest
            self.urls = ([os.fspath(u) for u in urls] if not isinstance(urls, (str, os.PathLike))
                         else [os.fspath(urls)]) if self.prepacked else expand_urls(urls, allow_pipe=allow_pipe)
        # compile the packing kernel here, once, so forked DataLoader workers inherit it
        packing.pack([1], capacity, algorithm=algorithm)
        self.dp_rank, self.dp_size = resolve_topology(dp_rank, dp_size)
        if epochs is not None and self.dp_size > 1 and batches_per_epoch is None:
            raise ValueError(f"finite mode (epochs={epochs}) with dp_size={self.dp_size} needs "
                             f"batches_per_epoch, or ranks may yield different batch counts and hang")
        self.capacity, self.window, self.algorithm = capacity, window, algorithm
        self.packs_per_batch, self.tokenizer, self.overlong = packs_per_batch, tokenizer, overlong
        self.tokenizer_id = _tokenizer_id(tokenizer)  # hashed once: state_dict() runs every batch
        self.sources_id = _urls_id(self.urls)
        if self.mixture is not None:  # hashed once here: state_dict() runs every batch
            self.mixture_sources = {n: _urls_id(u) for n, u in self.mixture.items()}
            self.sources_id = _urls_id(f"{n}={h}" for n, h in self.mixture_sources.items())
        self.text_key, self.tokens_key = text_key, tokens_key
        self.labels_key, self.loss_mask_key = labels_key, loss_mask_key
        self.seed, self.shuffle, self.epochs, self.on_error = seed, shuffle, epochs, on_error
        self.pad_id, self.ignore_index, self.bos_id, self.eos_id = pad_id, ignore_index, bos_id, eos_id
        self.stages, self.num_threads, self.tokenize_block = list(stages), num_threads, tokenize_block
        self.max_wait, self.slack, self.batches_per_epoch = max_wait, slack, batches_per_epoch
        self.reader_opts = dict(allow_pipe=allow_pipe, allow_pickle=allow_pickle,
                                cache_dir=cache_dir, retries=retries)
        self.pin_memory = pin_memory
        self._root: BaseNode | None = None
        self._nodes: dict[str, Any] = {}
        self._pending: dict[str, Any] | None = None
        self._pass = 0
        self._next_pass = 0
        self._generation = 0

    # ----------------------------------------------------------------- public API
    def set_epoch(self, epoch: int) -> None:
        """Finite mode: the pass the next fresh ``__iter__`` runs (its shard order)."""
        if epoch < 0:
            raise ValueError(f"{epoch=} must be >= 0")
        self._next_pass = epoch

    def fingerprint(self, num_workers: int | None = None) -> dict[str, Any]:
        """Every setting that changes the stream (compared on load)."""
        if num_workers is None:
            num_workers = _worker()[1]
        mixture = {} if self.mixture is None else {
            "mixture_sources": self.mixture_sources, "mixture_weights": self.mixture_weights}
        return {
            **mixture,
            "sources": self.sources_id,
            "num_sources": len(self.urls), "capacity": self.capacity, "window": self.window,
            "algorithm": self.algorithm, "align": self.align, "seed": self.seed,
            "shuffle": self.shuffle, "epochs": self.epochs, "dp_size": self.dp_size,
            "dp_rank": self.dp_rank, "num_workers": num_workers,
            "packs_per_batch": self.packs_per_batch, "overlong": self.overlong,
            "max_wait": self.max_wait, "slack": self.slack,
            "batches_per_epoch": self.batches_per_epoch, "tokenizer": self.tokenizer_id,
            "pad_id": self.pad_id, "ignore_index": self.ignore_index,
            "bos_id": self.bos_id, "eos_id": self.eos_id, "num_stages": len(self.stages),
            "prepacked": self.prepacked,
        }

    def state_dict(self) -> dict[str, Any]:
        if self._pending is not None:
            return self._pending  # saved right after a load: the loaded position
        worker_id, num_workers = _worker()
        return {
            VERSION_KEY: STATE_VERSION,
            FINGERPRINT_KEY: self.fingerprint(num_workers),
            WORKER_KEY: {"dp_rank": self.dp_rank, "worker_id": worker_id},
            PASSES_KEY: self._pass if self._root is not None else self._next_pass,
            GRAPH_KEY: self._root.state_dict() if self._root is not None else None,
            METRICS_KEY: self.metrics(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_version(state)
        saved = state[FINGERPRINT_KEY]
        mine = self.fingerprint(saved.get("num_workers"))  # worker count is checked in __iter__
        check_fingerprint(saved, mine)
        self._pending = state
        self._generation += 1  # a live iterator must not continue from a replaced position

    def metrics(self) -> dict[str, Any]:
        """Counters of this process's graph (with DataLoader workers, read them from the loader
        state: ``[s["metrics"] for s in streampack.state.dataset_states(loader.state_dict())]``)."""
        n = self._nodes
        if not n:
            return {}
        packer = n["packer"].metrics if "packer" in n else {}
        mixture = {"mixture": n["mixture"].metrics} if "mixture" in n else {}
        return {
            **mixture,
            "packing": {**packer, "fill": fill(packer)} if packer else {},
            "overlong": n["overlong"].counters.as_dict() if "overlong" in n else {},
            "errors": n["errors"].as_dict(),
            "tokenize": dict(n["tokenize"].counters) if "tokenize" in n else {},
            "stages": [dict(s.counters) for s in n.get("stages", ()) if hasattr(s, "counters")],
            "batches": dict(n["collate"].counters),
        }

    # ----------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[PackedBatch]:
        worker_id, num_workers = _worker()
        state, self._pending = self._pending, None
        if state is not None:
            check_fingerprint(state[FINGERPRINT_KEY], self.fingerprint(num_workers))
            saved = state[WORKER_KEY]
            if saved["worker_id"] != worker_id or saved["dp_rank"] != self.dp_rank:
                raise ValueError(f"state of dp_rank={saved['dp_rank']} worker_id={saved['worker_id']} "
                                 f"loaded into dp_rank={self.dp_rank} worker_id={worker_id}")
            self._pass = state[PASSES_KEY]
        else:
            self._pass = self._next_pass
        self._next_pass = self._pass + 1
        self._root = self._build(worker_id, max(num_workers, 1))
        if state is not None and state[GRAPH_KEY] is not None:
            self._root.reset(state[GRAPH_KEY])
            # A restored graph has read exactly as far as the saved one (each node replays up to
            # its saved read position), so the saved error counts are the counts now; errors met
            # while replaying are already in them. (Only the reader records errors.)
            saved_errors = (state.get(METRICS_KEY) or {}).get("errors")
            if saved_errors is not None:
                self._nodes["errors"].load(saved_errors)
        else:
            self._start_pass()
        self._generation += 1
        return self._run(self._generation, self._root, pin=self.pin_memory and num_workers == 0)

    def _run(self, generation: int, root: BaseNode, pin: bool) -> Iterator[PackedBatch]:
        pin = pin and torch.cuda.is_available()
        while True:
            if generation != self._generation:
                raise RuntimeError("this PackedDataset iterator was superseded by load_state_dict() "
                                   "or a newer iter(); create a new iterator")
            try:
                batch = next(root)
            except StopIteration:
                return
            yield batch.pin_memory() if pin else batch

    def _start_pass(self) -> None:
        assert self._root is not None
        self._root.reset(None)
        if self.epochs is not None and self._pass:
            reader = self._nodes["reader"]  # start at epoch pass*epochs: a fresh shard order
            reader.reset({**reader.state_dict(), "epoch": self._pass * self.epochs})

    def _build(self, worker_id: int, num_workers: int) -> BaseNode[PackedBatch]:
        errors = ErrorCounter()
        epochs = None if self.epochs is None else (self._pass + 1) * self.epochs
        quota = None
        if self.epochs is not None and self.batches_per_epoch is not None:
            if self.batches_per_epoch % num_workers:
                raise ValueError(f"batches_per_epoch={self.batches_per_epoch} must be a multiple "
                                 f"of num_workers={num_workers}")
            quota = self.batches_per_epoch // num_workers * self.epochs
        if self.prepacked:
            return self._build_prepacked(worker_id, num_workers, epochs, quota, errors)
        readers = {name: ShardReader(
            urls, seed=self.seed, shuffle=self.shuffle, epochs=epochs, dp_rank=self.dp_rank,
            dp_size=self.dp_size, worker_id=worker_id, num_workers=num_workers,
            tokens_key=self.tokens_key, text_key=self.text_key, labels_key=self.labels_key,
            loss_mask_key=self.loss_mask_key, on_error=self.on_error, errors=errors,
            **self.reader_opts) for name, urls in (self.mixture or {"": self.urls}).items()}
        reader = next(iter(readers.values()))  # all share the worker's topology
        nodes: dict[str, Any] = {"reader": reader, "errors": errors}
        node: BaseNode = reader
        if self.mixture is not None:
            node = nodes["mixture"] = MixtureNode(readers, self.mixture_weights, seed=self.seed,
                                                  worker=reader.global_worker)
        if self.tokenizer is not None:
            node = nodes["tokenize"] = Tokenize(node, self.tokenizer, bos_id=self.bos_id,
                                                eos_id=self.eos_id, block_size=self.tokenize_block,
                                                num_threads=self.num_threads)
        node, nodes["stages"] = build_stages(node, self.stages)
        node = nodes["overlong"] = OverlongNode(node, self.capacity, self.overlong)
        node = nodes["packer"] = WindowPacker(
            node, capacity=self.capacity, window=self.window, algorithm=self.algorithm,
            align=self.align, seed=self.seed * 1_000_003 + reader.global_worker,
            max_wait=self.max_wait, slack=self.slack, shuffle=self.shuffle)
        node = nodes["collate"] = ThdCollate(
            node, capacity=self.capacity, packs_per_batch=self.packs_per_batch, align=self.align,
            pad_id=self.pad_id, ignore_index=self.ignore_index, num_batches=quota)
        self._nodes = nodes
        return node

    def _build_prepacked(self, worker_id: int, num_workers: int, epochs: int | None,
                         quota: int | None, errors: ErrorCounter) -> BaseNode[PackedBatch]:
        """Packs written by ``streampack pack``: no tokenizing or packing, just collate."""
        reader = PackedShardReader(
            self.urls, capacity=self.capacity, align=self.align, seed=self.seed,
            shuffle=self.shuffle, epochs=epochs, dp_rank=self.dp_rank, dp_size=self.dp_size,
            worker_id=worker_id, num_workers=num_workers)
        node = ThdCollate(reader, capacity=self.capacity, packs_per_batch=self.packs_per_batch,
                          align=self.align, pad_id=self.pad_id, ignore_index=self.ignore_index,
                          num_batches=quota)
        self._nodes = {"reader": reader, "errors": errors, "collate": node}
        return node

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers get a copy without the live graph (it is rebuilt in __iter__)
        state = self.__dict__.copy()
        state["_root"], state["_nodes"] = None, {}
        return state


def _urls_id(urls: Any) -> str:
    return hashlib.sha1("\n".join(urls).encode()).hexdigest()[:16]


def _mixture(spec: Mapping[str, Any], *, epochs: int | None,
             allow_pipe: bool) -> tuple[dict[str, list[str]], dict[str, float]]:
    """``{name: urls | (urls, weight)}`` -> (expanded urls per source, weights), sorted by name.

    A value is ``(urls, weight)`` when it is a 2-tuple whose second item is a number; anything
    else is the source's urls (any form ``urls`` accepts) with weight 1.
    """
    if epochs is not None:
        raise ValueError(f"a mixture needs epochs=None (infinite), got {epochs=}: sources run dry "
                         f"at different times, so where a finite mixture ends (first source? "
                         f"last? renormalize?) is ambiguous; set the steps in your training loop")
    sources, weights = {}, {}
    for name, value in spec.items():
        weighted = isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], Real)
        source, weights[name] = value if weighted else (value, 1.0)
        if is_packed_dataset(source):
            raise ValueError(f"mixture source {name!r} is a `streampack pack` directory; mixtures "
                             f"read raw shards only")
        sources[name] = source
    weights = check_weights(sources, weights)
    return {n: expand_urls(sources[n], allow_pipe=allow_pipe) for n in weights}, weights


def _tokenizer_id(tokenizer: Any) -> str | None:
    """What identifies a tokenizer in the fingerprint: a changed vocabulary changes every id."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, (str, os.PathLike)):
        with open(tokenizer, "rb") as f:
            return "sha1:" + hashlib.sha1(f.read()).hexdigest()[:16]
    if hasattr(tokenizer, "to_str"):  # tokenizers.Tokenizer: its full serialized definition
        return "sha1:" + hashlib.sha1(tokenizer.to_str().encode()).hexdigest()[:16]
    name = getattr(tokenizer, "__qualname__", type(tokenizer).__qualname__)
    return f"{getattr(tokenizer, '__module__', '')}.{name}"


def _worker() -> tuple[int, int]:
    """(worker_id, num_workers) with num_workers = 0 in the main process (DataLoader terms)."""
    info = get_worker_info()
    return (0, 0) if info is None else (info.id, info.num_workers)


def _validate(*, capacity: int, align: int, window: int, algorithm: str, packs_per_batch: int,
              overlong: str, on_error: str, epochs: int | None, max_wait: int,
              batches_per_epoch: int | None, tokenizer: Any, stages: Sequence[Any],
              cp_size: int, tp_size: int) -> None:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"{capacity=} must be a positive int")
    if capacity % align:
        raise ValueError(f"{capacity=} must be a multiple of {align=} (from {cp_size=}, {tp_size=})")
    for name, value in (("window", window), ("packs_per_batch", packs_per_batch), ("max_wait", max_wait)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    packing.get_algorithm(algorithm)
    check_policy(overlong)
    if on_error not in ON_ERROR_CHOICES:
        raise ValueError(f"{on_error=} must be one of {ON_ERROR_CHOICES}")
    if epochs is not None and (not isinstance(epochs, int) or epochs < 1):
        raise ValueError(f"{epochs=} must be None (infinite) or an int >= 1")
    if batches_per_epoch is not None:
        if epochs is None:
            raise ValueError(f"{batches_per_epoch=} needs a finite stream (epochs=N)")
        if batches_per_epoch < 1:
            raise ValueError(f"{batches_per_epoch=} must be >= 1")
    if isinstance(tokenizer, (str, os.PathLike)) and not os.path.exists(tokenizer):
        raise ValueError(f"tokenizer file {os.fspath(tokenizer)!r} does not exist")
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)) and not (
            callable(tokenizer) or hasattr(tokenizer, "encode_batch")):
        raise TypeError(f"tokenizer must be a tokenizers.Tokenizer, a tokenizer.json path or a "
                        f"callable, got {type(tokenizer).__name__}")
    check_stages(stages)
