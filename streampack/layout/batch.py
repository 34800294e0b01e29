"""The THD micro-batch: documents back to back on one token axis, with ``cu_seqlens``.

Worked example (``capacity=8, align=2``; documents ``a`` of 3 tokens and ``b`` of 2)::

    input_ids          a0 a1 a2 P  b0 b1 P  P        (stored, int32; P = pad_id)
    cu_seqlens         [0, 3, 5]                     (stored, int32: real lengths)
    cu_seqlens_padded  [0, 4, 8]                     (stored, int32: aligned spans; the trailing pack
                                                      padding joins the pack's last span)
    labels             a1 a2 -  -  b1 -  -  -        (derived, int64; - = ignore_index; already shifted)
    position_ids       0  1  2  3  0  1  2  3        (derived, int64: restart at every padded span)

Every span of ``cu_seqlens_padded`` is a multiple of ``align``; ``cu_seqlens_padded[-1] == T``. What is stored and
what is derived, and why: :mod:`streampack.layout.derive`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch

from streampack.layout import adapters, transfer
from streampack.layout.derive import Derived, check_int32, check_int32_ids, derive, fits_int32, target_counts
from streampack.layout.documents import alloc_extras, check_doc, check_extras, normalize, targets
from streampack.layout.spans import doc_places, longest, offset_fields, span_index, varlen_offsets
from streampack.layout.stats import WorkerStats
from streampack.layout.vision_adapters import hf_vision_inputs
from streampack.layout.vision_batch import VisionBatch, VisionLayout, vision_batch
from streampack.sample import Sample

_INT32_MAX = 2**31 - 1


class _DerivedSlot:
    """The slot caching a batch's derived fields: not a dataclass field, so ``fields()``, ``replace``, the worker
    hand-over, pickling and copies (``__getstate__`` below) never carry it, and a rebuilt batch derives again."""

    __slots__ = ("_derived",)


# Not frozen (treat it as immutable): Lightning's apply_to_collection, run on every batch by its precision
# plugins and FSDP / DeepSpeed input conversion, rebuilds a dataclass by setattr and refuses a frozen one. It
# deep-copies the batch and sets the moved tensors on the copy, which is why the cache is left out of copies and
# also records the tensors it was derived from.
@dataclass(slots=True, kw_only=True, eq=False)
class PackedBatch(_DerivedSlot):
    """One micro-batch of ``num_packs`` packs of ``capacity`` tokens, flattened to ``T`` tokens.

    Stores ``input_ids``, the offsets and the samples' own supervision; ``labels`` and ``position_ids`` are
    derived on first access, on the device the batch is on, and cached (:mod:`streampack.layout.derive`)."""

    input_ids: torch.Tensor
    """int32 ``[T]``: all documents back to back, each followed by its alignment padding."""
    cu_seqlens: torch.Tensor
    """int32 ``[n+1]``: cumulative real lengths of the ``n`` documents."""
    cu_seqlens_padded: torch.Tensor
    """int32 ``[n+1]``: token offsets of the documents' padded spans; last entry ``== T``."""
    max_seqlen: int
    """Longest padded span (what kernels size their grid by)."""
    varlen_cu_seqlens: torch.Tensor
    """int32 ``[m+1]``: span offsets for causal varlen kernels (flash-attn, torch's
    ``varlen_attn``, HF ``flash_attention_2``): each document's span holds its alignment
    padding, a pack's trailing padding is its own span (:mod:`streampack.layout.spans`)."""
    varlen_max_seqlen: int
    """Longest span of ``varlen_cu_seqlens``."""
    varlen_cu_seqlens_bidirectional: torch.Tensor
    """int32: the spans for bidirectional attention (every padding run its own span); the same
    tensor object as ``varlen_cu_seqlens`` when ``align == 1``."""
    varlen_max_seqlen_bidirectional: int
    num_tokens: int
    """Real (non-padding) tokens."""
    num_targets: int
    """Positions whose label is not ``ignore_index``: the token-mean loss denominator."""
    num_target_docs: int
    """Documents with at least one target: the per-document-mean loss denominator."""
    doc_keys: tuple[str, ...]
    """Provenance of each document (``url#key``, plus ``/chunk`` when split)."""
    capacity: int
    num_packs: int
    align: int = 1
    pad_id: int = 0
    ignore_index: int = -100
    loss_mask: torch.Tensor | None = None
    """bool ``[T]``: token ``t`` is a target (unshifted; False at padding), stored when a sample carried a loss mask
    and none carried labels; None otherwise."""
    target_ids: torch.Tensor | None = None
    """int32 ``[T]``: token ``t``'s target id (unshifted; ``ignore_index`` where none, at padding and where a
    loss mask is 0), stored when a sample carried explicit labels; None otherwise."""
    extras: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Per-token side tensors ``[T, ...]`` packed with the same layout, zero-padded."""
    est_cost: float | None = None
    """``linear × num_tokens + attention × Σ L²`` of the stream's ``CostOptions(model=)``, else None."""
    vision: VisionBatch | None = None
    """The images of the batch's documents (:mod:`streampack.layout.vision_batch`); None for text streams."""
    stats: WorkerStats | None = None
    """Running totals of the reader that built this batch (None from :func:`pack_batch` directly)."""

    @property
    def labels(self) -> torch.Tensor:
        """int64 ``[T]``: next-token target of each position (already shifted); ``ignore_index`` at each
        document's last token, at padding and wherever the sample's loss mask is 0. Derived, cached."""
        return self._derive().labels

    @property
    def position_ids(self) -> torch.Tensor:
        """int64 ``[T]``: ``arange`` over each padded span, restarting at 0 at every document. Derived, cached."""
        return self._derive().position_ids

    def _derive(self) -> Derived:
        sources = (self.input_ids, self.cu_seqlens, self.cu_seqlens_padded, self.loss_mask, self.target_ids)
        got: Derived | None = getattr(self, "_derived", None)
        if got is None or got.ignore_index != self.ignore_index or any(
                a is not b for a, b in zip(got.sources, sources)):
            got = self._derived = derive(*sources, self.ignore_index)
        return got

    def __getstate__(self) -> tuple[None, dict[str, Any]]:
        """The fields only (pickle and ``copy`` would otherwise carry the cache's tensors along)."""
        return None, {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def num_docs(self) -> int:
        return len(self.doc_keys)

    @property
    def total_tokens(self) -> int:
        """``T`` = ``num_packs * capacity``."""
        return int(self.input_ids.shape[0])

    @property
    def has_padding(self) -> bool:
        """Whether any span holds padding (``cu_seqlens != cu_seqlens_padded``), from Python ints."""
        return self.num_tokens != self.total_tokens

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
        return span_index(self.cu_seqlens_padded, self.total_tokens)

    @property
    def fill(self) -> float:
        """Real tokens / ``T``."""
        return self.num_tokens / self.total_tokens if self.total_tokens else 0.0

    def map_tensors(self, fn: Any) -> PackedBatch:
        """A copy with ``fn`` applied once to every tensor (a tensor shared by two fields stays shared)."""
        done: dict[int, torch.Tensor] = {}

        def once(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in done:
                done[id(t)] = fn(t)
            return done[id(t)]

        changes: dict[str, Any] = {f.name: once(v) for f in fields(self)
                                   if isinstance(v := getattr(self, f.name), torch.Tensor)}
        changes["extras"] = {k: once(v) for k, v in self.extras.items()}
        if self.vision is not None:
            changes["vision"] = self.vision.map_tensors(once)
        return replace(self, **changes)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """A copy on ``device``: moves only what is stored; the derived fields are derived there."""
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
        inputs = adapters.hf_inputs(self)
        return inputs if self.vision is None else hf_vision_inputs(self, inputs)


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


def _ready(doc: Any) -> bool:
    """A document :func:`check_doc` would pass unchanged (a Sample of 1-D integer ids that int64
    holds, no labels, loss mask or extras: what a pre-tokenized reader yields); skipping the
    check and its copy saves ~25 of the ~30 µs a document cost."""
    if type(doc) is not Sample or doc.labels is not None or doc.loss_mask is not None or doc.extras or doc.images:
        return False
    tokens = doc.tokens
    return type(tokens) is np.ndarray and tokens.ndim == 1 and (
        tokens.dtype.kind == "i" or (tokens.dtype.kind == "u" and tokens.dtype.itemsize < 8))


def pack_batch(packs: Sequence[Sequence[Any]], *, capacity: int, align: int = 1,
               pad_id: int = 0, ignore_index: int = -100, vision_layout: VisionLayout | None = None) -> PackedBatch:
    """Lay out ``packs`` (each a list of documents) as one THD :class:`PackedBatch`.

    A document is a :class:`~streampack.sample.Sample`, a mapping with ``input_ids`` (and optionally
    ``labels``, ``loss_mask``, ``key``, per-token extras) or a sequence of ids (:mod:`.documents`). Every
    pack occupies ``capacity`` tokens; each document is padded to a multiple of ``align`` and a pack's
    trailing padding joins its last span; a label ``-100`` becomes ``ignore_index``. ``vision_layout`` (a
    media stream's) gives every batch a ``vision``, images or not. Ids (and labels) that int32 cannot hold are a
    ``ValueError``.
    """
    capacity, align = _positive_int(capacity, "capacity"), _positive_int(align, "align")
    if capacity % align:
        raise ValueError(f"{capacity=} must be a multiple of {align=}")
    if not packs:
        raise ValueError("pack_batch needs at least one pack")
    check_int32(pad_id, "pad_id")
    total = len(packs) * capacity
    if total > _INT32_MAX:
        # cu_seqlens are int32 in every varlen kernel: offsets past 2**31-1 would wrap (fa#2611)
        raise ValueError(f"{len(packs)} packs x {capacity=} = {total} tokens overflows the int32 "
                         f"cu_seqlens of varlen kernels (max {_INT32_MAX})")
    docs = [[d if _ready(d) else check_doc(normalize(d, (p, i)), ignore_index) for i, d in enumerate(pack)]
            for p, pack in enumerate(packs)]
    extra_names = check_extras(docs)
    flat = [d for pack in docs for d in pack]
    keys = tuple(d.doc_key for d in flat)
    wide = [i for i, d in enumerate(flat) if not fits_int32(d.tokens.dtype)]
    check_int32_ids([flat[i].tokens for i in wide], [keys[i] for i in wide], "token id")
    lengths = np.fromiter((len(d) for d in flat), dtype=np.int64, count=len(flat))
    at, cu_padded = doc_places(lengths, [len(pack) for pack in docs], keys, capacity, align)
    starts = at.tolist()
    input_ids = torch.full((total,), pad_id, dtype=torch.int32)
    ids = input_ids.numpy()
    loss_mask, target_ids = _supervision(flat, total, ignore_index)
    mask, target = (None if t is None else t.numpy() for t in (loss_mask, target_ids))
    extras = alloc_extras(docs, extra_names, total)
    for doc, start, n in zip(flat, starts, lengths.tolist()):
        ids[start:start + n] = doc.tokens  # in int32 range: checked above
        if target is not None:
            target[start:start + n] = targets(doc, ignore_index)
        elif mask is not None:
            mask[start:start + n] = True if doc.loss_mask is None else doc.loss_mask
        for name in extra_names:
            extras[name][start:start + n] = doc.extras[name]
    batch = from_ids(input_ids, lengths, cu_padded, keys, capacity=capacity, align=align, pad_id=pad_id,
                     ignore_index=ignore_index, loss_mask=loss_mask, target_ids=target_ids)
    batch.extras = {k: torch.from_numpy(v) for k, v in extras.items()}
    batch.vision = vision_batch(flat, starts, batch.input_ids, batch.varlen_cu_seqlens, vision_layout)
    return batch


def _supervision(docs: list[Sample], total: int, ignore_index: int) -> tuple[torch.Tensor | None, ...]:
    """``(loss_mask, target_ids)`` to fill, as the documents need: explicit labels on any document store every
    target id (a loss mask folded in), a loss mask alone stores the mask, neither stores nothing."""
    if any(d.labels is not None for d in docs):
        check_int32(ignore_index, "ignore_index")
        wide = [i for i, d in enumerate(docs) if d.labels is not None and not fits_int32(d.labels.dtype)]
        check_int32_ids([docs[i].labels for i in wide], [docs[i].doc_key for i in wide], "label")
        return None, torch.full((total,), ignore_index, dtype=torch.int32)
    if any(d.loss_mask is not None for d in docs):
        return torch.zeros(total, dtype=torch.bool), None
    return None, None


def from_ids(input_ids: torch.Tensor, lengths: np.ndarray, cu_padded: np.ndarray, keys: tuple[str, ...], *,
             capacity: int, align: int, pad_id: int, ignore_index: int, loss_mask: torch.Tensor | None = None,
             target_ids: torch.Tensor | None = None, ids_avoid_ignore: bool = False) -> PackedBatch:
    """The batch of ``input_ids`` (int32 ``[T]``, written) whose documents of ``lengths`` (int ``[n]``) sit at the
    spans of ``cu_padded`` (int32 ``[n+1]``): offsets and counts in whole-batch operations, not one per document
    (``ids_avoid_ignore``: see :func:`~streampack.layout.derive.target_counts`)."""
    total = int(input_ids.shape[0])
    cu_real = np.zeros(lengths.size + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu_real[1:])
    num_targets, target_docs = target_counts(input_ids, cu_real, cu_padded, loss_mask, target_ids, ignore_index,
                                             ids_avoid_ignore=ids_avoid_ignore)
    offsets = offset_fields(cu_real, cu_padded, align)
    return PackedBatch(input_ids=input_ids, **offsets, max_seqlen=longest(cu_padded), num_tokens=int(cu_real[-1]),
                       num_targets=num_targets, num_target_docs=target_docs, doc_keys=keys, capacity=capacity,
                       num_packs=total // capacity, align=align, pad_id=pad_id, ignore_index=ignore_index,
                       loss_mask=loss_mask, target_ids=target_ids)


def check_invariants(batch: PackedBatch, docs: Sequence[Sequence[int]] | None = None) -> None:
    """Assert the PackedBatch invariants (``docs/batch.md``); with ``docs`` (token ids in layout order)
    also check token conservation. Raises ``AssertionError`` naming the broken invariant."""
    cu, cup = batch.cu_seqlens, batch.cu_seqlens_padded
    T = batch.total_tokens
    assert cu.dtype == torch.int32 and cup.dtype == torch.int32, "cu_seqlens must be int32"
    assert batch.input_ids.dtype == torch.int32, "input_ids must be int32"
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
    for name, causal in (("varlen_cu_seqlens", True), ("varlen_cu_seqlens_bidirectional", False)):
        got = getattr(batch, name).cpu().numpy()
        want = varlen_offsets(cup.cpu().numpy(), lengths.cpu().numpy(), batch.align, causal=causal)
        assert got.dtype == np.int32 and np.array_equal(got, want), f"{name} mismatch"
        assert getattr(batch, name.replace("cu_seqlens", "max_seqlen")) == longest(got), f"{name} max"
    starts, ends = cup[:-1].long(), (cup[:-1] + lengths).long()
    real = torch.zeros(T, dtype=torch.bool)
    for s, e, ps in zip(starts.tolist(), ends.tolist(), cup[1:].tolist()):
        assert int(batch.position_ids[s]) == 0, f"position does not restart at {s}"
        assert torch.equal(batch.position_ids[s:ps], torch.arange(ps - s)), "positions not arange"
        assert int(batch.labels[e - 1]) == ignore, f"label crosses the boundary at {e}"
        real[s:e] = True
    assert bool((batch.labels[~real] == ignore).all()), "padding carries a label"
    assert bool((batch.input_ids[~real] == batch.pad_id).all()), "padding is not pad_id"
    supervised = [bool((batch.labels[s:e] != ignore).any()) for s, e in zip(starts.tolist(), ends.tolist())]
    assert batch.num_target_docs == sum(supervised), "num_target_docs mismatch"
    pack_of_start = starts // batch.capacity
    pack_of_end = (ends - 1) // batch.capacity
    assert torch.equal(pack_of_start, pack_of_end), "a document crosses a pack boundary"
    if docs is not None:
        got = [batch.input_ids[s:e].tolist() for s, e in zip(starts.tolist(), ends.tolist())]
        assert got == [list(map(int, d)) for d in docs], "tokens not conserved"


# a worker hands batches to the training process as one byte blob (see the module for why)
transfer.register(PackedBatch)
transfer.register_record(WorkerStats)
