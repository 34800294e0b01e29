"""webdataset: the same tar shards, greedy (next-fit) packing as people write it.

``WebDataset(urls, shardshuffle=100, seed=0)`` (its default worker split hands each DataLoader
worker whole shards) -> ``shuffle(1000)`` -> ``decode()`` -> next-fit packing -> ``batched(8)``
under ``WebLoader``. webdataset has no resume state (its maintainer recommends resampling
instead): resuming costs a fast-forward through the batches already trained on.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from .corpus import Corpus, write_tar
from .measure import Count
from .packers import PaddedBatch, greedy_packs, pad_packs
from .streampack_peer import PACKS_PER_BATCH


class WebdatasetPeer:
    name = "webdataset"
    fmt = "tar"
    packing = "greedy next-fit, whole documents"
    notes = ["no resume state: resuming means replaying the epoch up to the checkpoint",
             "sample shuffle buffer 1000"]

    def __init__(self, *, capacity: int) -> None:
        self.capacity = capacity
        self.urls: list[str] = []

    def missing(self) -> str | None:
        try:
            import webdataset  # noqa: F401
        except ImportError as e:
            return str(e)
        return None

    def prepare(self, corpus: Corpus) -> None:
        self.urls = write_tar(corpus)

    def _packs(self, samples: Iterator[dict[str, Any]]) -> Iterator[list[np.ndarray]]:
        return greedy_packs((s["input_ids.npy"] for s in samples), self.capacity)

    def _collate(self, packs: list[list[np.ndarray]]) -> PaddedBatch:
        return pad_packs(packs, self.capacity)

    def loader(self, num_workers: int, state: Any | None = None) -> Any:
        import webdataset as wds

        if state is not None:
            raise ValueError("webdataset has no resume state")
        ds = (wds.WebDataset(self.urls, shardshuffle=100, seed=0, empty_check=False)
              .shuffle(1000, seed=0).decode().compose(self._packs)
              .batched(PACKS_PER_BATCH, collation_fn=self._collate, partial=True))
        return wds.WebLoader(ds, batch_size=None, num_workers=num_workers,
                             prefetch_factor=8 if num_workers else None)

    def count(self, batch: PaddedBatch) -> Count:
        return Count(tokens=batch.num_tokens, slots=batch.input_ids.numel(), ids=batch.input_ids)

    def save(self, loader: Any, batches: int) -> None:
        return None
