"""Megatron-core indexed data sets written by megatron-core's own ``IndexedDatasetBuilder`` (the test extra installs
megatron-core; tests that need it skip without it)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

import numpy as np
import pytest


def builder_and_dataset() -> tuple[type, type]:
    """megatron-core's ``IndexedDatasetBuilder`` and ``IndexedDataset`` (its import warns about missing GPU extras)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    return indexed.IndexedDatasetBuilder, indexed.IndexedDataset


def write_megatron(prefix: str | os.PathLike[str], docs: Sequence[Sequence[int]], *, dtype: type = np.int32,
                   sequences: Sequence[Sequence[int]] | None = None) -> str:
    """``prefix.bin`` + ``prefix.idx`` holding ``docs`` (document ``i`` cut into sequences of ``sequences[i]``
    tokens, one sequence when None); returns the ``.idx`` path, which is how streampack names the shard."""
    import torch

    builder_cls, _ = builder_and_dataset()
    prefix = os.fspath(prefix)
    builder = builder_cls(prefix + ".bin", dtype=dtype)
    for i, doc in enumerate(docs):
        lengths = [len(doc)] if sequences is None else list(sequences[i])
        assert sum(lengths) == len(doc)
        with warnings.catch_warnings():  # numpy 2 on the builder's numpy.array(tensor)
            warnings.simplefilter("ignore", DeprecationWarning)
            builder.add_document(torch.tensor(np.asarray(doc, dtype=np.int64)), lengths)
    builder.finalize(prefix + ".idx")
    return prefix + ".idx"


def write_megatron_shards(directory: str | os.PathLike[str], docs: Sequence[Sequence[int]], num_shards: int, *,
                          dtype: type = np.int32, seed: int = 0) -> list[str]:
    """``docs`` in ``num_shards`` Megatron shards of consecutive documents, each document cut into 1-3 sequences."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    urls = []
    for s in range(num_shards):
        part = docs[s * len(docs) // num_shards:(s + 1) * len(docs) // num_shards]
        cuts = []
        for doc in part:
            inner = sorted(rng.choice(np.arange(1, len(doc)), min(len(doc) - 1, int(rng.integers(0, 3))),
                                      replace=False).tolist()) if len(doc) > 1 else []
            edges = [0, *inner, len(doc)]
            cuts.append([b - a for a, b in zip(edges, edges[1:])])
        urls.append(write_megatron(os.path.join(directory, f"shard-{s:03d}"), part, dtype=dtype, sequences=cuts))
    return urls


def megatron_documents(idx_url: str) -> list[list[int]]:
    """Every document's ids as megatron-core's ``IndexedDataset`` reads them (its sequences joined)."""
    _, dataset_cls = builder_and_dataset()
    ds = dataset_cls(idx_url[:-len(".idx")])
    bounds = ds.document_indices.tolist()
    return [[int(t) for s in range(a, b) for t in ds[s]] for a, b in zip(bounds, bounds[1:])]
