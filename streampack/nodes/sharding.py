"""Which shard (or part of a shard) each global worker reads in each epoch.

Global worker ``g = dp_rank * num_workers + worker_id`` of ``G = dp_size * num_workers``.
Epoch ``e`` orders the ``S`` shards by a permutation seeded by ``(seed, e)`` (natural order
when ``shuffle=False``), so every rank computes the same order without communicating.

- ``S >= G``: worker ``g`` reads whole shards at permuted positions ``g, g + G, g + 2G, ...``
  (workers differ by at most one shard).
- ``S < G``: every worker reads exactly one contiguous part of one shard: position
  ``p = g % S`` of the permutation, part ``g // S`` of the ``ceil``/``floor(G / S)`` parts that
  position is cut into. Parts are contiguous sample ranges (byte ranges, via the shard index),
  so no worker reads bytes of another's part. Fewer samples in a shard than parts leaves some
  parts empty; in an infinite stream the reader passes over an epoch that gives a worker
  nothing, and refuses once no shard can ever give it a sample.

Either way each sample of an epoch is read by exactly one global worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardSpan:
    """One unit of work: a whole shard (``parts == 1``) or one part of it."""

    shard: int
    """Index of the shard in the expanded URL list."""
    part: int
    parts: int


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
