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

    # Consumer adapters live in streampack.attention.adapters (documented there); these are
    # their front doors, so `model(**batch.hf_inputs())` needs no extra import.
    def flash_attn_kwargs(self, *, causal: bool = True) -> Any:
        from streampack.attention.adapters import flash_attn_kwargs

        return flash_attn_kwargs(self, causal=causal)

    def te_kwargs(self, *, causal: bool = True) -> Any:
        from streampack.attention.adapters import te_kwargs

        return te_kwargs(self, causal=causal)

    def packed_seq_params(self, *, causal: bool = True) -> Any:
        from streampack.attention.adapters import packed_seq_params

        return packed_seq_params(self, causal=causal)

    def hf_inputs(self) -> Any:
        from streampack.attention.adapters import hf_inputs

        return hf_inputs(self)


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


_HF_IGNORE = -100
"""What :class:`~streampack.sample.Sample` labels use for "not supervised" (HF convention)."""
_INT64_MAX = np.iinfo(np.int64).max


def _as_array(value: Any, what: str, key: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            value = value.float()  # numpy has no bfloat16; float32 holds every value exactly
        value = value.numpy()
    arr = np.asarray(value)
    if arr.ndim != 1 and what in ("tokens", "labels", "loss_mask"):
        raise ValueError(f"{what} of document {key!r} must be 1-D, got shape {arr.shape}")
    if arr.ndim == 0:
        raise ValueError(f"extra {what!r} of document {key!r} must be per-token [L, ...], "
                         f"got a scalar")
    return arr


def _as_ids(arr: np.ndarray, what: str, key: str) -> np.ndarray:
    """Integer ids as int64; non-integral floats or values past int64 are a ``ValueError``
    (a silent cast would truncate 1.5 to 1, or wrap 2**63 to a negative id)."""
    if arr.dtype == np.bool_ or not (np.issubdtype(arr.dtype, np.integer)
                                     or np.issubdtype(arr.dtype, np.floating)):
        if arr.size:
            raise ValueError(f"{what} of document {key!r} must be integer ids, got {arr.dtype}")
        return arr.astype(np.int64, copy=False)
    if np.issubdtype(arr.dtype, np.floating):
        if arr.size and not (np.isfinite(arr).all() and (arr == np.round(arr)).all()):
            raise ValueError(f"{what} of document {key!r} must be integer ids, got non-integral "
                             f"{arr.dtype} values")
    if arr.size and arr.dtype == np.uint64 and int(arr.max()) > _INT64_MAX:
        raise ValueError(f"{what} of document {key!r} has id {int(arr.max())} past int64")
    return arr.astype(np.int64, copy=False)


def _normalize(doc: Any, index: tuple[int, int]) -> Sample:
    """Accept a Sample, a mapping (``input_ids``/``tokens``, ``labels``, ``loss_mask``, ``key``,
    other keys = extras) or a plain sequence of token ids."""
    if isinstance(doc, Sample):
        return doc
    default_key = f"pack{index[0]}/doc{index[1]}"
    if isinstance(doc, Mapping):
        doc = dict(doc)
        key = str(doc.pop("key", default_key))
        tokens = doc.pop("input_ids", doc.pop("tokens", None))
        if tokens is None:
            raise ValueError(f"document {key!r} has no 'input_ids' (keys: {sorted(doc)})")
        labels = doc.pop("labels", None)
        mask = doc.pop("loss_mask", None)
        return Sample(
            key=key,
            tokens=_as_array(tokens, "tokens", key),
            labels=None if labels is None else _as_array(labels, "labels", key),
            loss_mask=None if mask is None else _as_array(mask, "loss_mask", key),
            extras={k: _as_array(v, k, key) for k, v in doc.items()},
        )
    return Sample(key=default_key, tokens=_as_array(doc, "tokens", default_key))


def _check_doc(doc: Sample, ignore_index: int) -> Sample:
    """Validate one document's per-token fields against its tokens; ids become int64 and a
    label of ``-100`` (the Sample convention for "not supervised") becomes ``ignore_index``."""
    key = doc.doc_key
    if doc.tokens is None:
        raise ValueError(f"sample {key!r} is not tokenized yet")
    tokens = _as_ids(_as_array(doc.tokens, "tokens", key), "tokens", key)
    n = tokens.shape[0]
    labels = doc.labels
    if labels is not None:
        labels = _as_ids(_as_array(labels, "labels", key), "labels", key)
        if labels.shape[0] != n:
            raise ValueError(f"labels of document {key!r} have {labels.shape[0]} entries for "
                             f"{n} tokens")
        labels = np.where(labels == _HF_IGNORE, ignore_index, labels)
        bad = (labels < 0) & (labels != ignore_index)
        if bad.any():
            raise ValueError(f"labels of document {key!r} hold {int(labels[bad][0])}: a label is "
                             f"a token id, -100 or ignore_index={ignore_index}")
    mask = doc.loss_mask
    if mask is not None:
        mask = _as_array(mask, "loss_mask", key)
        if mask.shape[0] != n:
            raise ValueError(f"loss_mask of document {key!r} has {mask.shape[0]} entries for "
                             f"{n} tokens")
    extras = {k: _as_array(v, k, key) for k, v in doc.extras.items()}
    return replace(doc, tokens=tokens, labels=labels, loss_mask=mask, extras=extras)


def _targets(doc: Sample, ignore_index: int) -> np.ndarray:
    """Unshifted per-token targets of one document (token i's target value, or ignore)."""
    target = doc.tokens if doc.labels is None else doc.labels
    if doc.loss_mask is not None:
        target = np.where(doc.loss_mask.astype(bool), target, ignore_index)
    return target


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return int(value)


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
    docs = [[_check_doc(_normalize(d, (p, i)), ignore_index) for i, d in enumerate(pack)]
            for p, pack in enumerate(packs)]
    extra_names = _check_extras(docs)
    input_ids = np.full(total, pad_id, dtype=np.int64)
    labels = np.full(total, ignore_index, dtype=np.int64)
    positions = np.empty(total, dtype=np.int64)
    extras = _alloc_extras(docs, extra_names, total)
    real = [0]
    padded = [0]
    keys: list[str] = []
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
                end = (p + 1) * capacity  # trailing pack padding joins the last span
            input_ids[start:start + n] = doc.tokens
            labels[start:start + n - 1] = _targets(doc, ignore_index)[1:]
            positions[start:end] = np.arange(end - start)
            for name in extra_names:
                extras[name][start:start + n] = doc.extras[name]
            real.append(real[-1] + n)
            padded.append(end)
            keys.append(doc.doc_key)
            start = end
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


def _check_extras(docs: list[list[Sample]]) -> list[str]:
    """Extra names, present on every document with the same trailing shape: numpy would
    otherwise broadcast a ``[L, 1]`` (or, when ``L`` happens to match, an ``[L]``) extra into
    another document's ``[L, 3]`` layout without a word."""
    flat = [d for pack in docs for d in pack]
    names = sorted(flat[0].extras) if flat else []
    for d in flat:
        if sorted(d.extras) != names:
            raise ValueError(f"document {d.doc_key!r} has extras {sorted(d.extras)}, "
                             f"others have {names}")
        for name in names:
            if d.tokens is not None and d.extras[name].shape[0] != len(d):
                raise ValueError(f"extra {name!r} of document {d.doc_key!r} has "
                                 f"{d.extras[name].shape[0]} rows for {len(d)} tokens")
            trailing, first = d.extras[name].shape[1:], flat[0].extras[name].shape[1:]
            if trailing != first:
                raise ValueError(f"extra {name!r} of document {d.doc_key!r} has per-token shape "
                                 f"{trailing}, document {flat[0].doc_key!r} has {first}")
    return names


def _alloc_extras(docs: list[list[Sample]], names: list[str], total: int) -> dict[str, np.ndarray]:
    """Zero-filled ``[T, ...]`` arrays; the dtype holds every document's values (an int extra
    of one document and a float extra of another give float, never a truncating cast)."""
    flat = [d for pack in docs for d in pack]
    out = {}
    for name in names:
        dtype = np.result_type(*(d.extras[name].dtype for d in flat))
        out[name] = np.zeros((total, *flat[0].extras[name].shape[1:]), dtype=dtype)
    return out


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
