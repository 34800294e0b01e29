"""The THD batch laid out from documents given as ``(array, start, length)`` slices of the buffers they
were read into: how the collate lays out documents read as token blocks.

:func:`pack_slices` gives :func:`~streampack.layout.batch.pack_batch`'s output field for field
(``tests/unit/nodes/test_block_reads.py``); with ``align == 1`` the int32 ``input_ids`` are one ``concatenate`` of
views (``benchmarks/bench_compact.py`` measures both against ``pack_batch`` on the same documents).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate

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
    the offsets are Python lists made a pack at a time (with no alignment padding the causal varlen spans are the
    padded offsets plus each non-full pack's real end, so ``offset_fields``' sort is not needed); at ~55 documents
    a batch, whole-batch numpy (as ``doc_places``) spends more than this in its calls' overheads."""
    n = _ints(lengths)
    if min(pack_sizes) < 1:
        raise ValueError(f"pack {min(range(len(pack_sizes)), key=pack_sizes.__getitem__)} is empty")
    if min(n) < 1:
        i = n.index(min(n))
        raise ValueError(f"document {doc_keys[i]!r} in pack {bisect_right(list(accumulate(pack_sizes)), i)} "
                         f"has zero length")
    docs = [src[a:a + k] for src, a, k in zip(sources, _ints(starts), n)]
    pad = _constant(pad_id, capacity)
    real = [0, *accumulate(n)]
    padded, causal, ids = [0], [0], []
    longest_span = longest_causal = max(n)
    i = 0
    for p, k in enumerate(pack_sizes):
        base = p * capacity
        ends = [base - real[i] + r for r in real[i + 1:i + k + 1]]
        left = base + capacity - ends[-1]
        if left < 0:
            raise ValueError(f"pack {p} holds {ends[-1] - base} tokens, more than {capacity=}")
        ids += docs[i:i + k]
        ids.append(pad[:left])
        used, ends[-1] = ends[-1], base + capacity
        padded += ends
        if left:  # the pack's padding is a causal span of its own, and its last document's span grows by it
            causal += ends[:-1] + [used, base + capacity]
            longest_span = max(longest_span, n[i + k - 1] + left)
            longest_causal = max(longest_causal, left)
        else:
            causal += ends
        i += k
    input_ids = torch.empty(len(pack_sizes) * capacity, dtype=torch.int32)
    np.concatenate(ids, out=input_ids.numpy(), casting="unsafe")  # in int32 range: checked by the caller
    buffer = torch.from_numpy(np.array(real + padded + causal, dtype=np.int32))
    a, b = len(real), 2 * len(real)
    num_targets, target_docs = target_counts(input_ids, buffer[:a].numpy(), buffer[a:b].numpy(), None, None,
                                             ignore_index, ids_avoid_ignore=ids_avoid_ignore)
    varlen = buffer[b:]
    return PackedBatch(input_ids=input_ids, cu_seqlens=buffer[:a], cu_seqlens_padded=buffer[a:b],
                       varlen_cu_seqlens=varlen, varlen_max_seqlen=longest_causal,
                       varlen_cu_seqlens_bidirectional=varlen, varlen_max_seqlen_bidirectional=longest_causal,
                       max_seqlen=longest_span, num_tokens=real[-1], num_targets=num_targets,
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
