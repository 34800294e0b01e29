"""Collate stage: ``packs_per_batch`` packs -> one THD :class:`~streampack.layout.batch.PackedBatch`.

Finite streams: the last batch may hold fewer packs. With ``num_batches`` set (a per-worker
quota, used by ``PackedDataset(batches_per_epoch=...)`` so every rank yields the same count),
a worker that runs out of data emits *filler* batches until it reaches the quota: one pack
holding a single document of ``capacity`` pad tokens with every label ignored, so it adds
zero targets to a token-mean loss. Fillers have ``doc_keys == ("<filler>",)`` and are counted
in ``counters["fillers"]``. A worker with more data than its quota refuses (ValueError) rather
than silently dropping the rest.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from streampack.layout.batch import PackedBatch, pack_batch
from streampack.sample import Sample

FILLER_KEY = "<filler>"


def is_filler(batch: PackedBatch) -> bool:
    return batch.doc_keys == (FILLER_KEY,)


class ThdCollate(BaseNode[PackedBatch]):
    """Groups packs from a :class:`~streampack.nodes.window_packer.WindowPacker`."""

    SOURCE_KEY = "source"
    YIELDED_KEY = "yielded"
    COUNTERS_KEY = "counters"

    def __init__(self, source: BaseNode[list[Sample]], *, capacity: int, packs_per_batch: int = 1,
                 align: int = 1, pad_id: int = 0, ignore_index: int = -100,
                 num_batches: int | None = None) -> None:
        super().__init__()
        if packs_per_batch < 1:
            raise ValueError(f"{packs_per_batch=} must be >= 1")
        if num_batches is not None and num_batches < 0:
            raise ValueError(f"{num_batches=} must be >= 0")
        self.source = source
        self.capacity, self.packs_per_batch, self.align = capacity, packs_per_batch, align
        self.pad_id, self.ignore_index = pad_id, ignore_index
        self.num_batches = num_batches
        self._yielded = 0
        self.counters = {"batches": 0, "fillers": 0}

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self.source.reset(None)
            self._yielded = 0
            self.counters = {"batches": 0, "fillers": 0}
        else:
            self.source.reset(initial_state[self.SOURCE_KEY])
            self._yielded = initial_state[self.YIELDED_KEY]
            self.counters = dict(initial_state[self.COUNTERS_KEY])

    def next(self) -> PackedBatch:
        if self.num_batches is not None and self._yielded >= self.num_batches:
            self._refuse_surplus()
            raise StopIteration
        packs: list[list[Sample]] = []
        for _ in range(self.packs_per_batch):
            try:
                packs.append(next(self.source))
            except StopIteration:
                break
        if packs:
            batch = pack_batch(packs, capacity=self.capacity, align=self.align,
                               pad_id=self.pad_id, ignore_index=self.ignore_index)
        elif self.num_batches is not None:
            batch = self._filler()
            self.counters["fillers"] += 1
        else:
            raise StopIteration
        self._yielded += 1
        self.counters["batches"] += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict(), self.YIELDED_KEY: self._yielded,
                self.COUNTERS_KEY: dict(self.counters)}

    def _refuse_surplus(self) -> None:
        try:
            next(self.source)
        except StopIteration:
            return
        raise ValueError(f"this worker has more than num_batches={self.num_batches} batches of "
                         f"data in this epoch; raise batches_per_epoch (data would be lost)")

    def _filler(self) -> PackedBatch:
        doc = Sample(key=FILLER_KEY, tokens=np.full(self.capacity, self.pad_id, dtype=np.int64),
                     loss_mask=np.zeros(self.capacity, dtype=bool))
        return pack_batch([[doc]], capacity=self.capacity, align=self.align,
                          pad_id=self.pad_id, ignore_index=self.ignore_index)
