"""Which samples each global worker reads in each epoch: pure assignment arithmetic.

Global worker ``g = dp_rank * num_workers + worker_id`` of ``G = dp_size * num_workers``.
Epoch ``e`` orders the ``S`` shards by a permutation seeded by ``(seed, e)`` (natural order
when ``shuffle=False``), so every rank computes the same order without communicating. Two
assignments use it:

- **by shard** (:func:`assign_shards`, infinite streams): ``S >= G`` gives worker ``g`` the
  whole shards at permuted positions ``g, g + G, ...``; ``S < G`` gives it one contiguous part of
  one shard (position ``g % S``, part ``g // S``, cut through the shard index). No index is
  needed while ``S >= G``, which matters for a web-scale stream: building every shard's index
  means reading every shard once, and an infinite stream never runs dry, so whole shards are
  balanced enough.
- **by sample** (:func:`cut_balanced` + :func:`split_ranges`, finite epochs and elastic
  resume): the epoch's samples, shard after shard in permuted order, are cut into ``G``
  contiguous ranges of nearly equal cost (token counts from the index, or bytes when the
  index has no lengths), first into ``dp_size`` rank ranges, then each into its workers.
  Balancing ranks first is what keeps filler batches few: only a rank's total is compared with
  the other ranks'.

Either way each sample of an epoch is read by exactly one global worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardSpan:
    """One unit of work of :func:`assign_shards`: a whole shard (``parts == 1``) or one part."""

    shard: int
    """Index of the shard in the expanded URL list."""
    part: int
    parts: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Span:
    """A contiguous byte range of one shard, as the format reader takes it."""

    shard: int
    start: int = 0
    """Offset of the first sample (bytes; uncompressed bytes for ``.gz``)."""
    first: int = 0
    """Number of that sample (tar ordinal / jsonl line)."""
    end: int | None = None
    """Offset to stop at (exclusive); None reads to the end of the shard."""
    epoch: int | None = None
    """Epoch these samples belong to, when not the one being read (an elastic resume reads
    what old readers had left of earlier epochs)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexRange:
    """Samples ``[lo, hi)`` of one shard, in shard-index positions."""

    shard: int
    lo: int
    hi: int
    epoch: int | None = None

    def __len__(self) -> int:
        return self.hi - self.lo


def epoch_permutation(num_shards: int, *, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """int64 ``[num_shards]``: the shard order of ``epoch`` (same on every rank and worker)."""
    if seed < 0 or epoch < 0:
        raise ValueError(f"{seed=} and {epoch=} must be >= 0")
    if not shuffle:
        return np.arange(num_shards, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return rng.permutation(num_shards).astype(np.int64)


def assign_shards(
    num_shards: int, *, seed: int, epoch: int, shuffle: bool, global_worker: int, global_workers: int
) -> list[ShardSpan]:
    """The spans global worker ``global_worker`` reads in ``epoch``, in reading order."""
    if num_shards < 1:
        raise ValueError(f"{num_shards=} must be >= 1")
    if not 0 <= global_worker < global_workers:
        raise ValueError(f"need 0 <= {global_worker=} < {global_workers=}")
    perm = epoch_permutation(num_shards, seed=seed, epoch=epoch, shuffle=shuffle)
    if num_shards >= global_workers:
        return [ShardSpan(shard=int(s), part=0, parts=1) for s in perm[global_worker::global_workers]]
    pos = global_worker % num_shards
    parts = global_workers // num_shards + (1 if pos < global_workers % num_shards else 0)
    return [ShardSpan(shard=int(perm[pos]), part=global_worker // num_shards, parts=parts)]


def cut_balanced(costs: np.ndarray, parts: int) -> np.ndarray:
    """int64 ``[parts + 1]`` boundaries cutting ``costs`` into ``parts`` contiguous ranges whose
    sums are as equal as cuts between items allow: boundary ``k`` is the prefix whose cost is
    nearest ``k / parts`` of the total (ties to the shorter prefix). ``b[0] == 0``,
    ``b[-1] == len(costs)``, non-decreasing."""
    if parts < 1:
        raise ValueError(f"{parts=} must be >= 1")
    prefix = np.concatenate([[0], np.cumsum(np.asarray(costs, dtype=np.float64))])
    targets = prefix[-1] * np.arange(1, parts) / parts
    above = np.searchsorted(prefix, targets, side="left")
    below = np.maximum(above - 1, 0)
    nearer_below = (targets - prefix[below]) <= (prefix[np.minimum(above, len(prefix) - 1)] - targets)
    inner = np.where(nearer_below, below, above)
    return np.concatenate([[0], np.maximum.accumulate(inner), [len(prefix) - 1]]).astype(np.int64)


def cut_two_level(costs: np.ndarray, ranks: int, workers: int) -> np.ndarray:
    """``[ranks * workers + 1]`` boundaries: ranks balanced first, then each rank's workers."""
    outer = cut_balanced(costs, ranks)
    out = [0]
    for r in range(ranks):
        lo, hi = int(outer[r]), int(outer[r + 1])
        out.extend((lo + cut_balanced(costs[lo:hi], workers)[1:]).tolist())
    return np.asarray(out, dtype=np.int64)


def spans_to_array(spans: Sequence[Span]) -> np.ndarray:
    """int64 ``[n, 5]``: shard, start, first, end, epoch per span (-1 for None)."""
    rows = [[s.shard, s.start, s.first, -1 if s.end is None else s.end, -1 if s.epoch is None else s.epoch]
            for s in spans]
    return np.asarray(rows, dtype=np.int64).reshape(-1, 5)


def spans_from_array(rows: np.ndarray) -> list[Span]:
    return [Span(shard=a, start=b, first=c, end=None if d < 0 else d, epoch=None if e < 0 else e)
            for a, b, c, d, e in rows.tolist()]


def split_ranges(ranges: Sequence[IndexRange], lo: int, hi: int) -> list[IndexRange]:
    """The pieces of ``ranges`` (read back to back) that cover overall positions ``[lo, hi)``."""
    out: list[IndexRange] = []
    pos = 0
    for r in ranges:
        a, b = max(lo, pos), min(hi, pos + len(r))
        if a < b:
            out.append(IndexRange(shard=r.shard, lo=r.lo + a - pos, hi=r.lo + b - pos, epoch=r.epoch))
        pos += len(r)
        if pos >= hi:
            break
    return out
