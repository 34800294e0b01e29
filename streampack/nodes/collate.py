"""Collate stage: ``packs_per_batch`` packs -> one THD :class:`~streampack.layout.batch.PackedBatch`.

Every batch has the same shape, ``packs_per_batch * capacity`` tokens, so ranks stepping
together never see different shapes: the last batch of a finite stream is completed with
*filler packs*, and with ``num_batches`` set (this worker's quota for the stream, from the
epoch plan or ``batches_per_epoch``) a worker that runs out of data emits whole *filler
batches* until it reaches the quota. A filler pack holds one document of ``capacity`` pad
tokens with every label ignored, so it adds zero targets to a token-mean loss; its doc key is
``"<filler>"``; on a media stream (``vision_layout``) every batch, filler or image-less, has the
stream's vision layout (Qwen2-VL: ``position_ids [4, 1, T]``). ``num_batches`` may be a
:class:`~streampack.plan.quota.LateQuota`: it is started once the first batch is out and waited
for only when the data runs out (or taken as soon as it is ready, to refuse a surplus early).
They are counted in ``counters["fillers"]`` (whole batches) and
``counters["filler_packs"]`` (packs completing a partial batch) and logged (rate-limited). A
worker with more data than its quota refuses (ValueError) rather than silently dropping it.

With a ``cost_model`` every batch carries ``est_cost``, the estimated compute of its real
packs (``linear × tokens + attention × Σ L²`` over its documents; filler packs cost 0),
computed here once from the documents' lengths, and the running total ``counters["cost"]``.
A model with a vision encoder (``CostModel(vision=...)``, a media stream only) adds its images' and
videos' cost from each decoded image's ``segments`` (patches per frame or tile).

A pack is a :class:`~streampack.plan.rows.PackRows` (what the packer emits) or a list of
Samples (offline packs, decoded media packs). A batch of packs whose documents were read as
blocks is laid out by :func:`~streampack.layout.slices.pack_slices` straight from the buffers
they were read into (one copy of each document's ids); any other batch by
:func:`~streampack.layout.batch.pack_batch` from its Samples (labels, loss masks, extras and
images included). Both give the same batch for the same documents.

Every batch leaves with a :class:`~streampack.layout.stats.WorkerStats`: this reader's running
totals (batches, fillers, packs, documents, real tokens, slots, targets, skipped samples, build
time, log-event counts), so the training process can aggregate metrics of every worker
(:class:`streampack.integrations.metrics.StreamMetrics`) without reading the loader state. The
counts are part of the state, so they continue across a resume; build time and log events are
this process's own (wall time in a state would make two identical runs' states differ).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from streampack.errors import ErrorCounter
from streampack.layout.batch import PackedBatch, pack_batch
from streampack.layout.slices import pack_slices
from streampack.layout.stats import WorkerStats
from streampack.layout.vision_batch import VisionLayout
from streampack.logs import event_counts, get_logger, warn_every
from streampack.packing.cost import CostModel
from streampack.plan.quota import LateQuota
from streampack.plan.rows import PackRows
from streampack.plan.state import record_of, record_text
from streampack.sample import Sample

FILLER_KEY = "<filler>"
SLOW_BATCH_ENV = "STREAMPACK_SLOW_BATCH_SECONDS"
"""Environment variable: seconds one batch may take to build before a ``slow_batch`` warning."""
_STATS = ("packs", "docs", "tokens", "slots", "targets", "cost")
_log = get_logger(__name__)


def is_filler(batch: PackedBatch) -> bool:
    """True for a batch made only of filler packs (no data, zero targets)."""
    return bool(batch.doc_keys) and all(k == FILLER_KEY for k in batch.doc_keys)


def filler_pack(capacity: int, pad_id: int) -> list[Sample]:
    """One pack of ``capacity`` pad tokens that supervises nothing."""
    return [Sample(key=FILLER_KEY, tokens=np.full(capacity, pad_id, dtype=np.int64),
                   loss_mask=np.zeros(capacity, dtype=bool))]


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchLayout:
    """The shape of every batch a collate makes: ``packs_per_batch`` packs of ``capacity`` tokens,
    each document padded to a multiple of ``align``. ``StreamConfig.batch_layout`` makes it from
    the checked records (``capacity`` a multiple of ``align`` is checked there)."""

    capacity: int
    packs_per_batch: int = 1
    align: int = 1
    pad_id: int = 0
    """Padding token id (``PackOptions.pad_id``)."""
    ignore_index: int = -100
    """Label of positions that train nothing (``PackOptions.ignore_index``)."""


class ThdCollate(BaseNode[PackedBatch]):
    """Groups packs (from a :class:`~streampack.nodes.window_packer.WindowPacker`) into batches of
    ``layout`` (:class:`BatchLayout`). ``num_batches``: the quota of a finite epoch (an int, a
    ``plan.quota.LateQuota`` or None); fillers make up what the data did not, and a surplus is
    refused naming ``surplus_hint``. ``errors``, ``dp_rank`` and ``worker_id`` only say where a
    slow batch was made; ``cost_model`` sets each batch's ``est_cost``; ``vision_layout``: a media
    stream's, kept by filler and image-less batches."""

    SOURCE_KEY = "source"
    YIELDED_KEY = "yielded"
    COUNTERS_KEY = "counters"
    QUOTA_KEY = "num_batches"
    LATE_KEY = "late_quota"

    def __init__(self, source: BaseNode[list[Sample]], *, layout: BatchLayout,
                 num_batches: int | LateQuota | None = None, surplus_hint: str = "raise batches_per_epoch",
                 errors: ErrorCounter | None = None, dp_rank: int = 0, worker_id: int = 0,
                 cost_model: CostModel | None = None, vision_layout: VisionLayout | None = None) -> None:
        super().__init__()
        if isinstance(num_batches, int) and num_batches < 0:  # a plan's count, not a setting
            raise ValueError(f"{num_batches=} must be >= 0")
        self.source, self.layout = source, layout
        self.capacity, self.packs_per_batch, self.align = layout.capacity, layout.packs_per_batch, layout.align
        self.pad_id, self.ignore_index = layout.pad_id, layout.ignore_index
        self.num_batches, self.surplus_hint = num_batches, surplus_hint
        self.late = num_batches if isinstance(num_batches, LateQuota) else None
        self.errors, self.dp_rank, self.worker_id = errors, dp_rank, worker_id
        if cost_model is not None and cost_model.vision is not None and vision_layout is None:
            raise ValueError("CostModel(vision=VisionCost(...)) prices the images of a media stream, but this stream has "
                             "no media= (no image reaches a batch): give media=MediaOptions(...) or drop vision=")
        self.cost_model = cost_model
        self.vision_layout = vision_layout  # a media stream's: filler and image-less batches keep its layout
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
            self.counters = {**_fresh_counters(), **record_of(initial_state[self.COUNTERS_KEY])}
            # the quota is part of the position: an elastic resume's epoch has its own
            saved = initial_state.get(self.QUOTA_KEY, self.num_batches)
            if self.late is not None and initial_state.get(self.LATE_KEY) is not None:
                self.late.restore(initial_state[self.LATE_KEY])
                saved = self.late if saved is None else saved
            self.num_batches = saved

    def next(self) -> PackedBatch:
        started = time.perf_counter()
        quota = self._quota(wait=False)
        if quota is not None and self._yielded >= quota:
            self._refuse_surplus()
            raise StopIteration
        packs: list[list[Sample]] = []
        for _ in range(self.packs_per_batch):
            try:
                packs.append(next(self.source))
            except StopIteration:
                break
        if not packs:
            quota = self._quota(wait=True)  # the data ran out: now the fillers need the quota
            if quota is None or self._yielded >= quota:
                if quota is not None and self._yielded > quota:
                    raise ValueError(f"this worker had {self._yielded} batches of data in this epoch, more than "
                                     f"num_batches={quota} (its rank would step more often than the others); "
                                     f"{self.surplus_hint}")
                raise StopIteration
        missing = self.packs_per_batch - len(packs)
        if missing:
            self._count_fillers(whole=not packs, missing=missing)
        batch = self._layout(packs, missing)
        self._yielded += 1
        self.counters["batches"] += 1
        if self.late is not None:
            self.late.start()  # after the first batch: counting reads no index before it
        return self._with_stats(batch, packs, time.perf_counter() - started, self._segments(packs))

    def _layout(self, real: list[Any], missing: int) -> PackedBatch:
        """The batch of the ``real`` packs, completed with ``missing`` filler packs."""
        if not missing and all(isinstance(p, PackRows) and not p.rich for p in real):
            sources: list[np.ndarray] = []
            starts: list[int] = []
            lengths: list[int] = []
            keys: list[str] = []
            for p in real:
                sources += p.sources
                starts += p.starts
                lengths += p.lengths
                keys += p.keys
            return pack_slices(sources, starts, lengths, [len(p) for p in real], tuple(keys), capacity=self.capacity,
                               align=self.align, pad_id=self.pad_id, ignore_index=self.ignore_index,
                               ids_nonnegative=True)  # the block readers check every id (never on a media stream)
        packs = [list(p) for p in real] + [filler_pack(self.capacity, self.pad_id)] * missing
        return pack_batch(packs, capacity=self.capacity, align=self.align, pad_id=self.pad_id,
                          ignore_index=self.ignore_index, vision_layout=self.vision_layout)

    @staticmethod
    def _lengths(real: list[Any]) -> np.ndarray:
        """int64 document lengths of the real packs, in one array."""
        if not real:
            return np.zeros(0, np.int64)
        return np.concatenate([p.rows["length"] if isinstance(p, PackRows)
                               else np.fromiter((len(s) for s in p), np.int64, len(p)) for p in real])

    def _segments(self, real: list[Any]) -> np.ndarray | None:
        """int64 patches of every vision attention segment of the real packs' decoded images (None: the
        cost model prices no vision encoder)."""
        if self.cost_model is None or self.cost_model.vision is None:
            return None
        return np.fromiter((n for p in real for s in p for image in s.images for n in image.segments), np.int64)

    def get_state(self) -> dict[str, Any]:
        # a quota that cannot be recounted after a restore (pinned), or that costs no waiting on
        # anyone (no agreement: settled here, as the plan once did) goes into the state, so a shard
        # that changes between save and resume cannot change the epoch's count
        if self.late is not None and (self.late.pin or (not self.late.background and self._yielded > 0)):
            self._quota(wait=True)
        quota = self.num_batches if not isinstance(self.num_batches, LateQuota) else None
        return {self.SOURCE_KEY: self.source.state_dict(), self.YIELDED_KEY: self._yielded,
                self.COUNTERS_KEY: record_text(self.counters), self.QUOTA_KEY: quota,
                self.LATE_KEY: None if self.late is None else self.late.state()}

    def _quota(self, *, wait: bool) -> int | None:
        """The quota as an int (None: no quota); a late one only when ready or ``wait``."""
        if isinstance(self.num_batches, LateQuota):
            if not (wait or self.num_batches.ready()):
                return None
            self.num_batches = self.num_batches.get()
        return self.num_batches

    def _with_stats(self, batch: PackedBatch, real: list[Any], seconds: float,
                    segments: np.ndarray | None = None) -> PackedBatch:
        """Count the batch's ``real`` packs (``segments``: their images' vision attention segments) into the running
        totals and attach them; log a slow or first batch. Filler packs are padding: no documents, tokens or slots of
        data."""
        c = self.counters
        est_cost = None
        if self.cost_model is not None:
            est_cost = self.cost_model.pack_cost(self._lengths(real), segments=segments)
            c["cost"] += est_cost
        c["packs"] += len(real)
        # a PackRows carries its document count and token sum (made for a whole round at once): no per-batch array
        c["docs"] += sum(len(p) for p in real)
        c["tokens"] += sum(p.tokens if isinstance(p, PackRows) else sum(len(s) for s in p) for p in real)
        c["slots"] += len(real) * self.capacity
        c["targets"] += batch.num_targets
        self._build_seconds += seconds
        where = f"rank {self.dp_rank} worker {self.worker_id}"
        if self._first:
            self._first = False
            _log.info("%s: first batch after %.2f s", where, seconds)
        elif seconds > self.slow_seconds:
            warn_every(_log, "slow_batch", "%s took %.1f s to build one batch (reading, tokenizing "
                       "and packing included; threshold %s=%g)", where, seconds, SLOW_BATCH_ENV,
                       self.slow_seconds)
        stats = WorkerStats(dp_rank=self.dp_rank, worker_id=self.worker_id,
                            batches=c["batches"], fillers=c["fillers"],
                            skipped=self.errors.total if self.errors is not None else 0,
                            build_seconds=self._build_seconds, events=event_counts(),
                            **{k: c[k] for k in _STATS})
        # the batch was made just now for this call: set the two fields in place (dataclasses.replace
        # rebuilt all ~25 fields, ~0.1 ms a batch)
        batch.stats, batch.est_cost = stats, est_cost
        return batch

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


def _fresh_counters() -> dict[str, Any]:
    return {"batches": 0, "fillers": 0, "filler_packs": 0, **dict.fromkeys(_STATS, 0), "cost": 0.0}
