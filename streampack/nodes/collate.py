"""Collate stage: ``packs_per_batch`` packs -> one THD :class:`~streampack.layout.batch.PackedBatch`.

Every batch has the same shape, ``packs_per_batch * capacity`` tokens, so ranks stepping
together never see different shapes: the last batch of a finite stream is completed with
*filler packs*, and with ``num_batches`` set (this worker's quota for the stream, from the
epoch plan or ``batches_per_epoch``) a worker that runs out of data emits whole *filler
batches* until it reaches the quota. A filler pack holds one document of ``capacity`` pad
tokens with every label ignored, so it adds zero targets to a token-mean loss; its doc key is
``"<filler>"``. They are counted in ``counters["fillers"]`` (whole batches) and
``counters["filler_packs"]`` (packs completing a partial batch) and logged (rate-limited). A
worker with more data than its quota refuses (ValueError) rather than silently dropping it.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from streampack.layout.batch import PackedBatch, pack_batch
from streampack.logs import get_logger, warn_every
from streampack.sample import Sample

FILLER_KEY = "<filler>"
_log = get_logger(__name__)


def is_filler(batch: PackedBatch) -> bool:
    """True for a batch made only of filler packs (no data, zero targets)."""
    return bool(batch.doc_keys) and all(k == FILLER_KEY for k in batch.doc_keys)


def filler_pack(capacity: int, pad_id: int) -> list[Sample]:
    """One pack of ``capacity`` pad tokens that supervises nothing."""
    return [Sample(key=FILLER_KEY, tokens=np.full(capacity, pad_id, dtype=np.int64),
                   loss_mask=np.zeros(capacity, dtype=bool))]


class ThdCollate(BaseNode[PackedBatch]):
    """Groups packs from a :class:`~streampack.nodes.window_packer.WindowPacker`."""

    SOURCE_KEY = "source"
    YIELDED_KEY = "yielded"
    COUNTERS_KEY = "counters"
    QUOTA_KEY = "num_batches"

    def __init__(self, source: BaseNode[list[Sample]], *, capacity: int, packs_per_batch: int = 1,
                 align: int = 1, pad_id: int = 0, ignore_index: int = -100,
                 num_batches: int | None = None, surplus_hint: str = "raise batches_per_epoch") -> None:
        super().__init__()
        if packs_per_batch < 1:
            raise ValueError(f"{packs_per_batch=} must be >= 1")
        if num_batches is not None and num_batches < 0:
            raise ValueError(f"{num_batches=} must be >= 0")
        self.source = source
        self.capacity, self.packs_per_batch, self.align = capacity, packs_per_batch, align
        self.pad_id, self.ignore_index = pad_id, ignore_index
        self.num_batches, self.surplus_hint = num_batches, surplus_hint
        self._yielded = 0
        self.counters = {"batches": 0, "fillers": 0, "filler_packs": 0}

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self.source.reset(None)
            self._yielded = 0
            self.counters = {"batches": 0, "fillers": 0, "filler_packs": 0}
        else:
            self.source.reset(initial_state[self.SOURCE_KEY])
            self._yielded = initial_state[self.YIELDED_KEY]
            self.counters = dict(initial_state[self.COUNTERS_KEY])
            # the quota is part of the position: an elastic resume's epoch has its own
            self.num_batches = initial_state.get(self.QUOTA_KEY, self.num_batches)

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
        if not packs and self.num_batches is None:
            raise StopIteration
        missing = self.packs_per_batch - len(packs)
        if missing:
            self._count_fillers(whole=not packs, missing=missing)
            packs += [filler_pack(self.capacity, self.pad_id)] * missing
        batch = pack_batch(packs, capacity=self.capacity, align=self.align,
                           pad_id=self.pad_id, ignore_index=self.ignore_index)
        self._yielded += 1
        self.counters["batches"] += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict(), self.YIELDED_KEY: self._yielded,
                self.COUNTERS_KEY: dict(self.counters), self.QUOTA_KEY: self.num_batches}

    def _count_fillers(self, *, whole: bool, missing: int) -> None:
        if whole:
            self.counters["fillers"] += 1
            what = "emits a filler batch"
        else:
            self.counters["filler_packs"] += missing
            what = f"completes its last batch with {missing} filler pack(s)"
        warn_every(_log, "filler", "this worker %s (pad tokens, zero targets) so that every rank steps with "
                   "the same batch shape and count; counted in metrics()['batches']", what, level=logging.INFO)

    def _refuse_surplus(self) -> None:
        try:
            next(self.source)
        except StopIteration:
            return
        raise ValueError(f"this worker has more than num_batches={self.num_batches} batches of "
                         f"data in this epoch (data would be lost); {self.surplus_hint}")
