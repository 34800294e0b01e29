"""A tiny GPT that runs either a padded ``[B, S]`` batch with a mask or a packed PackedBatch.

Both paths share every weight; only the attention mask differs. Packed attention goes through
:func:`streampack.attention.sdpa_packed` (exact, O(T²) mask: fine for examples and tests, not
for real training, where a varlen kernel takes ``batch.flash_attn_kwargs()``).

    model = TinyGPT(vocab=128, dim=64, layers=2, heads=4)
    logits = model(batch.input_ids, position_ids=batch.position_ids, packed=batch)   # [T, V]
    logits = model(ids, attention_mask=mask)                                          # [B, S, V]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from streampack.attention.reference import PackedMeta, sdpa_packed


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"{dim=} must be a multiple of {heads=}")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor | None = None,
                packed: PackedMeta | None = None) -> torch.Tensor:
        """x: ``[T, dim]`` with ``packed``, or ``[B, S, dim]`` with a bool ``mask [B, 1, S, S]``."""
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).unbind(-3)  # [..., S, H, D]
        if packed is not None:
            out = sdpa_packed(q, k, v, packed, causal=True)
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            ).transpose(1, 2)
        return self.proj(out.flatten(-2))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor | None = None,
                packed: PackedMeta | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask=mask, packed=packed)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Decoder-only LM with learned absolute positions (so ``position_ids`` matter)."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, max_len: int = 1024) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                packed: PackedMeta | None = None) -> torch.Tensor:
        """Packed: ``input_ids [T]``, ``position_ids [T]``, ``packed`` (a PackedBatch or CPShard-like
        record) -> ``[T, V]``. Padded: ``input_ids [B, S]``, optional right-padding
        ``attention_mask [B, S]`` (True/1 = real) -> ``[B, S, V]``."""
        mask = None
        if packed is not None:
            if input_ids.dim() != 1:
                raise ValueError(f"packed input_ids must be [T], got {tuple(input_ids.shape)}")
            if position_ids is None:
                position_ids = packed.position_ids  # type: ignore[attr-defined]
        else:
            if input_ids.dim() != 2:
                raise ValueError(f"padded input_ids must be [B, S], got {tuple(input_ids.shape)}")
            S = input_ids.shape[1]
            if position_ids is None:
                position_ids = torch.arange(S, device=input_ids.device).expand_as(input_ids)
            mask = torch.ones(S, S, dtype=torch.bool, device=input_ids.device).tril()[None, None]
            if attention_mask is not None:
                mask = mask & attention_mask.bool()[:, None, None, :]
        x = self.tok(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x, mask=mask, packed=packed)
        return self.head(self.ln_f(x))


def packed_forward(model: TinyGPT, batch: PackedMeta) -> torch.Tensor:
    """``[T, V]`` logits of a PackedBatch."""
    return model(batch.input_ids, position_ids=batch.position_ids, packed=batch)  # type: ignore[attr-defined]
