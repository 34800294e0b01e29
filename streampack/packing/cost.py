"""Estimated compute cost of a pack: ``linear · tokens + attention · Σ L²``.

Packing balances tokens, but a pack's compute also grows with the square of each document's
length (causal attention), so two full packs can differ in cost: one 4096-token document
costs more than eight of 512. ``CostModel`` puts a number on that, from two coefficients
given directly or derived from a model shape. Pure numpy; no torch.

The FLOP formula (``CostModel.from_shape``), for a decoder of ``layers`` blocks with hidden
size h, ``heads`` query heads of size d = h / heads, ``kv_heads`` key/value heads (GQA;
h_kv = kv_heads · d), FFN size f and vocabulary V. A matmul of an [n, a] by an [a, b] matrix
is 2·n·a·b FLOPs (one multiply and one add per term). Forward, per token:

* attention projections: Q and O are h×h, K and V are h×h_kv: ``4h² + 4·h·h_kv``;
* FFN: a gated (SwiGLU) FFN has three h×f matrices, ``6hf``; a plain one two, ``4hf``;
* LM head (once, not per layer): ``2hV``; the embedding lookup is free.

Attention scores for one document of length L, per layer: QKᵀ and the weighted sum of V
are each 2·L·L·h for all heads without a mask. A causal mask leaves query i with i keys,
Σ i = L(L+1)/2 pairs instead of L², and flash-attention-style kernels skip the masked
blocks, so the forward cost is ``2·h·L(L+1) = 2hL² + 2hL``: the ``2hL`` part joins the
linear coefficient, ``2h`` per layer is the attention coefficient.

Training (``training=True``): the backward pass costs about twice the forward (gradients
with respect to both inputs and weights: the 6·N FLOPs per token of Kaplan et al. 2020),
so both coefficients are multiplied by 3. Flash-attention recomputes the scores in its
backward, which this ignores (~+0.5× of the forward attention term).

Worked example: a Llama-2-7B shape (h = 4096, 32 layers, 32 heads, f = 11008, gated,
V = 32000) gives linear = 39.6 GFLOP per token and attention = 786k FLOP per L² in
training, so a 4096-token document costs 162 TFLOP linear + 13.2 TFLOP attention (7.5%).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from streampack.packing.result import PackResult


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """Cost of a pack = ``linear · tokens + attention · Σ L²`` (L: document lengths)."""

    linear: float
    """Cost per token of everything but attention scores (FLOPs when from a model shape)."""
    attention: float
    """Cost per squared document length (causal attention scores)."""

    def __post_init__(self) -> None:
        if not (self.linear >= 0 and self.attention >= 0):
            raise ValueError(f"coefficients must be >= 0, got linear={self.linear}, "
                             f"attention={self.attention}")

    @classmethod
    def from_shape(cls, *, hidden: int, layers: int, heads: int, ffn: int,
                   kv_heads: int | None = None, vocab: int = 0, gated: bool = True,
                   training: bool = True) -> CostModel:
        """FLOPs of a decoder-only transformer (see the module docstring for the formula)."""
        kv_heads = heads if kv_heads is None else kv_heads
        sizes = {"hidden": hidden, "layers": layers, "heads": heads, "ffn": ffn,
                 "kv_heads": kv_heads}
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if vocab < 0 or hidden % heads or heads % kv_heads:
            raise ValueError(f"need vocab >= 0, heads dividing hidden and kv_heads dividing "
                             f"heads; got {vocab=}, {hidden=}, {heads=}, {kv_heads=}")
        h, kv = hidden, kv_heads * (hidden // heads)
        per_layer = 4 * h * h + 4 * h * kv + (6 if gated else 4) * h * ffn + 2 * h
        scale = 3 if training else 1
        return cls(linear=float(scale * (layers * per_layer + 2 * h * vocab)),
                   attention=float(scale * 2 * h * layers))

    def pack_cost(self, lengths: np.ndarray, *, padded_to: int | None = None) -> float:
        """Cost of one pack holding documents of ``lengths`` (int ``[k]``).

        ``padded_to``: the tokens the pack occupies (its capacity). Padding runs through
        the linear layers, so it counts in the linear term; it attends to nothing real
        (masked, or its own span), so it adds no attention cost.
        """
        lengths = np.asarray(lengths, dtype=np.float64)  # L² in float: no int64 overflow
        tokens = float(lengths.sum())
        if padded_to is not None:
            if tokens > padded_to:
                raise ValueError(f"the pack holds {int(tokens)} tokens > {padded_to=}")
            tokens = float(padded_to)
        return self.linear * tokens + self.attention * float(np.dot(lengths, lengths))

    def pack_costs(self, result: PackResult, lengths: np.ndarray, *,
                   padded_to: int | None = None) -> np.ndarray:
        """float64 ``[num_bins]``: ``pack_cost`` of every bin of ``result``, vectorised (one
        pass over the flat arrays; lengths int ``[n]`` indexed by item)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        tokens = result.loads(lengths).astype(np.float64)
        if padded_to is not None:
            if tokens.size and tokens.max() > padded_to:
                raise ValueError(f"a pack holds {int(tokens.max())} tokens > {padded_to=}")
            tokens = np.full(tokens.size, float(padded_to))
        squares = result.bin_sums(lengths.astype(np.float64) ** 2)
        return self.linear * tokens + self.attention * squares

    def batch_cost(self, result: PackResult, lengths: np.ndarray, *,
                   padded_to: int | None = None) -> float:
        """Cost of all packs of ``result`` together (one micro-batch of them)."""
        return float(self.pack_costs(result, lengths, padded_to=padded_to).sum())
