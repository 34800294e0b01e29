"""Shared test helpers: an in-memory Sample source node and one save/load check for any node.

``check_save_load(make_node)`` checks, for a node built by ``make_node()`` over a finite,
deterministic source: restore at mid-epoch (several offsets), restore from the initial state,
restore at the end of an epoch (yields nothing), a second epoch after ``reset()``, and a save
taken right after a restore that restores again.
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode

from streampack.layout.batch import PackedBatch
from streampack.plan.rows import PackRows
from streampack.sample import Sample


class ListSource(BaseNode[Sample]):
    """Yields a fixed list of samples; state = index of the next one."""

    INDEX_KEY = "index"

    def __init__(self, samples: list[Sample]) -> None:
        super().__init__()
        self.samples = samples
        self._i = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._i = 0 if initial_state is None else initial_state[self.INDEX_KEY]

    def next(self) -> Sample:
        if self._i >= len(self.samples):
            raise StopIteration
        self._i += 1
        return self.samples[self._i - 1]

    def get_state(self) -> dict[str, Any]:
        return {self.INDEX_KEY: self._i}


def lognormal_lengths(n: int, *, mean: float = 600.0, sigma: float = 1.0, seed: int = 0,
                      max_len: int | None = None) -> np.ndarray:
    """Long-tail lengths (lognormal with the given mean), at least 1."""
    rng = np.random.default_rng(seed)
    mu = np.log(mean) - sigma**2 / 2
    lengths = np.maximum(1, rng.lognormal(mu, sigma, n).round().astype(np.int64))
    return lengths if max_len is None else np.minimum(lengths, max_len)


def make_samples(lengths: Any, *, vocab: int = 50_000, seed: int = 0, text: bool = False) -> list[Sample]:
    """Samples with random token ids (or words, when ``text``) of the given lengths."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(np.asarray(lengths).tolist()):
        ids = rng.integers(0, vocab, n, dtype=np.int64)
        if text:
            out.append(Sample(key=f"s{i:06d}", url="mem", text=" ".join(f"w{t % 97}" for t in ids)))
        else:
            out.append(Sample(key=f"s{i:06d}", url="mem", tokens=ids))
    return out


def roundtrip(state: Any) -> Any:
    """``torch.save`` + ``torch.load(weights_only=True)``: what a checkpoint does to a state."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def take(it: Any, n: int) -> list[Any]:
    """The next ``n`` items of ``it``, or fewer when it ends first."""
    return list(itertools.islice(it, n))


def canon(item: Any) -> Any:
    """A comparable form of a Sample, a pack (list of samples), a PackedBatch or a tensor."""
    if isinstance(item, Sample):
        return (item.doc_key, None if item.tokens is None else item.tokens.tobytes(), item.text)
    if isinstance(item, PackedBatch):
        return (item.doc_keys, item.input_ids.numpy().tobytes(), item.labels.numpy().tobytes(),
                item.cu_seqlens_padded.numpy().tobytes(), item.num_targets)
    if isinstance(item, torch.Tensor):
        return item.numpy().tobytes()
    if isinstance(item, (list, tuple, PackRows)):  # a pack: its Samples
        return tuple(canon(x) for x in item)
    return item


def drain(node: BaseNode, limit: int | None = None) -> list[Any]:
    out = []
    for item in node:
        out.append(canon(item))
        if limit is not None and len(out) >= limit:
            break
    return out


def check_save_load(make_node: Callable[[], BaseNode], *, offsets: list[int] | None = None) -> int:
    """Run every save/load scenario; return the epoch length (so callers can assert > 0)."""
    full = drain(make_node())
    assert full, "the node yielded nothing: the checks would pass vacuously"
    n = len(full)
    for k in offsets if offsets is not None else sorted({0, 1, n // 3, n // 2, n - 1, n}):
        node = make_node()
        head = drain(node, k) if k else []
        state = node.state_dict()
        restored = make_node()
        restored.reset(state)
        again = restored.state_dict()  # saved right after a restore: must restore the same
        tail = drain(restored)
        assert head + tail == full, f"mid-epoch restore at item {k} of {n} diverged"
        second = make_node()
        second.reset(again)
        assert drain(second) == tail, f"restore of a state saved right after a restore (item {k})"
    initial = make_node().state_dict()
    node = make_node()
    node.reset(initial)
    assert drain(node) == full, "restore from the initial state diverged"
    node = make_node()
    drain(node)
    end = node.state_dict()
    node.reset(None)
    assert drain(node) == full, "the next epoch after reset() differs"
    restored = make_node()
    restored.reset(end)
    assert drain(restored) == [], "restore at the end of the epoch yielded items"
    return n


def write_token_shards(directory: Any, n_docs: int, num_shards: int, *, mean: float = 100.0,
                       seed: int = 0, max_len: int | None = None) -> tuple[list[str], list[list[int]]]:
    """``n_docs`` long-tail token documents in ``num_shards`` npy tar shards: (urls, docs)."""
    from helpers_data import write_tar_shards

    rng = np.random.default_rng(seed)
    lengths = lognormal_lengths(n_docs, mean=mean, seed=seed, max_len=max_len)
    docs = [rng.integers(0, 30_000, n).tolist() for n in lengths.tolist()]
    return write_tar_shards(directory, docs, num_shards), docs


def collect_documents(batches: Any) -> dict[str, list[int]]:
    """Reassemble documents (split chunks ``key/i`` joined in chunk order) from PackedBatches,
    keyed by tar sample key; asserts no chunk appears twice."""
    chunks: dict[str, dict[int, list[int]]] = {}
    for b in batches:
        cu = b.cu_seqlens.tolist()
        starts = b.cu_seqlens_padded.tolist()
        for i, key in enumerate(b.doc_keys):
            if key == "<filler>":
                continue
            n = cu[i + 1] - cu[i]
            tokens = b.input_ids[starts[i]:starts[i] + n].tolist()
            sample = key.rsplit("#", 1)[-1]
            base, _, part = sample.partition("/")
            parts = chunks.setdefault(base, {})
            idx = int(part) if part else 0
            assert idx not in parts, f"chunk {key} seen twice"
            parts[idx] = tokens
    return {k: [t for i in sorted(v) for t in v[i]] for k, v in chunks.items()}


def read_as(monkeypatch: Any, blocks: bool) -> None:
    """The graphs built from now on read pre-tokenized shards as token blocks where they can
    (``BlockReader``), or every sample alone (a ``ShardReader``, which hands out no runs): the
    two ways one reader reads, which must give the same stream."""
    import streampack.graph.build as graph_build
    from streampack.nodes.block_reader import BlockReader
    from streampack.nodes.reader import ShardReader

    monkeypatch.setattr(graph_build, "BlockReader", BlockReader if blocks else ShardReader)


def documents_by_key(batches: Any) -> dict[str, list[int]]:
    """What ``batches`` delivered, by ``url#sample`` (a split document's chunks joined in order; fillers left out);
    a chunk delivered twice fails."""
    chunks: dict[str, dict[int, list[int]]] = {}
    for b in batches:
        cu, starts = b.cu_seqlens.tolist(), b.cu_seqlens_padded.tolist()
        for i, key in enumerate(b.doc_keys):
            if key == "<filler>":
                continue
            url, _, sample = key.rpartition("#")
            base, _, part = sample.partition("/")
            parts = chunks.setdefault(f"{url}#{base}", {})
            assert int(part or 0) not in parts, f"chunk {key} twice"
            parts[int(part or 0)] = b.input_ids[starts[i]:starts[i] + cu[i + 1] - cu[i]].tolist()
    return {k: [t for i in sorted(v) for t in v[i]] for k, v in chunks.items()}


def planned_dataset(source: Any, read: Any, rank: int, size: int, *, capacity: int, **kw: Any) -> Any:
    """One rank's ``PackedDataset`` of a finite epoch of ``source``, planned from ``read.manifest`` over ``size``
    ranks with equal batch counts (the format plan tests' common stream)."""
    from streampack.dataset import PackedDataset
    from streampack.options import PackOptions, TopologyOptions

    return PackedDataset(source, **{"capacity": capacity, "epochs": 1, "seed": 2, "packs_per_batch": 2,
                                    "packing": PackOptions(window=16, max_wait=3), "read": read,
                                    "topology": TopologyOptions(dp_rank=rank, dp_size=size, equal_batches="count"),
                                    **kw})


def check_ranks_deliver_every_document_once(make: Callable[[int], Any], expected: dict[str, list[int]],
                                            monkeypatch: Any, ranks: int = 3) -> None:
    """``make(rank)`` over ``ranks`` ranks, reading blocks and then per sample: equal batch counts, every document of
    ``expected`` (by ``url#sample``) exactly once, no planned range read per sample when blocks are on, and the same
    batches both ways."""
    both = []
    for blocks in (True, False):
        read_as(monkeypatch, blocks)
        runs = []
        for r in range(ranks):
            ds = make(r)
            it = iter(ds)
            first = next(it)
            overlong, reader = ds._graph.nodes["overlong"], ds._graph.nodes["reader"]
            runs.append([first, *it])
            assert overlong.reads_blocks == blocks
            assert not blocks or reader.sample_reads == 0, "a planned range was read per sample"
        assert len({len(r) for r in runs}) == 1 and len(runs[0]) > 3, [len(r) for r in runs]
        assert documents_by_key(b for r in runs for b in r) == expected
        both.append([[canon(b) for b in r] for r in runs])
    assert both[0] == both[1], "blocks and per-sample reads gave other batches"


def check_exact_resume(make: Callable[[], Any]) -> None:
    """A fresh ``make()`` stopped after its first batch, half of them and all but one, its state loaded into another
    fresh one: the first's batches and then the second's are the uninterrupted epoch's."""
    whole = [canon(b) for b in make()]
    assert len(whole) > 6
    for stop in (1, len(whole) // 2, len(whole) - 1):
        ds = make()
        head = [canon(b) for b in take(iter(ds), stop)]
        again = make()
        again.load_state_dict(roundtrip(ds.state_dict()))
        assert head + [canon(b) for b in again] == whole, f"resume after {stop} batches diverged"


def check_elastic_resume_every_document_once(make: Callable[[int, int], Any], expected: dict[str, list[int]], *,
                                             old: tuple[int, int], new: tuple[int, int], taken: int) -> None:
    """``make(rank, ranks)`` on ``old = (ranks, workers)`` for ``taken`` batches a rank, then every old state loaded on
    ``new = (ranks, workers)``: equal batch counts on the new ranks, every document of ``expected`` exactly once."""
    from topology_sim import SimRank  # here: topology_sim imports this module

    (old_ranks, old_workers), (new_ranks, new_workers) = old, new
    ranks = [SimRank(lambda r=r: make(r, old_ranks), old_workers) for r in range(old_ranks)]
    consumed = [next(rk) for rk in ranks for _ in range(taken)]
    states = [s for rk in ranks for s in rk.states()]
    runs = [list(SimRank(lambda r=r: make(r, new_ranks), new_workers, load=states)) for r in range(new_ranks)]
    assert len({len(r) for r in runs}) == 1
    assert documents_by_key(consumed + [b for r in runs for b in r]) == expected


def worker_error(dataset: Any, error: type[BaseException], match: str) -> BaseException:
    """The error one DataLoader worker raises reading ``dataset`` whole, with no traceback. ``pytest.raises`` keeps
    the traceback, whose frames hold the loader's iterator: the test's frame and the traceback make a reference cycle,
    the collector frees the iterator later together with its queues, and torch's shutdown then waits out its 5 s join
    timeout for the worker (four such tests cost the fast loop ~25 s of waiting)."""
    import pytest
    from torchdata.stateful_dataloader import StatefulDataLoader

    with pytest.raises(error, match=match) as info:
        list(StatefulDataLoader(dataset, batch_size=None, num_workers=1))
    err = info.value
    err.__traceback__ = None
    del info  # the last reference to the traceback: the iterator and its worker go now, by reference count
    return err
