"""HF ``datasets`` streaming parquet, packed with TRL's best-fit decreasing.

``load_dataset("parquet", data_files=..., streaming=True)`` -> ``shuffle(seed=0,
buffer_size=1000)`` -> ``trl.pack_dataset(ds, capacity, strategy="bfd")`` (TRL's own code: BFD
over each ``map`` batch of 1000 rows, the ``datasets`` default) -> ``StatefulDataLoader(batch_size=8)``,
which is how the ``datasets`` docs resume an ``IterableDataset``. The 2-worker run splits the
16 parquet files between the workers (``datasets`` shards by file).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .corpus import Corpus, write_parquet
from .measure import Count
from .packers import PaddedBatch
from .streampack_peer import PACKS_PER_BATCH


class HfTrlPeer:
    name = "HF datasets + TRL"
    fmt = "parquet"
    packing = "TRL pack_dataset(strategy='bfd') per map batch of 1000 rows, whole documents"
    notes = ["shuffle buffer 1000, not in the state (without shuffle the resume is exact)",
             "rows arrive as Python lists (the datasets default format)"]

    def __init__(self, *, capacity: int) -> None:
        self.capacity = capacity
        self.files: list[str] = []

    def missing(self) -> str | None:
        try:
            import datasets  # noqa: F401
            from trl.data_utils import pack_dataset  # noqa: F401
        except ImportError as e:
            return f"{e} (install: benchmarks/requirements-peers.txt)"
        return None

    def prepare(self, corpus: Corpus) -> None:
        self.files = write_parquet(corpus)

    def _collate(self, rows: list[dict[str, list[int]]]) -> PaddedBatch:
        out = np.zeros((len(rows), self.capacity), dtype=np.int64)
        bounds = [np.zeros(1, dtype=np.int64)]
        for i, row in enumerate(rows):
            out[i, :len(row["input_ids"])] = row["input_ids"]
            bounds.append(i * self.capacity + np.cumsum(row["seq_lengths"]))
        tokens = sum(len(r["input_ids"]) for r in rows)
        return PaddedBatch(input_ids=torch.from_numpy(out), num_tokens=tokens,
                           cu_seqlens=torch.from_numpy(np.concatenate(bounds).astype(np.int32)))

    def loader(self, num_workers: int, state: Any | None = None) -> Any:
        from datasets import load_dataset
        from torchdata.stateful_dataloader import StatefulDataLoader
        from trl.data_utils import pack_dataset

        ds = load_dataset("parquet", data_files=self.files, split="train", streaming=True)
        ds = pack_dataset(ds.shuffle(seed=0, buffer_size=1000), self.capacity, strategy="bfd")
        loader = StatefulDataLoader(ds, batch_size=PACKS_PER_BATCH, collate_fn=self._collate,
                                    num_workers=num_workers, prefetch_factor=8 if num_workers else None)
        if state is not None:
            loader.load_state_dict(state)
        return loader

    def count(self, batch: PaddedBatch) -> Count:
        return Count(tokens=batch.num_tokens, slots=batch.input_ids.numel(), ids=batch.input_ids)

    def save(self, loader: Any, batches: int) -> Any:
        return loader.state_dict()
