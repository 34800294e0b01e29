"""Where every document sits on the token axis, and the spans attention kernels need.

:func:`doc_places` places the documents of each pack (``pack_batch``'s layout). Kernels without a
padded variant (flash-attn varlen, torch's ``varlen_attn``, HF's packed ``flash_attention_2``)
take one list of contiguous spans covering the token axis; a batch carries them, built here once
on the CPU, so an adapter on a GPU batch needs no host-device sync to derive them. With
``capacity=8, align=2`` and documents ``a`` (3 tokens) and ``b`` (2)::

    tokens            a0 a1 a2 P  b0 b1 P  P
    cu_seqlens_padded [0, 4, 8]          aligned spans (the trailing padding joins ``b``)
    causal spans      [0, 4, 6, 8]       alignment padding inside its document's span (after the
                                         real tokens: no real query sees it); the pack's
                                         trailing padding ``[6, 8)`` its own span
    bidirectional     [0, 3, 4, 6, 8]    every run of padding its own span

Every position lies in some span, so the kernel writes every output row (flash-attn leaves rows
past ``cu_seqlens[-1]`` uninitialised).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def varlen_offsets(padded: np.ndarray, lengths: np.ndarray, align: int, *,
                   causal: bool) -> np.ndarray:
    """int32 ``[m+1]`` span offsets for the documents at ``padded[:-1]`` (int ``[n+1]``, last
    entry ``T``) with real ``lengths`` (int ``[n]``); see the module docstring."""
    padded = np.asarray(padded, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    body = -(-lengths // align) * align if causal else lengths
    # a document's body never passes the next document's start, so the union of both offset
    # lists, sorted and without duplicates, is exactly the span boundaries (np.unique would do,
    # but its first call in a process imports numpy.ma: 16-55 ms here, on the first batch)
    both = np.sort(np.concatenate([padded, padded[:-1] + body]))
    keep = np.empty(both.size, dtype=bool)
    keep[:1] = True
    np.not_equal(both[1:], both[:-1], out=keep[1:])
    return both[keep].astype(np.int32)


def longest(offsets: np.ndarray) -> int:
    """Longest span of ``offsets`` as a Python int (0 for a single offset)."""
    return int(np.diff(offsets).max()) if offsets.size > 1 else 0


def span_index(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """int32 ``[total]``: index of the span of ``offsets`` (int ``[m+1]``, last entry
    ``total``) holding each token, on the device of ``offsets``. ``output_size`` makes
    ``repeat_interleave`` free of the host sync it otherwise needs to size its output."""
    spans = (offsets[1:] - offsets[:-1]).to(torch.int64)
    index = torch.arange(spans.shape[0], dtype=torch.int32, device=offsets.device)
    return torch.repeat_interleave(index, spans, output_size=total)


def offset_fields(cu_real: np.ndarray, cu_padded: np.ndarray, align: int) -> dict[str, Any]:
    """The int32 offset fields of a :class:`~streampack.layout.batch.PackedBatch`
    (``cu_seqlens``, ``cu_seqlens_padded`` and the ``varlen_*`` spans) from its real and padded
    offsets, all views of one int32 buffer (one shared-memory segment across processes)."""
    lengths = np.diff(cu_real)
    causal = varlen_offsets(cu_padded, lengths, align, causal=True)
    # with align == 1 there is no alignment padding: the only padding (a pack's tail) is
    # already its own span, so both layouts are one tensor
    bidirectional = causal if align == 1 else varlen_offsets(cu_padded, lengths, align, causal=False)
    parts = [cu_real, cu_padded, causal] + ([] if align == 1 else [bidirectional])
    buffer = torch.from_numpy(np.concatenate(parts).astype(np.int32, copy=False))
    views, start = [], 0
    for part in parts:
        views.append(buffer[start:start + part.size])
        start += part.size
    return {
        "cu_seqlens": views[0],
        "cu_seqlens_padded": views[1],
        "varlen_cu_seqlens": views[2],
        "varlen_max_seqlen": longest(causal),
        "varlen_cu_seqlens_bidirectional": views[2] if align == 1 else views[3],
        "varlen_max_seqlen_bidirectional": longest(bidirectional),
    }


def doc_places(lengths: np.ndarray, sizes: Sequence[int], keys: Sequence[str], capacity: int,
               align: int) -> tuple[np.ndarray, np.ndarray]:
    """Where the documents of ``lengths`` (int ``[n]``) go in packs of ``sizes``: int64 ``[n]`` token offsets
    and int32 ``[n+1]`` ``cu_seqlens_padded``; ``ValueError`` (naming ``keys``) for an empty pack or
    document, or one that does not fit."""
    sizes = np.asarray(sizes, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if (sizes < 1).any():
        raise ValueError(f"pack {int(np.argmax(sizes < 1))} is empty")
    pack = np.repeat(np.arange(sizes.size), sizes)
    if (lengths < 1).any():
        i = int(np.argmax(lengths < 1))
        raise ValueError(f"document {keys[i]!r} in pack {int(pack[i])} has zero length")
    spans = -(-lengths // align) * align
    if (spans > capacity).any():
        i = int(np.argmax(spans > capacity))
        raise ValueError(f"document {keys[i]!r} of length {int(lengths[i])} needs {int(spans[i])} tokens "
                         f"after {align=}, more than {capacity=}")
    ends = np.cumsum(spans)
    last = np.cumsum(sizes) - 1
    before = np.zeros(sizes.size, dtype=np.int64)
    before[1:] = ends[last[:-1]]  # span total of the packs before each
    used = ends[last] - before
    if (used > capacity).any():
        p = int(np.argmax(used > capacity))
        raise ValueError(f"pack {p} holds {int(used[p])} tokens after {align=}, more than {capacity=}")
    start = ends - spans + (np.arange(sizes.size, dtype=np.int64) * capacity - before)[pack]
    cu_padded = np.empty(lengths.size + 1, dtype=np.int32)
    cu_padded[0] = 0
    cu_padded[1:] = start + spans
    cu_padded[last + 1] = np.arange(1, sizes.size + 1) * capacity
    return start, cu_padded
