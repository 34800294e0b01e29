"""Estimated compute cost of a pack: ``linear · tokens + attention · Σ L²``.

Packing balances tokens, but causal attention grows with the square of each document's length:
one 4096-token document costs more than eight of 512. ``CostModel`` puts a number on that, from
two coefficients given directly or derived from a model shape. Pure numpy; no torch.

``CostModel.from_shape``, for ``layers`` blocks of hidden size h, head size d = h / heads, h_kv = kv_heads · d, FFN size
f and vocabulary V (a matmul [n, a] x [a, b] is 2·n·a·b FLOPs), forward per token: attention projections ``4h² +
4·h·h_kv``, FFN ``6hf`` gated (``4hf`` plain), LM head ``2hV`` once. Causal scores of a document of length L, per layer,
cost ``2·h·L(L+1)`` (flash-attention skips the masked blocks): ``2hL`` joins the linear term, ``2h`` per layer is the
attention coefficient. Training multiplies both by 3 (backward ≈ 2x forward; the scores recomputed in flash-attention's
backward are ignored). A Llama-2-7B shape gives 39.6 GFLOP per token and 786k FLOP per L² in training: a 4096-token
document's attention is 7.5% of its cost.

**Vision encoder** (``CostModel(vision=VisionCost(...))``): a ViT runs every image's patches, linear in patches plus
attention bidirectional inside each frame (``h·w`` patches), never across. ``VisionCost.from_shape`` for ``layers``
blocks of width e, MLP size f, patch input P = C·tp·p² and a Qwen2-VL merger (m² patches → one token of ``out_hidden``),
per patch: embedding ``2Pe``, per layer ``8e² + 4ef``, merger ``2e²m² + 2e·out``; per frame of S patches and layer
``4eS²``. ``training=False`` for a frozen encoder. It equals torch's FLOP counter on transformers' Qwen2-VL vision tower
(``tests/unit/packing/test_vlm_cost.py``); a 1036x1036 image costs as much as ~1.2x its token count. In a media
stream each pack's segments come from its images' headers (``streampack.media.stage.vision_segments``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from streampack.packing.result import PackResult


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class VisionCost:
    """Cost of a pack's images = ``linear · Σ patches + attention · Σ S²`` (S: the patches of
    each vision attention segment, one per image frame)."""

    linear: float
    """Cost per patch through the vision encoder (embedding, blocks, merger/projector)."""
    attention: float
    """Cost per squared segment length (bidirectional attention inside one frame)."""

    def __post_init__(self) -> None:
        if not (self.linear >= 0 and self.attention >= 0):
            raise ValueError(f"vision coefficients must be >= 0, got linear={self.linear}, attention={self.attention}")

    @classmethod
    def from_shape(cls, *, hidden: int, layers: int, mlp: int, patch_dim: int, spatial_merge: int = 1,
                   out_hidden: int | None = None, training: bool = True) -> VisionCost:
        """FLOPs of a ViT with a Qwen2-VL-style merger (module docstring); ``hidden`` is the
        ViT width, ``out_hidden`` the language model's (default: ``hidden``)."""
        out_hidden = hidden if out_hidden is None else out_hidden
        _check_sizes(hidden=hidden, layers=layers, mlp=mlp, patch_dim=patch_dim,
                     spatial_merge=spatial_merge, out_hidden=out_hidden)
        e, m2 = hidden, spatial_merge * spatial_merge
        per_patch = 2 * patch_dim * e + layers * (8 * e * e + 4 * e * mlp) + 2 * e * e * m2 + 2 * e * out_hidden
        scale = 3 if training else 1
        return cls(linear=float(scale * per_patch), attention=float(scale * 4 * e * layers))

    def cost(self, segments: np.ndarray) -> float:
        """Cost of vision attention segments of ``segments`` patches (int ``[k]``)."""
        segments = np.asarray(segments, dtype=np.float64)
        return self.linear * float(segments.sum()) + self.attention * float(np.dot(segments, segments))


def frame_patches(grid_thw: np.ndarray) -> np.ndarray:
    """int64 ``[Σ t]``: patches of each vision attention segment (one per frame, ``h·w``) of
    images with patch grids ``grid_thw`` (int ``[n, 3]``, ``(t, h, w)``); numpy twin of
    ``torch.diff(streampack.layout.vision.vision_cu_seqlens(grid_thw))``."""
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    if grid.size and grid.min() < 1:
        raise ValueError(f"image grids must be >= 1 everywhere, got {grid.tolist()}")
    return np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0])


@dataclass(frozen=True, slots=True, kw_only=True)
class VisionLoad:
    """Per-item (sample) vision totals, for the vectorised ``CostModel.pack_costs``."""

    patches: np.ndarray
    """float64 ``[n]``: Σ patches of each item's images (0 for a text-only item)."""
    squares: np.ndarray
    """float64 ``[n]``: Σ S² over each item's attention segments."""

    @classmethod
    def of(cls, segments: Sequence[np.ndarray]) -> VisionLoad:
        """From each item's segment lengths (``frame_patches`` of its grids; empty: no image)."""
        arrays = [np.asarray(s, dtype=np.float64) for s in segments]
        return cls(patches=np.array([a.sum() for a in arrays], dtype=np.float64),
                   squares=np.array([np.dot(a, a) for a in arrays], dtype=np.float64))


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """Cost of a pack = ``linear · tokens + attention · Σ L²`` (L: document lengths)."""

    linear: float
    """Cost per token of everything but attention scores (FLOPs when from a model shape)."""
    attention: float
    """Cost per squared document length (causal attention scores)."""
    vision: VisionCost | None = None
    """The vision encoder of a VLM (None: text only); adds its cost for the packs' images."""

    def __post_init__(self) -> None:
        if not (self.linear >= 0 and self.attention >= 0):
            raise ValueError(f"coefficients must be >= 0, got linear={self.linear}, attention={self.attention}")

    @classmethod
    def from_shape(cls, *, hidden: int, layers: int, heads: int, ffn: int, kv_heads: int | None = None, vocab: int = 0,
                   gated: bool = True, training: bool = True) -> CostModel:
        """FLOPs of a decoder-only transformer (see the module docstring for the formula)."""
        kv_heads = heads if kv_heads is None else kv_heads
        _check_sizes(hidden=hidden, layers=layers, heads=heads, ffn=ffn, kv_heads=kv_heads)
        if vocab < 0 or hidden % heads or heads % kv_heads:
            raise ValueError(f"need vocab >= 0, heads dividing hidden and kv_heads dividing "
                             f"heads; got {vocab=}, {hidden=}, {heads=}, {kv_heads=}")
        h, kv = hidden, kv_heads * (hidden // heads)
        per_layer = 4 * h * h + 4 * h * kv + (6 if gated else 4) * h * ffn + 2 * h
        scale = 3 if training else 1
        return cls(linear=float(scale * (layers * per_layer + 2 * h * vocab)), attention=float(scale * 2 * h * layers))

    def _vision(self, what: str) -> VisionCost:
        if self.vision is None:
            raise ValueError(f"{what} given, but this CostModel has no vision encoder "
                             f"(CostModel(..., vision=VisionCost(...)))")
        return self.vision

    def pack_cost(self, lengths: np.ndarray, *, padded_to: int | None = None,
                  segments: np.ndarray | None = None) -> float:
        """Cost of one pack holding documents of ``lengths`` (int ``[k]``). ``padded_to`` (its capacity):
        padding runs through the linear layers but attends to nothing real. ``segments``: the patches of
        every vision attention segment of its images (``frame_patches``), priced by ``vision``."""
        lengths = np.asarray(lengths, dtype=np.float64)  # L² in float: no int64 overflow
        tokens = float(lengths.sum())
        if padded_to is not None:
            if tokens > padded_to:
                raise ValueError(f"the pack holds {int(tokens)} tokens > {padded_to=}")
            tokens = float(padded_to)
        vision = 0.0 if segments is None else self._vision("segments").cost(segments)
        return self.linear * tokens + self.attention * float(np.dot(lengths, lengths)) + vision

    def pack_costs(self, result: PackResult, lengths: np.ndarray, *,
                   padded_to: int | None = None, vision: VisionLoad | None = None) -> np.ndarray:
        """float64 ``[num_bins]``: ``pack_cost`` of every bin of ``result``, vectorised (one
        pass over the flat arrays; lengths int ``[n]`` and ``vision`` indexed by item)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        tokens = result.loads(lengths).astype(np.float64)
        if padded_to is not None:
            if tokens.size and tokens.max() > padded_to:
                raise ValueError(f"a pack holds {int(tokens.max())} tokens > {padded_to=}")
            tokens = np.full(tokens.size, float(padded_to))
        squares = result.bin_sums(lengths.astype(np.float64) ** 2)
        costs = self.linear * tokens + self.attention * squares
        if vision is not None:
            encoder = self._vision("vision")
            if vision.patches.shape != lengths.shape or vision.squares.shape != lengths.shape:
                raise ValueError(f"vision loads of shape {vision.patches.shape} for {lengths.size} items")
            costs += (encoder.linear * result.bin_sums(vision.patches)
                      + encoder.attention * result.bin_sums(vision.squares))
        return costs

    def batch_cost(self, result: PackResult, lengths: np.ndarray, *,
                   padded_to: int | None = None, vision: VisionLoad | None = None) -> float:
        """Cost of all packs of ``result`` together (one micro-batch of them)."""
        return float(self.pack_costs(result, lengths, padded_to=padded_to, vision=vision).sum())
