"""LLaVA-NeXT any-res pixels: an image -> its base view plus the tiles of its best grid pinpoint.

The steps are ``LlavaNextImageProcessorPil``'s, checked equal to 1e-5 (``tests/unit/media/test_media_anyres.py``): pick the
pinpoint (:meth:`~streampack.media.tokens.AnyResTiles.best`), resize keeping the aspect ratio, pad centred with black,
cut into ``tile_size`` squares row-major, prepend the whole image squashed to one tile, rescale and normalise. Result:
float32 ``[1 + tiles, 3, tile, tile]`` and the original ``(height, width)``, one image's ``pixel_values`` rows and
``image_sizes`` row. Cost: a 640x480 JPEG in 45 ms, a 1920x1080 one in 87 ms (``benchmarks/bench_media.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from streampack.media.tokens import AnyResTiles


def fit_size(width: int, height: int, target: tuple[int, int]) -> tuple[int, int]:
    """(height, width) of the image resized to fit ``target`` = (H, W) keeping its aspect ratio
    (transformers' ``get_patch_output_size``)."""
    target_h, target_w = target
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_h), target_w
    return target_h, min(math.ceil(width * scale_h), target_w)


def tile_pixels(im: "PIL.Image.Image", rule: AnyResTiles,  # noqa: F821
                normalized: Callable[["PIL.Image.Image"], np.ndarray]) -> np.ndarray:  # noqa: F821
    """float32 ``[1 + tiles, 3, S, S]`` of the RGB image ``im`` (S = ``rule.tile_size``);
    ``normalized`` maps an RGB image to its float32 ``[3, h, w]`` (rescale + normalise)."""
    from PIL import Image

    bicubic = Image.Resampling.BICUBIC
    size = rule.tile_size
    best = rule.best(im.width, im.height)
    new_h, new_w = fit_size(im.width, im.height, best)
    resized = im if (new_w, new_h) == im.size else im.resize((new_w, new_h), resample=bicubic)
    canvas = Image.new("RGB", (best[1], best[0]), (0, 0, 0))
    canvas.paste(resized, ((best[1] - new_w) // 2, (best[0] - new_h) // 2))
    base = im if im.size == (size, size) else im.resize((size, size), resample=bicubic)
    grid = normalized(canvas)  # [3, H, W]
    rows, cols = best[0] // size, best[1] // size
    tiles = grid.reshape(3, rows, size, cols, size).transpose(1, 3, 0, 2, 4).reshape(rows * cols, 3, size, size)
    return np.ascontiguousarray(np.concatenate([normalized(base)[None], tiles]), dtype=np.float32)
