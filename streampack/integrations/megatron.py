"""Megatron-core's packed (``thd``) inputs from a :class:`~streampack.layout.batch.PackedBatch`.

A Megatron GPT ``forward_step`` wants ``[1, T]`` tensors plus a ``PackedSeqParams``::

    mb = megatron_batch(batch.to("cuda", non_blocking=True))
    output = model(mb.tokens, mb.position_ids, mb.attention_mask, labels=mb.labels,
                   packed_seq_params=mb.packed_seq_params)       # per-token losses [1, T]
    loss_sum = (output.float() * mb.loss_mask).sum()            # / the step's global_num_targets

``labels`` carry a real id everywhere (0 where ignored, masked by ``loss_mask``): Megatron's
vocab-parallel cross entropy has no ignore index. ``packed_seq_params`` passes the same tensor
object for real and padded ``cu_seqlens`` when nothing is padded and ``max_seqlen`` as ints, so
Transformer Engine neither syncs nor leaves its FlashAttention backend. No host-device sync here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from streampack.layout.adapters import KwargsRecord, packed_seq_params
from streampack.layout.batch import PackedBatch


@dataclass(init=False, slots=True, kw_only=True, eq=False)
class MegatronBatch(KwargsRecord):
    """What a Megatron GPT ``get_batch`` returns, for one packed micro-batch."""

    tokens: torch.Tensor
    """int64 ``[1, T]``."""
    labels: torch.Tensor
    """int64 ``[1, T]``: next-token ids (already shifted), 0 where ``loss_mask`` is 0."""
    loss_mask: torch.Tensor
    """float32 ``[1, T]``: 1 at supervised positions."""
    position_ids: torch.Tensor
    """int64 ``[1, T]``: restart at 0 at every document."""
    attention_mask: None
    """Always ``None``: with ``thd`` the document boundaries are in ``packed_seq_params``."""
    packed_seq_params: Any
    """``megatron.core.packed_seq_params.PackedSeqParams``."""
    num_targets: int
    """Supervised positions of this micro-batch (sum them over the step for the loss)."""


def megatron_batch(batch: PackedBatch, *, causal: bool = True) -> MegatronBatch:
    """:class:`MegatronBatch` for ``batch`` (on the batch's device; no host sync)."""
    keep = batch.labels != batch.ignore_index
    return MegatronBatch(tokens=batch.input_ids.long().unsqueeze(0), labels=torch.where(keep, batch.labels, 0).unsqueeze(0),
                         loss_mask=keep.to(torch.float32).unsqueeze(0), position_ids=batch.position_ids.unsqueeze(0),
                         attention_mask=None, packed_seq_params=packed_seq_params(batch, causal=causal),
                         num_targets=batch.num_targets)
