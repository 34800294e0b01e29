"""What a :class:`~streampack.layout.batch.PackedBatch` derives from what it stores.

Stored (4 bytes a token, 5 with a loss mask, 8 with explicit labels): ``input_ids`` int32 ``[T]``,
``cu_seqlens`` and ``cu_seqlens_padded`` int32 ``[n+1]``, and the supervision the samples carried, unshifted:
``loss_mask`` bool ``[T]`` (token ``t`` is a target) or ``target_ids`` int32 ``[T]`` (token ``t``'s target id,
``ignore_index`` where it is none; a loss mask given with labels is folded into them).

Derived, by whole-batch torch ops on the batch's device (no host sync: every output shape is ``T``)::

    position_ids[t] = t - s                     (document d's padded span is [s, s + P), its real length L)
    labels[t]       = target(t + 1)  if t - s < L - 1
                      ignore_index   otherwise  (its last token and its padding)

where ``target(u)`` is ``target_ids[u]`` when stored, else ``input_ids[u]``, and ``ignore_index`` where
``loss_mask[u]`` is False. Both are int64: cross entropy takes int64 targets, and HF / RoPE take int64 positions.
Deriving them where the batch is used, instead of writing them in the loader, saves 16-20 of the 24 bytes a token
the loader wrote, copied to the training process, pinned and sent to the device (``benchmarks/bench_compact.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


@dataclass(frozen=True, slots=True)
class Derived:
    """The derived fields of one batch, and the stored values they were derived from."""

    sources: tuple[torch.Tensor | None, ...]
    """``(input_ids, cu_seqlens, cu_seqlens_padded, loss_mask, target_ids)``: a batch whose tensors are not these
    very objects (moved to a device, rebuilt by setattr) derives again."""
    ignore_index: int
    labels: torch.Tensor
    """int64 ``[T]``."""
    position_ids: torch.Tensor
    """int64 ``[T]``."""


def derive(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor,
           loss_mask: torch.Tensor | None, target_ids: torch.Tensor | None, ignore_index: int) -> Derived:
    """``labels`` and ``position_ids`` (module docstring) on ``input_ids``' device."""
    total = int(input_ids.shape[0])
    device = input_ids.device
    padded = cu_seqlens_padded.to(device=device, dtype=torch.int64)
    spans = padded[1:] - padded[:-1]
    doc = torch.repeat_interleave(torch.arange(spans.shape[0], device=device), spans, output_size=total)
    positions = torch.arange(total, device=device) - padded[doc]
    last = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device=device, dtype=torch.int64) - 1
    drop = positions >= last[doc]  # a document's last token and its padding predict nothing
    source = input_ids if target_ids is None else target_ids.to(device)
    labels = torch.empty(total, dtype=torch.int64, device=device)
    labels[:-1] = source[1:]
    if loss_mask is not None:
        drop[:-1] |= ~loss_mask[1:].to(device=device, dtype=torch.bool)
    labels.masked_fill_(drop, ignore_index)  # drop[-1] is always set: the last token is a last token or padding
    sources = (input_ids, cu_seqlens, cu_seqlens_padded, loss_mask, target_ids)
    return Derived(sources=sources, ignore_index=ignore_index, labels=labels, position_ids=positions)


def target_counts(input_ids: torch.Tensor, cu_seqlens: np.ndarray, cu_seqlens_padded: np.ndarray,
                  loss_mask: torch.Tensor | None, target_ids: torch.Tensor | None, ignore_index: int, *,
                  ids_avoid_ignore: bool = False) -> tuple[int, int]:
    """``(num_targets, num_target_docs)`` of the host batch: labels that are not ``ignore_index``, and documents
    with at least one. Without supervision and with no id equal to ``ignore_index`` (``ids_avoid_ignore``: the
    caller knows; else one compare over ``input_ids``) they are ``Σ (L - 1)`` and the documents of 2+ tokens;
    otherwise counted position by position with the rule :func:`derive` applies (numpy, a few passes over ``T``)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # np.diff's checks cost ~5 µs a batch
    if loss_mask is None and target_ids is None and (
            ids_avoid_ignore or not INT32_MIN <= ignore_index <= INT32_MAX
            or not bool((input_ids.numpy() == ignore_index).any())):
        return int(lengths.sum()) - lengths.size, int(np.count_nonzero(lengths > 1))
    total = int(input_ids.shape[0])
    starts = cu_seqlens_padded[:-1].astype(np.int64)
    # has[t]: t predicts something (inside its document, not its last token): +1 at each start, -1 at each last
    edges = np.zeros(total + 1, dtype=np.int32)
    edges[starts] += 1  # starts are distinct, and so are lasts: no repeated index within one update
    edges[starts + lengths - 1] -= 1
    has = np.cumsum(edges[:-1], dtype=np.int32) > 0
    source = (input_ids if target_ids is None else target_ids).numpy()
    kept = np.zeros(total, dtype=bool)
    np.not_equal(source[1:], ignore_index, out=kept[:-1])
    if loss_mask is not None:
        kept[:-1] &= loss_mask.numpy()[1:]
    kept &= has
    per_doc = np.add.reduceat(kept.view(np.uint8), starts, dtype=np.int64)
    return int(per_doc.sum()), int(np.count_nonzero(per_doc))


def check_int32(value: int, name: str) -> int:
    """``value`` when int32 holds it (what ``input_ids`` and ``target_ids`` are stored as), else a ValueError."""
    if not INT32_MIN <= value <= INT32_MAX:
        raise ValueError(f"{name}={value} does not fit the int32 input_ids of a PackedBatch")
    return value


def check_int32_ids(arrays: list[np.ndarray], keys: list[str], what: str) -> None:
    """A ValueError naming the first document whose ids int32 cannot hold: ``input_ids`` are stored as int32, so
    a vocabulary over 2**31 is refused rather than wrapped (one pass over the batch's wide-typed ids)."""
    if not arrays:
        return
    every = np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
    if every.size and (int(every.min()) < INT32_MIN or int(every.max()) > INT32_MAX):
        for arr, key in zip(arrays, keys):
            if arr.size and (int(arr.min()) < INT32_MIN or int(arr.max()) > INT32_MAX):
                bad = int(arr[(arr < INT32_MIN) | (arr > INT32_MAX)][0])
                raise ValueError(f"{what} {bad} of document {key!r} does not fit int32: a PackedBatch stores "
                                 f"input_ids as int32, so a vocabulary over 2**31 is refused")


def fits_int32(dtype: np.dtype) -> bool:
    """Whether every value of ``dtype`` fits int32 (no check needed)."""
    return dtype.kind in "iub" and (dtype.itemsize < 4 or (dtype.itemsize == 4 and dtype.kind == "i"))
