"""Leak probe: does a model keep packed documents apart? Perturb one, watch the others.

It runs ``forward(batch)`` twice, the second time with one document's tokens changed: every
*other* document's outputs must be bit-identical (or within ``atol``), and the perturbed one's
must change, so a model that ignores its input cannot pass vacuously::

    report = leak_probe(lambda b: model(**b.hf_inputs()).logits[0], batch, vocab_size=32000)
    assert not report.leaked, report
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from streampack.layout.batch import PackedBatch


@dataclass(frozen=True, slots=True, kw_only=True)
class LeakReport:
    """What the probe saw when document ``doc`` was perturbed."""

    doc: int
    """Index of the perturbed document."""
    max_diff_other_docs: float
    """Largest absolute change at the real tokens of every other document (0.0 = isolated)."""
    max_diff_self: float
    """Largest change at the perturbed document's own tokens (> 0 proves the probe bites)."""
    leaked: bool
    """``max_diff_other_docs > atol``: information crossed a document boundary."""


def leak_probe(forward: Callable[[PackedBatch], torch.Tensor], batch: PackedBatch, *,
               vocab_size: int, doc: int = 0, atol: float = 0.0) -> LeakReport:
    """Perturb document ``doc`` of ``batch`` (every token id ``t -> (t + 1) % vocab_size``) and
    compare ``forward``'s ``[T, ...]`` outputs at every other document's real tokens."""
    if batch.num_docs < 2:
        raise ValueError(f"leak_probe needs a batch with at least 2 documents, got {batch.num_docs}")
    if not 0 <= doc < batch.num_docs:
        raise ValueError(f"{doc=} must be in [0, {batch.num_docs})")
    seq_idx = batch.seq_idx.to(batch.input_ids.device).long()
    starts = batch.cu_seqlens_padded[:-1].to(seq_idx.device).long()
    real = (torch.arange(batch.total_tokens, device=seq_idx.device) - starts[seq_idx]) \
        < batch.doc_lengths.to(seq_idx.device).long()[seq_idx]
    mine = real & (seq_idx == doc)
    ids = batch.input_ids.clone()
    ids[mine] = (ids[mine] + 1) % vocab_size
    with torch.no_grad():
        before = forward(batch)
        after = forward(replace(batch, input_ids=ids))
    if before.shape[0] != batch.total_tokens:
        raise ValueError(f"forward must return [T, ...] with T={batch.total_tokens}, got {tuple(before.shape)}")
    a, b = after.float(), before.float()
    diff = (a - b).abs()
    # NaN compares as "no change" under max/>: a NaN that appears (or vanishes) is a change of
    # infinite size; only a NaN present in both runs at the same place is "unchanged".
    diff = torch.where(torch.isnan(a) & torch.isnan(b), torch.zeros_like(diff), diff)
    diff = torch.nan_to_num(diff, nan=float("inf"))
    diff = diff.reshape(batch.total_tokens, -1).amax(dim=1)
    others = real & (seq_idx != doc)
    other = float(diff[others].max()) if bool(others.any()) else 0.0
    return LeakReport(doc=doc, max_diff_other_docs=other, max_diff_self=float(diff[mine].max()), leaked=other > atol)
