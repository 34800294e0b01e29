"""The THD batch laid out from documents given as ``(array, start, length)`` slices of the buffers they
were read into: how the collate lays out documents read as token blocks.

:func:`pack_slices` gives :func:`~streampack.layout.batch.pack_batch`'s output field for field
(``tests/unit/nodes/test_block_reads.py``); with ``align == 1`` the int32 ``input_ids`` are one ``concatenate`` of
views (``benchmarks/bench_compact.py`` measures both against ``pack_batch`` on the same documents).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from streampack.layout.batch import PackedBatch, from_ids
from streampack.layout.derive import check_int32, check_int32_ids, fits_int32, target_counts
from streampack.layout.spans import doc_places

_INT32_MAX = 2**31 - 1


def pack_slices(sources: Sequence[np.ndarray], starts: np.ndarray, lengths: np.ndarray, pack_sizes: Sequence[int],
                doc_keys: tuple[str, ...], *, capacity: int, align: int = 1, pad_id: int = 0,
                ignore_index: int = -100, ids_nonnegative: bool = False) -> PackedBatch:
    """The :class:`PackedBatch` of ``len(pack_sizes)`` packs: document ``i`` is
    ``sources[i][starts[i]:starts[i] + lengths[i]]``, pack ``p`` holds the next ``pack_sizes[p]``;
    ``capacity`` and ``align`` are taken as checked. ``ids_nonnegative``: the readers checked every id (in
    ``[0, 2**31)``), so none equals a negative ``ignore_index`` and the targets are counted without a pass;
    otherwise the ids are checked to fit int32."""
    num_packs = len(pack_sizes)
    total = num_packs * capacity
    if not num_packs or total > _INT32_MAX:
        raise ValueError(f"pack_slices needs 1..{_INT32_MAX // capacity} packs of {capacity=}")
    check_int32(pad_id, "pad_id")
    if not ids_nonnegative:
        wide = [i for i, src in enumerate(sources) if not fits_int32(src.dtype)]
        at, n = np.asarray(starts), np.asarray(lengths)
        check_int32_ids([sources[i][at[i]:at[i] + n[i]] for i in wide], [doc_keys[i] for i in wide], "token id")
    avoid = ids_nonnegative and ignore_index < 0
    if align == 1 and capacity <= _PARTS:
        return _back_to_back(sources, starts, lengths, pack_sizes, doc_keys, capacity=capacity, pad_id=pad_id,
                             ignore_index=ignore_index, ids_avoid_ignore=avoid)
    return _aligned(sources, starts, lengths, pack_sizes, doc_keys, capacity=capacity, align=align, pad_id=pad_id,
                    ignore_index=ignore_index, ids_avoid_ignore=avoid)


def _back_to_back(sources: Sequence[np.ndarray], starts: np.ndarray, lengths: np.ndarray, pack_sizes: Sequence[int],
                  doc_keys: tuple[str, ...], *, capacity: int, pad_id: int, ignore_index: int,
                  ids_avoid_ignore: bool) -> PackedBatch:
    """``align == 1``: ``input_ids`` is one ``concatenate`` of views (the documents and each pack's run of padding);
    the offsets are Python ints gathered on the way (with no alignment padding the causal varlen spans are the padded
    offsets plus each non-full pack's real end, so ``offset_fields``' sort is not needed)."""
    total = len(pack_sizes) * capacity
    input_ids = torch.empty(total, dtype=torch.int32)
    pad = _constant(pad_id, capacity)
    ids = []
    real, padded, causal = [0], [0], [0]
    longest_span = longest_causal = tokens = 0
    docs = zip(sources, _ints(starts), _ints(lengths))
    for p, k in enumerate(pack_sizes):
        if k < 1:
            raise ValueError(f"pack {p} is empty")
        base = used = p * capacity
        for j in range(k):
            src, a, n = next(docs)
            if n < 1:
                raise ValueError(f"document {doc_keys[len(real) - 1]!r} in pack {p} has zero length")
            ids.append(src[a:a + n])
            tokens += n
            real.append(tokens)
            used += n
            if j < k - 1:
                padded.append(used)
                causal.append(used)
                longest_causal = max(longest_causal, n)
                longest_span = max(longest_span, n)
                continue
            left = base + capacity - used
            if left < 0:
                raise ValueError(f"pack {p} holds {used - base} tokens, more than {capacity=}")
            ids.append(pad[:left])
            padded.append(base + capacity)
            longest_span = max(longest_span, n + left)
            longest_causal = max(longest_causal, n, left)
            if left:
                causal.append(used)
            causal.append(base + capacity)
    np.concatenate(ids, out=input_ids.numpy(), casting="unsafe")  # in int32 range: checked by the caller
    buffer = torch.from_numpy(np.array(real + padded + causal, dtype=np.int32))
    a, b = len(real), 2 * len(real)
    num_targets, target_docs = target_counts(input_ids, buffer[:a].numpy(), buffer[a:b].numpy(), None, None,
                                             ignore_index, ids_avoid_ignore=ids_avoid_ignore)
    varlen = buffer[b:]
    return PackedBatch(input_ids=input_ids, cu_seqlens=buffer[:a], cu_seqlens_padded=buffer[a:b],
                       varlen_cu_seqlens=varlen, varlen_max_seqlen=longest_causal,
                       varlen_cu_seqlens_bidirectional=varlen, varlen_max_seqlen_bidirectional=longest_causal,
                       max_seqlen=longest_span, num_tokens=tokens, num_targets=num_targets,
                       num_target_docs=target_docs, doc_keys=doc_keys, capacity=capacity,
                       num_packs=len(pack_sizes), align=1, pad_id=pad_id, ignore_index=ignore_index)


def _aligned(sources: Sequence[np.ndarray], starts: np.ndarray, lengths: np.ndarray, pack_sizes: Sequence[int],
             doc_keys: tuple[str, ...], *, capacity: int, align: int, pad_id: int, ignore_index: int,
             ids_avoid_ignore: bool) -> PackedBatch:
    """Any ``align``: each document copied to its aligned span (``doc_places``), offsets by ``offset_fields``."""
    total = len(pack_sizes) * capacity
    lengths = np.asarray(lengths, dtype=np.int64)
    doc_start, cu_padded = doc_places(lengths, pack_sizes, doc_keys, capacity, align)
    input_ids = torch.full((total,), pad_id, dtype=torch.int32)
    ids = input_ids.numpy()
    for src, a, s, n in zip(sources, np.asarray(starts).tolist(), doc_start.tolist(), lengths.tolist()):
        ids[s:s + n] = src[a:a + n]
    return from_ids(input_ids, lengths, cu_padded, doc_keys, capacity=capacity, align=align, pad_id=pad_id,
                    ignore_index=ignore_index, ids_avoid_ignore=ids_avoid_ignore)


def _ints(values: Sequence[int] | np.ndarray) -> list[int]:
    return values if isinstance(values, list) else np.asarray(values).tolist()


_PARTS = 1 << 20
"""Largest capacity the constant runs are kept for (4 MB each); larger packs take ``_aligned``."""
_CONSTANTS: dict[tuple[int, int], np.ndarray] = {}


def _constant(value: int, n: int) -> np.ndarray:
    """``n`` copies of ``value`` (int32, read only), made once per value and size."""
    run = _CONSTANTS.get((value, n))
    if run is None:
        run = _CONSTANTS[(value, n)] = np.full(n, value, dtype=np.int32)
        run.flags.writeable = False
    return run


__all__ = ["pack_slices"]
