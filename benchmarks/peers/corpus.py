"""The one pre-tokenized corpus every loader reads, and the formats written from it.

Documents are drawn once from a seeded generator: lengths lognormal with median
``mean / e**0.5`` and sigma 1 (so the mean is ``mean``), clipped to ``[min_len, capacity]``
so every loader sees the same documents and none has to truncate or split; token ids
uniform in ``[0, vocab)`` as int32. Every format below is written from these same arrays,
in the same order, split contiguously over ``num_shards`` shards.

Formats with no peer library behind them live here (webdataset tar, which streampack and
webdataset both read, and parquet for HF ``datasets`` and for streampack once it reads
parquet); the MDS and litdata writers live with their peers because they need the peer
packages. Each writer leaves a ``DONE`` marker so a rerun with the same corpus reuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True, slots=True, kw_only=True)
class CorpusSpec:
    """What is drawn; its digest names the directory its formats are written to."""

    tokens: int
    """Total tokens to draw (documents are drawn until the total reaches this)."""
    capacity: int = 4096
    """Pack capacity; also the longest document."""
    mean: float = 600.0
    """Mean document length before clipping."""
    min_len: int = 16
    """Shortest document."""
    vocab: int = 50_000
    """Token ids are uniform in ``[0, vocab)``."""
    num_shards: int = 16
    """Shards per format (enough for 2 workers to split by whole shards, as webdataset does)."""
    seed: int = 0

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


class Corpus:
    """The documents of a :class:`CorpusSpec` and the directory its formats go to."""

    def __init__(self, spec: CorpusSpec, root: str) -> None:
        if spec.tokens < spec.capacity:
            raise ValueError(f"{spec.tokens=} must be at least {spec.capacity=}")
        self.spec = spec
        self.dir = os.path.join(root, f"corpus-{spec.digest()}")
        os.makedirs(self.dir, exist_ok=True)

    @cached_property
    def lengths(self) -> np.ndarray:
        s = self.spec
        rng = np.random.default_rng([s.seed, 1])
        out: list[np.ndarray] = []
        total = 0
        while total < s.tokens:  # draw in blocks until the token budget is reached
            block = rng.lognormal(np.log(s.mean) - 0.5, 1.0, 65_536).round().astype(np.int64)
            block = np.clip(block, s.min_len, s.capacity)
            out.append(block)
            total += int(block.sum())
        lengths = np.concatenate(out)
        return lengths[: int(np.searchsorted(np.cumsum(lengths), s.tokens)) + 1]

    @cached_property
    def tokens(self) -> np.ndarray:
        """All documents back to back (int32)."""
        rng = np.random.default_rng([self.spec.seed, 2])
        return rng.integers(0, self.spec.vocab, int(self.lengths.sum()), dtype=np.int32)

    @property
    def num_docs(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def shard_docs(self, shard: int) -> range:
        n, k = self.num_docs, self.spec.num_shards
        return range(shard * n // k, (shard + 1) * n // k)

    def docs(self, shard: int) -> Iterator[tuple[int, np.ndarray]]:
        """``(document index, int32 tokens)`` of one shard, in order."""
        starts = np.concatenate([[0], np.cumsum(self.lengths)])
        for i in self.shard_docs(shard):
            yield i, self.tokens[starts[i]:starts[i + 1]]

    def format_dir(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def is_written(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.format_dir(name), "DONE"))

    def mark_written(self, name: str) -> None:
        with open(os.path.join(self.format_dir(name), "DONE"), "w") as f:
            f.write(json.dumps(asdict(self.spec)))

    def describe(self) -> str:
        s = self.spec
        return (f"{self.num_docs:,} documents, {self.num_tokens:,} tokens (lognormal lengths, mean "
                f"{s.mean:g} before clipping to [{s.min_len}, {s.capacity}], measured mean "
                f"{self.lengths.mean():.0f}, max {self.lengths.max()}), int32 ids < {s.vocab}, "
                f"{s.num_shards} shards per format, seed {s.seed}")


def write_tar(corpus: Corpus) -> list[str]:
    """webdataset tar shards (``{key}.input_ids.npy``) via webdataset's own ``TarWriter``."""
    import webdataset as wds

    name = "tar"
    out = corpus.format_dir(name)
    urls = [os.path.join(out, f"shard-{s:05d}.tar") for s in range(corpus.spec.num_shards)]
    if corpus.is_written(name):
        return urls
    os.makedirs(out, exist_ok=True)
    for s, url in enumerate(urls):
        with wds.TarWriter(url) as sink:
            for i, doc in corpus.docs(s):
                sink.write({"__key__": f"{i:09d}", "input_ids.npy": doc})
    corpus.mark_written(name)
    return urls


def _write_shards(corpus: Corpus, name: str, suffix: str,
                  write: Callable[[str, np.ndarray, np.ndarray], None]) -> list[str]:
    """``write(url, ids, offsets)`` for each shard (its documents' ids back to back and where each starts, then the
    end), unless the format was written before; the shards' urls."""
    out = corpus.format_dir(name)
    urls = [os.path.join(out, f"shard-{s:05d}{suffix}") for s in range(corpus.spec.num_shards)]
    if corpus.is_written(name):
        return urls
    os.makedirs(out, exist_ok=True)
    starts = np.concatenate([[0], np.cumsum(corpus.lengths)])
    for s, url in enumerate(urls):
        docs = corpus.shard_docs(s)
        lo, hi = int(starts[docs.start]), int(starts[docs.stop])
        write(url, corpus.tokens[lo:hi], starts[docs.start:docs.stop + 1] - lo)
    corpus.mark_written(name)
    return urls


def write_parquet(corpus: Corpus, *, row_group_size: int = 1024) -> list[str]:
    """Parquet shards with one ``input_ids: list<int32>`` column (how HF stores token datasets)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def write(url: str, ids: np.ndarray, offsets: np.ndarray) -> None:
        column = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(ids))
        pq.write_table(pa.table({"input_ids": column}), url, row_group_size=row_group_size)

    return _write_shards(corpus, "parquet", ".parquet", write)


def write_token_arrays(corpus: Corpus) -> list[str]:
    """Flat token arrays as OLMo and Dolma keep them: per shard one ``.npy`` of every document's ids back to back
    (``np.save``, int32) and a ``.offsets.npy`` of where each document starts, then the end."""
    def write(url: str, ids: np.ndarray, offsets: np.ndarray) -> None:
        np.save(url, ids)
        np.save(url[: -len(".npy")] + ".offsets.npy", offsets)

    return _write_shards(corpus, "token-arrays", ".npy", write)


def save_arrays(corpus: Corpus) -> str:
    """``tokens.npy`` and ``starts.npy`` (document offsets) for writers that run in other
    processes and must not redraw the corpus; returns their directory."""
    out = corpus.format_dir("arrays")
    if not corpus.is_written("arrays"):
        os.makedirs(out, exist_ok=True)
        np.save(os.path.join(out, "tokens.npy"), corpus.tokens)
        np.save(os.path.join(out, "starts.npy"), np.concatenate([[0], np.cumsum(corpus.lengths)]))
        corpus.mark_written("arrays")
    return out


def load_arrays(directory: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, document start offsets with a final end offset), memory-mapped."""
    return (np.load(os.path.join(directory, "tokens.npy"), mmap_mode="r"),
            np.load(os.path.join(directory, "starts.npy")))
