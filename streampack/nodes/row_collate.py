"""RowCollate: the collate of the contiguous fast path, packs of rows -> one PackedBatch.

A :class:`~streampack.nodes.collate.ThdCollate` (same quota, fillers, counters, stats and state)
whose packs are :class:`~streampack.plan.rows.PackRows`: a batch of plain documents is laid out
by :func:`~streampack.layout.slices.pack_slices` straight from the buffers the documents were
read into (one copy of each document's ids); a batch with a filler pack, or with a document
that came from the per-sample reader carrying labels or a loss mask, is laid out by
``pack_batch`` from the same documents as Samples. Both give the per-sample path's batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from streampack.layout.batch import PackedBatch, pack_batch
from streampack.layout.slices import pack_slices
from streampack.nodes.collate import ThdCollate, filler_pack
from streampack.plan.rows import PackRows


class RowCollate(ThdCollate):
    """Groups the :class:`PackRows` of a :class:`~streampack.nodes.row_packer.RowPacker`."""

    def _layout(self, real: list[Any], missing: int) -> PackedBatch:
        packs: list[PackRows] = real
        if missing or any(p.rich for p in packs):
            samples = [p.samples() for p in packs] + [filler_pack(self.capacity, self.pad_id)] * missing
            return pack_batch(samples, capacity=self.capacity, align=self.align, pad_id=self.pad_id,
                              ignore_index=self.ignore_index)
        sources: list[np.ndarray] = []
        starts: list[int] = []
        lengths: list[int] = []
        keys: list[str] = []
        for p in packs:
            sources += p.sources
            starts += p.starts
            lengths += p.lengths
            keys += p.keys
        return pack_slices(sources, starts, lengths, [len(p) for p in packs], tuple(keys), capacity=self.capacity,
                           align=self.align, pad_id=self.pad_id, ignore_index=self.ignore_index,
                           ids_nonnegative=True)  # both readers check every id

    def _lengths(self, real: list[Any]) -> list[np.ndarray]:
        return [p.rows["length"] for p in real]


__all__ = ["RowCollate"]
