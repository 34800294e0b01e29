"""Collate stage: ``packs_per_batch`` packs -> one THD :class:`~streampack.layout.batch.PackedBatch`.

Finite streams: the last batch may hold fewer packs. With ``num_batches`` set (a per-worker
quota, used by ``PackedDataset(batches_per_epoch=...)`` so every rank yields the same count),
a worker that runs out of data emits *filler* batches until it reaches the quota: one pack
holding a single document of ``capacity`` pad tokens with every label ignored, so it adds
zero targets to a token-mean loss. Fillers have ``doc_keys == ("<filler>",)`` and are counted
in ``counters["fillers"]``. A worker with more data than its quota refuses (ValueError) rather
than silently dropping the rest.

Every batch leaves with a :class:`~streampack.layout.stats.WorkerStats`: this reader's running
totals (batches, fillers, packs, documents, real tokens, slots, targets, skipped samples, build
time, log-event counts), so the training process can aggregate metrics of every worker
(:class:`streampack.integrations.metrics.StreamMetrics`) without reading the loader state. The
counts are part of the state, so they continue across a resume; build time and log events are
this process's own (wall time in a state would make two identical runs' states differ).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from streampack.errors import ErrorCounter
from streampack.layout.batch import PackedBatch, pack_batch
from streampack.layout.stats import WorkerStats
from streampack.logs import event_counts, get_logger, warn_every
from streampack.sample import Sample

FILLER_KEY = "<filler>"
SLOW_BATCH_ENV = "STREAMPACK_SLOW_BATCH_SECONDS"
"""Environment variable: seconds one batch may take to build before a ``slow_batch`` warning."""
_STATS = ("packs", "docs", "tokens", "slots", "targets")
log = get_logger(__name__)


def is_filler(batch: PackedBatch) -> bool:
    return batch.doc_keys == (FILLER_KEY,)


class ThdCollate(BaseNode[PackedBatch]):
    """Groups packs from a :class:`~streampack.nodes.window_packer.WindowPacker`."""

    SOURCE_KEY = "source"
    YIELDED_KEY = "yielded"
    COUNTERS_KEY = "counters"

    def __init__(self, source: BaseNode[list[Sample]], *, capacity: int, packs_per_batch: int = 1,
                 align: int = 1, pad_id: int = 0, ignore_index: int = -100,
                 num_batches: int | None = None, errors: ErrorCounter | None = None,
                 dp_rank: int = 0, worker_id: int = 0) -> None:
        super().__init__()
        if packs_per_batch < 1:
            raise ValueError(f"{packs_per_batch=} must be >= 1")
        if num_batches is not None and num_batches < 0:
            raise ValueError(f"{num_batches=} must be >= 0")
        self.source = source
        self.capacity, self.packs_per_batch, self.align = capacity, packs_per_batch, align
        self.pad_id, self.ignore_index = pad_id, ignore_index
        self.num_batches = num_batches
        self.errors, self.dp_rank, self.worker_id = errors, dp_rank, worker_id
        self.slow_seconds = float(os.environ.get(SLOW_BATCH_ENV, "30"))
        self._yielded = 0
        self._first = True
        self._build_seconds = 0.0  # wall time is not part of the state: states stay deterministic
        self.counters = _fresh_counters()

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._first, self._build_seconds = True, 0.0
        if initial_state is None:
            self.source.reset(None)
            self._yielded = 0
            self.counters = _fresh_counters()
        else:
            self.source.reset(initial_state[self.SOURCE_KEY])
            self._yielded = initial_state[self.YIELDED_KEY]
            self.counters = {**_fresh_counters(), **initial_state[self.COUNTERS_KEY]}

    def next(self) -> PackedBatch:
        started = time.perf_counter()
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
        return self._with_stats(batch, time.perf_counter() - started)

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict(), self.YIELDED_KEY: self._yielded,
                self.COUNTERS_KEY: dict(self.counters)}

    def _with_stats(self, batch: PackedBatch, seconds: float) -> PackedBatch:
        """Count ``batch`` into the running totals and attach them; log a slow or first batch."""
        c = self.counters
        if not is_filler(batch):  # a filler is padding: no documents, tokens or slots of data
            c["packs"] += batch.num_packs
            c["docs"] += batch.num_docs
            c["tokens"] += batch.num_tokens
            c["slots"] += batch.total_tokens
            c["targets"] += batch.num_targets
        self._build_seconds += seconds
        where = f"rank {self.dp_rank} worker {self.worker_id}"
        if self._first:
            self._first = False
            log.info("%s: first batch after %.2f s", where, seconds)
        elif seconds > self.slow_seconds:
            warn_every(log, "slow_batch", "%s took %.1f s to build one batch (reading, tokenizing "
                       "and packing included; threshold %s=%g)", where, seconds, SLOW_BATCH_ENV,
                       self.slow_seconds)
        stats = WorkerStats(dp_rank=self.dp_rank, worker_id=self.worker_id,
                            batches=c["batches"], fillers=c["fillers"],
                            skipped=self.errors.total if self.errors is not None else 0,
                            build_seconds=self._build_seconds, events=event_counts(),
                            **{k: c[k] for k in _STATS})
        return replace(batch, stats=stats)

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


def _fresh_counters() -> dict[str, Any]:
    return {"batches": 0, "fillers": 0, **dict.fromkeys(_STATS, 0)}
