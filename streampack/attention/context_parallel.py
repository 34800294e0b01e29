"""Per-rank attention inputs under context parallelism, and the way back to document order.

Rank ``r`` of ``W`` holds, from every document (padded span ``L``, chunk ``c = L / 2W``), chunks
``A = [r·c, (r+1)·c)`` and ``B = [(2W−1−r)·c, (2W−r)·c)`` (:mod:`streampack.layout.cp`):

* **Transformer Engine / Megatron**: local tokens with the *global* ``cu_seqlens``
  (:func:`streampack.layout.adapters.te_kwargs` unchanged; TE divides by ``cp_size`` itself).
* **flash-attn / torch varlen** (all-gather-KV): every local chunk is its own query span, and its
  key span its document's prefix up to the chunk's end (``k_indices`` into the gathered K/V;
  bottom-right causal alignment makes that exact). Gathered K/V costs ~1.5x a full batch per
  rank: a correctness path, not a ring kernel.
* **SDPA reference**: ``sdpa_packed(q_local, k_full, v_full, shard)``.

Outputs come back with :func:`streampack.layout.cp.cp_unshard`. HF models: use CP = 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from streampack.layout.adapters import KwargsRecord, TEKwargs, packed_seq_params, te_kwargs
from streampack.layout.batch import PackedBatch
from streampack.layout.cp import CPShard, cp_shard


@dataclass(init=False, slots=True, kw_only=True, eq=False)  # a KwargsRecord (see adapters)
class CPFlashAttnKwargs(KwargsRecord):
    """``flash_attn_varlen_func`` arguments for one CP rank (pass ``causal=True``): the local
    queries against ``k_full[k_indices]`` / ``v_full[k_indices]``."""

    cu_seqlens_q: torch.Tensor
    """int32 ``[2n+1]``: the rank's chunks A and B of every document, in local token order."""
    cu_seqlens_k: torch.Tensor
    """int32 ``[2n+1]``: each chunk's key span, a prefix of its document."""
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class CPFlashAttnInputs:
    """One rank's varlen-attention inputs: ``flash_attn_varlen_func(q_local, k_full[k_indices],
    v_full[k_indices], **kwargs, causal=True)``."""

    kwargs: CPFlashAttnKwargs
    k_indices: torch.Tensor
    """int64 ``[sum of key spans]``: rows of the gathered, document-ordered K/V."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class CPRankInputs:
    """Everything CP rank ``shard.cp_rank`` feeds its attention layers."""

    shard: CPShard
    """Local tokens, labels, global positions, ``seq_idx`` and ``indices`` (= query rows)."""
    te: TEKwargs
    """Global-boundary TE ``thd`` kwargs (the same for every rank)."""
    packed_seq_params: Any
    """Megatron ``PackedSeqParams`` (or the local stand-in) with the same tensors."""
    flash: CPFlashAttnInputs


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of ``arange(s, s + n)`` over ``zip(starts, lengths)`` (int64)."""
    ends = torch.cumsum(lengths, 0)
    total = int(ends[-1]) if len(ends) else 0
    offsets = torch.arange(total) - torch.repeat_interleave(ends - lengths, lengths)
    return torch.repeat_interleave(starts, lengths) + offsets


def _cu(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)]).to(torch.int32)


def cp_flash_attn_inputs(batch: PackedBatch, cp_size: int, cp_rank: int) -> CPFlashAttnInputs:
    """Rank ``cp_rank``'s all-gather-KV varlen attention inputs (see the module doc)."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"{cp_rank=} must be in [0, {cp_size=})")
    cup = batch.cu_seqlens_padded.to("cpu", torch.int64)
    spans = cup[1:] - cup[:-1]
    if bool((spans % (2 * cp_size)).any()):
        raise ValueError(f"every padded span must be a multiple of 2*cp_size={2 * cp_size}; "
                         f"build the batch with align=2*cp_size*tp_size (spans {spans.tolist()})")
    chunk = spans // (2 * cp_size)
    q_lengths = chunk.repeat_interleave(2)
    k_lengths = torch.stack([(cp_rank + 1) * chunk, (2 * cp_size - cp_rank) * chunk], 1).reshape(-1)
    k_indices = _ranges(cup[:-1].repeat_interleave(2), k_lengths)
    device = batch.input_ids.device
    kwargs = CPFlashAttnKwargs(cu_seqlens_q=_cu(q_lengths).to(device).contiguous(),
                               cu_seqlens_k=_cu(k_lengths).to(device).contiguous(), max_seqlen_q=int(q_lengths.max()),
                               max_seqlen_k=int(k_lengths.max()))
    return CPFlashAttnInputs(kwargs=kwargs, k_indices=k_indices.to(device))


def cp_rank_inputs(batch: PackedBatch, cp_size: int, cp_rank: int) -> CPRankInputs:
    """The shard and every adapter's per-rank inputs for rank ``cp_rank`` of ``cp_size``."""
    return CPRankInputs(shard=cp_shard(batch, cp_size, cp_rank), te=te_kwargs(batch),
                        packed_seq_params=packed_seq_params(batch), flash=cp_flash_attn_inputs(batch, cp_size, cp_rank))
