"""litdata: its optimized chunk format read with ``TokensLoader``, as litgpt pretrains.

``optimize(fn, inputs=shards, item_loader=TokensLoader(), chunk_size=...)`` writes every
document's int32 ids into token chunks; ``StreamingDataset(dir, item_loader=TokensLoader(
block_size=capacity), shuffle=True)`` then serves fixed blocks cut from the concatenated
token stream, under ``StreamingDataLoader(batch_size=8)`` with its own ``state_dict()``.
Blocks are always full (fill 100%), but documents run across block edges and no document
boundaries reach the loop (a document cut at an edge loses its context in the next block).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .corpus import Corpus, load_arrays, save_arrays
from .measure import Count
from .streampack_peer import PACKS_PER_BATCH


def _shard_tokens(item: tuple[str, int, int]) -> Iterator[torch.Tensor]:
    """One shard's documents, from the corpus arrays on disk (a plain generator function over
    picklable input: litdata runs it in its own worker processes)."""
    arrays, shard, num_shards = item
    tokens, starts = load_arrays(arrays)
    n = len(starts) - 1
    for i in range(shard * n // num_shards, (shard + 1) * n // num_shards):
        yield torch.from_numpy(np.array(tokens[starts[i]:starts[i + 1]]))


class LitdataPeer:
    name = "litdata"
    fmt = "litdata chunks"
    packing = "TokensLoader: fixed blocks cut from the concatenated token stream (no boundaries)"
    notes = ["documents cut at block edges, no cu_seqlens"]

    def __init__(self, *, capacity: int) -> None:
        self.capacity = capacity
        self.dir = ""

    def missing(self) -> str | None:
        try:
            import litdata  # noqa: F401
        except ImportError as e:
            return f"{e} (install: benchmarks/requirements-peers.txt)"
        return None

    def prepare(self, corpus: Corpus) -> None:
        from litdata import TokensLoader, optimize

        name = "litdata"
        self.dir = corpus.format_dir(name)
        if corpus.is_written(name):
            return
        shutil.rmtree(self.dir, ignore_errors=True)  # a run cut short leaves a partial index
        arrays = save_arrays(corpus)
        k = corpus.spec.num_shards
        optimize(fn=_shard_tokens, inputs=[(arrays, s, k) for s in range(k)], output_dir=self.dir,
                 chunk_size=self.capacity * 1024, item_loader=TokensLoader(), num_workers=1, verbose=False)
        with open(os.path.join(self.dir, "index.json")) as f:
            if not json.load(f)["chunks"]:
                raise RuntimeError(f"litdata.optimize wrote no chunks to {self.dir}")
        corpus.mark_written(name)

    def loader(self, num_workers: int, state: Any | None = None) -> Any:
        from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

        ds = StreamingDataset(self.dir, item_loader=TokensLoader(block_size=self.capacity), shuffle=True,
                              seed=0, cache_dir=os.path.join(self.dir, "..", "litdata-cache"))
        loader = StreamingDataLoader(ds, batch_size=PACKS_PER_BATCH, num_workers=num_workers,
                                     prefetch_factor=8 if num_workers else None)
        if state is not None:
            loader.load_state_dict(state)
        return loader

    def count(self, batch: torch.Tensor) -> Count:
        return Count(tokens=batch.numel(), slots=batch.numel(), ids=batch)

    def save(self, loader: Any, batches: int) -> Any:
        return loader.state_dict()
