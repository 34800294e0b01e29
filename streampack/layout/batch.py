"""The THD micro-batch: documents back to back on one token axis, with ``cu_seqlens``.

Worked example (``capacity=8, align=2``; documents ``a`` of 3 tokens and ``b`` of 2)::

    input_ids          a0 a1 a2 P  b0 b1 P  P        (P = pad_id)
    labels             a1 a2 -  -  b1 -  -  -        (- = ignore_index; already shifted)
    position_ids       0  1  2  3  0  1  2  3        (restart at every padded span)
    cu_seqlens         [0, 3, 5]                     (real lengths, int32)
    cu_seqlens_padded  [0, 4, 8]                     (aligned spans; the trailing pack
                                                      padding joins the pack's last span)

Every span of ``cu_seqlens_padded`` is a multiple of ``align``; ``cu_seqlens_padded[-1] == T``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from streampack.layout import adapters
from streampack.layout.documents import (
    alloc_extras,
    check_doc,
    check_extras,
    normalize,
    targets,
)
from streampack.sample import Sample

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class PackedBatch:
    """One micro-batch of ``num_packs`` packs of ``capacity`` tokens, flattened to ``T`` tokens."""

    input_ids: torch.Tensor
    """int64 ``[T]``: all documents back to back, each followed by its alignment padding."""
    labels: torch.Tensor
    """int64 ``[T]``: next-token target of each position (already shifted); ``ignore_index`` at
    each document's last token, at padding and wherever the sample's loss mask is 0."""
    position_ids: torch.Tensor
    """int64 ``[T]``: ``arange`` over each padded span, restarting at 0 at every document."""
    cu_seqlens: torch.Tensor
    """int32 ``[n+1]``: cumulative real lengths of the ``n`` documents."""
    cu_seqlens_padded: torch.Tensor
    """int32 ``[n+1]``: token offsets of the documents' padded spans; last entry ``== T``."""
    max_seqlen: int
    """Longest padded span (what kernels size their grid by)."""
    num_tokens: int
    """Real (non-padding) tokens."""
    num_targets: int
    """Positions whose label is not ``ignore_index``: the token-mean loss denominator."""
    doc_keys: tuple[str, ...]
    """Provenance of each document (``url#key``, plus ``/chunk`` when split)."""
    capacity: int
    num_packs: int
    align: int = 1
    pad_id: int = 0
    ignore_index: int = -100
    extras: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Per-token side tensors ``[T, ...]`` packed with the same layout, zero-padded."""

    @property
    def num_docs(self) -> int:
        return len(self.doc_keys)

    @property
    def total_tokens(self) -> int:
        """``T`` = ``num_packs * capacity``."""
        return int(self.input_ids.shape[0])

    @property
    def doc_lengths(self) -> torch.Tensor:
        """int32 ``[n]`` real length of every document."""
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def aligned_lengths(self) -> torch.Tensor:
        """int32 ``[n]``: real lengths rounded up to ``align`` (span without trailing pack padding)."""
        return (self.doc_lengths + (self.align - 1)) // self.align * self.align

    @property
    def seq_idx(self) -> torch.Tensor:
        """int32 ``[T]``: document index of every token (padding belongs to its span's document);
        what Mamba / linear-attention kernels take to reset their state at boundaries."""
        spans = self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]
        docs = torch.arange(self.num_docs, dtype=torch.int32, device=self.input_ids.device)
        return torch.repeat_interleave(docs, spans.to(torch.int64))

    @property
    def fill(self) -> float:
        """Real tokens / ``T``."""
        return self.num_tokens / self.total_tokens if self.total_tokens else 0.0

    def map_tensors(self, fn: Any) -> PackedBatch:
        """A copy with ``fn`` applied to every tensor field (including extras)."""
        changes = {
            name: fn(getattr(self, name))
            for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "cu_seqlens_padded")
        }
        changes["extras"] = {k: fn(v) for k, v in self.extras.items()}
        return replace(self, **changes)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        return self.map_tensors(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> PackedBatch:
        return self.map_tensors(lambda t: t.pin_memory())

    # The consumer adapters are documented in streampack.layout.adapters; these are their front
    # doors, so `model(**batch.hf_inputs())` needs no extra import.
    def flash_attn_kwargs(self, *, causal: bool = True) -> adapters.FlashAttnKwargs:
        return adapters.flash_attn_kwargs(self, causal=causal)

    def te_kwargs(self, *, causal: bool = True) -> adapters.TEKwargs:
        return adapters.te_kwargs(self, causal=causal)

    def packed_seq_params(self, *, causal: bool = True) -> Any:
        return adapters.packed_seq_params(self, causal=causal)

    def hf_inputs(self) -> adapters.HFInputs:
        return adapters.hf_inputs(self)


def alignment(cp_size: int = 1, tp_size: int = 1, *, sequence_parallel: bool = True,
              multiple: int = 1) -> int:
    """Per-document alignment: ``2*cp*tp`` with context parallelism (the 2 lets causal
    attention be load-balanced across CP ranks), ``tp`` with sequence parallelism, else 1;
    combined (lcm) with an explicit ``multiple`` (e.g. 8 or 16 for FP8)."""
    for name, value in (("cp_size", cp_size), ("tp_size", tp_size), ("multiple", multiple)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if cp_size > 1:
        base = 2 * cp_size * tp_size
    elif sequence_parallel:
        base = tp_size
    else:
        base = 1
    return math.lcm(base, multiple)


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return int(value)


def _spans(docs: list[list[Sample]], capacity: int, align: int) -> list[tuple[int, int, int]]:
    """``(start, real length, span end)`` of every document in layout order; each span is its
    length rounded up to ``align``, and a pack's trailing padding joins its last span."""
    out = []
    for p, pack in enumerate(docs):
        if not pack:
            raise ValueError(f"pack {p} is empty")
        start = p * capacity
        for i, doc in enumerate(pack):
            n = len(doc)
            if n == 0:
                raise ValueError(f"document {doc.doc_key!r} in pack {p} has zero length")
            span = -(-n // align) * align
            if span > capacity:
                raise ValueError(f"document {doc.doc_key!r} of length {n} needs {span} tokens "
                                 f"after {align=}, more than {capacity=}")
            end = start + span
            if end > (p + 1) * capacity:
                raise ValueError(f"pack {p} holds {end - p * capacity} tokens after {align=}, "
                                 f"more than {capacity=}")
            if i == len(pack) - 1:
                end = (p + 1) * capacity
            out.append((start, n, end))
            start = end
    return out


def pack_batch(packs: Sequence[Sequence[Any]], *, capacity: int, align: int = 1,
               pad_id: int = 0, ignore_index: int = -100) -> PackedBatch:
    """Lay out ``packs`` (each a list of documents) as one THD :class:`PackedBatch`.

    Each document is a :class:`~streampack.sample.Sample`, a mapping with ``input_ids`` (and
    optionally ``labels``, ``loss_mask``, ``key`` and per-token extras ``[L, ...]``) or a plain
    sequence of ids. Every pack occupies exactly ``capacity`` tokens; each document is padded
    to a multiple of ``align`` and a pack's trailing padding joins its last document's span.
    Token ids and labels of any integer dtype become int64 (non-integral or out-of-range ids
    are a ``ValueError``); a document's own label ``-100`` (the Sample convention) becomes
    ``ignore_index``; ``labels``, ``loss_mask`` and extras must have one row per token, and an
    extra the same per-token shape in every document.
    """
    capacity, align = _positive_int(capacity, "capacity"), _positive_int(align, "align")
    if capacity % align:
        raise ValueError(f"{capacity=} must be a multiple of {align=}")
    if not packs:
        raise ValueError("pack_batch needs at least one pack")
    total = len(packs) * capacity
    if total > _INT32_MAX:
        # cu_seqlens are int32 in every varlen kernel: offsets past 2**31-1 would wrap (fa#2611)
        raise ValueError(f"{len(packs)} packs x {capacity=} = {total} tokens overflows the int32 "
                         f"cu_seqlens of varlen kernels (max {_INT32_MAX})")
    docs = [[check_doc(normalize(d, (p, i)), ignore_index) for i, d in enumerate(pack)]
            for p, pack in enumerate(packs)]
    extra_names = check_extras(docs)
    input_ids = np.full(total, pad_id, dtype=np.int64)
    labels = np.full(total, ignore_index, dtype=np.int64)
    positions = np.empty(total, dtype=np.int64)
    extras = alloc_extras(docs, extra_names, total)
    real, padded, keys = [0], [0], []
    for doc, (start, n, end) in zip((d for pack in docs for d in pack), _spans(docs, capacity, align)):
        input_ids[start:start + n] = doc.tokens
        labels[start:start + n - 1] = targets(doc, ignore_index)[1:]
        positions[start:end] = np.arange(end - start)
        for name in extra_names:
            extras[name][start:start + n] = doc.extras[name]
        real.append(real[-1] + n)
        padded.append(end)
        keys.append(doc.doc_key)
    cu_padded = np.asarray(padded, dtype=np.int32)
    return PackedBatch(
        input_ids=torch.from_numpy(input_ids),
        labels=torch.from_numpy(labels),
        position_ids=torch.from_numpy(positions),
        cu_seqlens=torch.from_numpy(np.asarray(real, dtype=np.int32)),
        cu_seqlens_padded=torch.from_numpy(cu_padded),
        max_seqlen=int(np.diff(cu_padded).max()),
        num_tokens=real[-1],
        num_targets=int(np.count_nonzero(labels != ignore_index)),
        doc_keys=tuple(keys),
        capacity=capacity,
        num_packs=len(docs),
        align=align,
        pad_id=pad_id,
        ignore_index=ignore_index,
        extras={k: torch.from_numpy(v) for k, v in extras.items()},
    )


def check_invariants(batch: PackedBatch, docs: Sequence[Sequence[int]] | None = None) -> None:
    """Assert DESIGN.md's PackedBatch invariants; with ``docs`` (token ids in layout order)
    also check token conservation. Raises ``AssertionError`` naming the broken invariant."""
    cu, cup = batch.cu_seqlens, batch.cu_seqlens_padded
    T = batch.total_tokens
    assert cu.dtype == torch.int32 and cup.dtype == torch.int32, "cu_seqlens must be int32"
    assert cu.shape == cup.shape == (batch.num_docs + 1,), "cu_seqlens length != docs + 1"
    assert int(cu[0]) == 0 and int(cup[0]) == 0, "cu_seqlens must start at 0"
    assert int(cup[-1]) == T == batch.num_packs * batch.capacity, "cu_seqlens_padded[-1] != T"
    lengths, spans = batch.doc_lengths, cup[1:] - cup[:-1]
    assert bool((lengths > 0).all()), "zero-length document"
    assert bool((spans >= lengths).all()), "padded span shorter than its document"
    assert bool((spans % batch.align == 0).all()), "padded span not a multiple of align"
    assert batch.max_seqlen == int(spans.max()), "max_seqlen != longest padded span"
    assert batch.num_tokens == int(cu[-1]), "num_tokens != cu_seqlens[-1]"
    ignore = batch.ignore_index
    assert batch.num_targets == int((batch.labels != ignore).sum()), "num_targets mismatch"
    starts, ends = cup[:-1].long(), (cup[:-1] + lengths).long()
    real = torch.zeros(T, dtype=torch.bool)
    for s, e, ps in zip(starts.tolist(), ends.tolist(), cup[1:].tolist()):
        assert int(batch.position_ids[s]) == 0, f"position does not restart at {s}"
        assert torch.equal(batch.position_ids[s:ps], torch.arange(ps - s)), "positions not arange"
        assert int(batch.labels[e - 1]) == ignore, f"label crosses the boundary at {e}"
        real[s:e] = True
    assert bool((batch.labels[~real] == ignore).all()), "padding carries a label"
    assert bool((batch.input_ids[~real] == batch.pad_id).all()), "padding is not pad_id"
    pack_of_start = starts // batch.capacity
    pack_of_end = (ends - 1) // batch.capacity
    assert torch.equal(pack_of_start, pack_of_end), "a document crosses a pack boundary"
    if docs is not None:
        got = [batch.input_ids[s:e].tolist() for s, e in zip(starts.tolist(), ends.tolist())]
        assert got == [list(map(int, d)) for d in docs], "tokens not conserved"
