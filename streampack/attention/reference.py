"""Exact packed attention in plain torch: the CPU fallback and the yardstick for kernels.

``sdpa_packed`` runs ``F.scaled_dot_product_attention`` once over ``[T]`` with a ``bool[T, T]`` mask: O(T²) memory (``T
= 8192`` is 64 MiB), so a reference, not a training kernel. ``flex_block_mask`` expresses the same mask for
FlexAttention, which skips fully masked blocks (forward only on CPU, ~30 s to compile).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F


class PackedMeta(Protocol):
    """Anything carrying the two offset tensors: a PackedBatch, a CPShard, a small record."""

    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor


def _doc_layout(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor,
                total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(document index int64 ``[T]``, is-real-token bool ``[T]``)."""
    cup = cu_seqlens_padded.to(torch.int64)
    if int(cup[-1]) != total:
        raise ValueError(f"cu_seqlens_padded[-1]={int(cup[-1])} must equal {total=}")
    if cu_seqlens.shape != cu_seqlens_padded.shape:
        raise ValueError(f"cu_seqlens {tuple(cu_seqlens.shape)} and cu_seqlens_padded "
                         f"{tuple(cu_seqlens_padded.shape)} must have the same shape")
    spans = cup[1:] - cup[:-1]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    doc = torch.repeat_interleave(torch.arange(len(spans), device=cup.device), spans)
    offset = torch.arange(total, device=cup.device) - cup[:-1][doc]
    return doc, offset < lengths[doc]


def packed_attention_mask(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor,
                          total: int, causal: bool = True) -> torch.Tensor:
    """bool ``[T, T]``: True where query ``q`` may attend to key ``k``: the same padded span, ``k`` a
    real token and (if ``causal``) ``k <= q``. Every row keeps its document's first token."""
    doc, real = _doc_layout(cu_seqlens, cu_seqlens_padded, total)
    mask = (doc[:, None] == doc[None, :]) & real[None, :]
    if causal:
        mask &= torch.ones(total, total, dtype=torch.bool, device=mask.device).tril()
    return mask


def _meta_mask(meta: PackedMeta, causal: bool) -> torch.Tensor:
    total = int(meta.cu_seqlens_padded[-1])
    return packed_attention_mask(meta.cu_seqlens, meta.cu_seqlens_padded, total, causal)


def sdpa_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch_or_meta: PackedMeta, causal: bool = True, *,
                q_indices: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Packed attention via ``F.scaled_dot_product_attention``: q ``[Tq, H, D]``, k, v ``[T, Hkv, D]``
    over the whole batch (``Hkv`` may divide ``H``), returns ``[Tq, H, D]``. Under context parallelism
    ``q`` holds one rank's tokens: give ``q_indices`` or a :class:`~streampack.layout.cp.CPShard`."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q_indices is None:
        q_indices = getattr(batch_or_meta, "indices", None)
    mask = _meta_mask(batch_or_meta, causal).to(q.device)
    if mask.shape[1] != k.shape[0]:
        raise ValueError(f"k has {k.shape[0]} tokens, the batch layout has {mask.shape[1]}")
    if q_indices is not None:
        mask = mask[q_indices.to(mask.device)]
    if mask.shape[0] != q.shape[0]:
        raise ValueError(f"q has {q.shape[0]} tokens, expected {mask.shape[0]} "
                         "(pass q_indices for a context-parallel shard)")
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(0, 1)


def varlen_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                               causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """What ``flash_attn_varlen_func`` computes, one span at a time, in plain torch: span ``i`` of ``q``
    attends to span ``i`` of ``k``, causal aligned bottom-right when ``Lq != Lk``, as flash-attn does."""
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same number of spans")
    out = q.new_empty(q.shape)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        lq, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        mask = None
        if causal:
            mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
        o = F.scaled_dot_product_attention(q[qs].transpose(0, 1), k[ks].transpose(0, 1), v[ks].transpose(0, 1),
                                           attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        out[qs] = o.transpose(0, 1)
    return out


def flex_block_mask(batch_or_meta: PackedMeta, causal: bool = True, device: str | torch.device | None = None) -> Any:
    """A FlexAttention ``BlockMask`` for the packed layout (same mask as
    :func:`packed_attention_mask`). Use with ``flex_attention(q, k, v, block_mask=...)`` on
    ``[1, H, T, D]`` tensors; wrap ``flex_attention`` in ``torch.compile`` for speed."""
    from torch.nn.attention.flex_attention import create_block_mask

    total = int(batch_or_meta.cu_seqlens_padded[-1])
    device = torch.device(device) if device is not None else batch_or_meta.cu_seqlens.device
    doc, real = _doc_layout(batch_or_meta.cu_seqlens.to(device), batch_or_meta.cu_seqlens_padded.to(device), total)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        allowed = (doc[q_idx] == doc[kv_idx]) & real[kv_idx]
        return allowed & (kv_idx <= q_idx) if causal else allowed

    return create_block_mask(mask_mod, None, None, total, total, device=str(device))
