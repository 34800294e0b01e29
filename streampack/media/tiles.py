"""LLaVA-NeXT any-res pixels: an image -> its base view plus the tiles of its best grid pinpoint.

The steps are ``LlavaNextImageProcessorPil``'s (transformers 5.24), checked equal on the same
images to 1e-5 (``tests/unit/media/test_media_anyres.py``): on the 8-bit RGB image,

1. pick the pinpoint ``(H, W)`` that keeps the most pixels, then wastes the fewest
   (:meth:`~streampack.media.tokens.AnyResTiles.best`, ``select_best_resolution``);
2. resize (PIL bicubic) to fit it, keeping the aspect ratio: the side that limits the scale
   becomes exactly ``W`` (or ``H``), the other ``min(ceil(side * scale), H)``
   (``get_patch_output_size``);
3. pad with black to ``(H, W)``, centred (the odd pixel after: ``divmod(gap, 2)``);
4. cut it into ``tile_size`` squares, row-major;
5. prepend the whole image squashed to ``tile_size x tile_size`` (the base view);
6. rescale by 1/255 and normalise each (CLIP mean/std).

Result: float32 ``[1 + (H / tile)·(W / tile), 3, tile, tile]`` and the original ``(height,
width)``: what ``LlavaNextForConditionalGeneration`` takes as one image's rows of
``pixel_values`` (the flattened ``[Σ tiles, 3, tile, tile]`` form, no padding to the batch's most
tiles) and its ``image_sizes`` row, from which the model recomputes the tile count and the
unpadding that ``AnyResTiles.count`` counted. The processor's ``size["shortest_edge"]`` and
``crop_size`` are both ``tile_size`` here, as in every released LLaVA-NeXT (336).

Cost (``benchmarks/bench_media.py``, best of 10, shared 2-core box, loaded): a
640x480 JPEG -> 5 views of 336 px in 45 ms (its Qwen2-VL patches: 21 ms), a 1920x1080 one in
87 ms (91 ms); the views hold 5 x 336² pixels whatever the image, so normalising them is most
of it for small images and the decode for large ones.
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
