"""How many tokens an image costs, from its size alone: the pluggable rules a VLM's processor uses.

Each rule is a frozen record with ``count(width, height)`` (image tokens in the text): :class:`FixedTokens`
(LLaVA-1.5: 576), :class:`DynamicResolution` (Qwen2-VL's ``smart_resize`` to multiples of 28, tested against
``Qwen2VLImageProcessor``) and :class:`AnyResTiles` (LLaVA-NeXT any-res, ``LlavaNextProcessor``'s numbers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True, slots=True, kw_only=True)
class FixedTokens:
    """Every image resized to ``size x size``; ``tokens`` per image (LLaVA-1.5 defaults)."""

    size: int = 336
    tokens: int = 576

    def __post_init__(self) -> None:
        if self.size < 1 or self.tokens < 1:
            raise ValueError(f"FixedTokens(size={self.size}, tokens={self.tokens}) must both be >= 1")

    def count(self, width: int, height: int) -> int:
        return self.tokens

    def segments(self, width: int, height: int) -> list[int]:
        """Patches of each vision attention segment: one of ``tokens`` (LLaVA-1.5's projector maps each
        patch to one token; the CLS patch is left out)."""
        return [self.tokens]


@dataclass(frozen=True, slots=True, kw_only=True)
class DynamicResolution:
    """Qwen2-VL / Qwen2.5-VL dynamic resolution (defaults: the released processors')."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    def __post_init__(self) -> None:
        if min(self.patch_size, self.merge_size, self.temporal_patch_size) < 1:
            raise ValueError(f"patch_size={self.patch_size}, merge_size={self.merge_size} and "
                             f"temporal_patch_size={self.temporal_patch_size} must be >= 1")
        if not 1 <= self.min_pixels <= self.max_pixels:
            raise ValueError(f"need 1 <= min_pixels={self.min_pixels} <= max_pixels={self.max_pixels}")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """``smart_resize``: (height, width), both multiples of :attr:`factor`. An aspect ratio
        over 200 is a ``ValueError`` (the processor's own refusal)."""
        factor = self.factor
        if max(height, width) / min(height, width) > 200:
            raise ValueError(f"aspect ratio of {width}x{height} is over 200")
        h_bar = round(height / factor) * factor
        w_bar = round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt((height * width) / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """``image_grid_thw`` of one image: (1, h / patch, w / patch)."""
        h, w = self.resized(width, height)
        return 1, h // self.patch_size, w // self.patch_size

    def count(self, width: int, height: int) -> int:
        h, w = self.resized(width, height)
        return (h // self.factor) * (w // self.factor)

    def segments(self, width: int, height: int) -> list[int]:
        """Patches of each vision attention segment: the one frame of :meth:`grid`."""
        _, h, w = self.grid(width, height)
        return [h * w]


@dataclass(frozen=True, slots=True, kw_only=True)
class AnyResTiles:
    """LLaVA-NeXT any-res: tiles of ``tile_size`` px over the best of ``grid_pinpoints``
    ((height, width) pairs), plus the base image; ``extra_tokens`` is the processor's
    ``num_additional_image_tokens`` (1 when the CLS feature is kept)."""

    grid_pinpoints: tuple[tuple[int, int], ...] = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
    tile_size: int = 336
    patch_size: int = 14
    extra_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.grid_pinpoints or any(h % self.tile_size or w % self.tile_size for h, w in self.grid_pinpoints):
            raise ValueError(f"grid_pinpoints={self.grid_pinpoints} must be non-empty multiples of "
                             f"tile_size={self.tile_size}")

    def best(self, width: int, height: int) -> tuple[int, int]:
        """The pinpoint (height, width) that keeps the most pixels, then wastes the fewest."""
        best, most, waste = self.grid_pinpoints[0], 0, math.inf
        for h, w in self.grid_pinpoints:
            scale = min(w / width, h / height)
            kept = min(int(width * scale) * int(height * scale), width * height)
            wasted = w * h - kept
            if kept > most or (kept == most and wasted < waste):
                best, most, waste = (h, w), kept, wasted
        return best

    def count(self, width: int, height: int) -> int:
        best_h, best_w = self.best(width, height)
        side = self.tile_size // self.patch_size
        cur_h, cur_w = side * (best_h // self.tile_size), side * (best_w // self.tile_size)
        if width / height > cur_w / cur_h:
            pad = (cur_h - int(round(height * (cur_w / width), 7))) // 2
            cur_h -= 2 * pad
        else:
            pad = (cur_w - int(round(width * (cur_h / height), 7))) // 2
            cur_w -= 2 * pad
        return cur_h * cur_w + cur_h + side * side + self.extra_tokens

    def segments(self, width: int, height: int) -> list[int]:
        """Patches of each vision attention segment: the base view and every tile, each its own
        encoder pass of ``(tile_size / patch_size)²`` patches."""
        best_h, best_w = self.best(width, height)
        tiles = (best_h // self.tile_size) * (best_w // self.tile_size)
        return [(self.tile_size // self.patch_size) ** 2] * (1 + tiles)


@dataclass(frozen=True, slots=True, kw_only=True)
class VideoFrames:
    """A Qwen2-VL video from its ordered frames (defaults: ``Qwen2VLVideoProcessor``'s): every frame resized
    to ``frame.resized``, ``n`` frames padded to a multiple of the temporal patch ``tp``, so the tokens are
    ``ceil(n / tp) * (h / 28) * (w / 28)``."""

    frame: DynamicResolution = DynamicResolution(min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 768)
    max_frames: int = 768
    """More frames than this is ``DataError("video_too_long")`` when the sample is read."""

    def __post_init__(self) -> None:
        if not isinstance(self.frame, DynamicResolution):
            raise TypeError(f"frame must be a DynamicResolution, got {type(self.frame).__name__}")
        if isinstance(self.max_frames, bool) or not isinstance(self.max_frames, int) or self.max_frames < 1:
            raise ValueError(f"max_frames={self.max_frames!r} must be an int >= 1")

    def grid(self, frames: int, width: int, height: int) -> tuple[int, int, int]:
        """``video_grid_thw`` of ``frames`` frames of ``width x height``: (t, h / p, w / p)."""
        if not 1 <= frames <= self.max_frames:
            raise ValueError(f"{frames} frames: want 1 to max_frames={self.max_frames}")
        h, w = self.frame.resized(width, height)
        p = self.frame.patch_size
        return -(-frames // self.frame.temporal_patch_size), h // p, w // p

    def count(self, frames: int, width: int, height: int) -> int:
        t, h, w = self.grid(frames, width, height)
        m = self.frame.merge_size
        return t * (h // m) * (w // m)

    def segments(self, frames: int, width: int, height: int) -> list[int]:
        """Patches of each vision attention segment: one per temporal patch of :meth:`grid`."""
        t, h, w = self.grid(frames, width, height)
        return [h * w] * t


TokenRule = Union[FixedTokens, DynamicResolution, AnyResTiles]
RULES = (FixedTokens, DynamicResolution, AnyResTiles)
