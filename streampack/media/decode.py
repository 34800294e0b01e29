"""Encoded images and videos -> the pixel values a VLM's vision encoder takes, as its HF processors make them.

Runs only for samples of emitted packs, in the reader process; the steps, and the processors they are checked against,
are in ``docs/multimodal.md`` ("Pack first, decode after"). A body the header accepted that does not decode is
``DataError("bad_image")``; PIL's decompression-bomb check stays on behind ``Limits.max_image_pixels``. Video frames are
resized with torch's antialiased bicubic on uint8, the kernel torchvision uses (PIL's bicubic differs by up to 12
levels): 14 ms a frame at 640x480, 50 ms at 1080p, paid only by emitted packs (a header is 44-85 us). Any-res tiles
(LLaVA-NeXT) equal ``LlavaNextImageProcessorPil``'s to 1e-5 (``tests/unit/media/test_media_anyres.py``): a 640x480 JPEG
in 45 ms, a 1920x1080 one in 87 ms (``benchmarks/bench_media.py``).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np

from streampack.errors import DataError
from streampack.media.header import FORMATS, MediaImage
from streampack.media.options import MediaOptions
from streampack.media.tokens import AnyResTiles, DynamicResolution, FixedTokens
from streampack.media.video import MediaVideo


@dataclass(frozen=True, slots=True, kw_only=True)
class Pixels:
    """One decoded image."""

    values: np.ndarray
    """float32: ``[patches, C·t·p·p]`` (dynamic resolution, video), ``[3, H, W]`` (fixed size)
    or ``[1 + tiles, 3, S, S]`` (any-res)."""
    grid_thw: tuple[int, int, int]
    """(t, h, w) in patches (Qwen2-VL's ``image_grid_thw`` / ``video_grid_thw`` row); (1, H, W)
    pixels for fixed size; (1 + tiles, S, S) for any-res."""
    size: tuple[int, int] = (0, 0)
    """(height, width) of the image as stored (LLaVA-NeXT's ``image_sizes`` row)."""


def open_rgb(image: MediaImage, *, url: str, key: str) -> "PIL.Image.Image":  # noqa: F821
    """The fully decoded image as 8-bit RGB (transparency over white, as the HF processors)."""
    from PIL import Image

    try:
        im = Image.open(io.BytesIO(image.data), formats=FORMATS)
        im.load()
    except Exception as e:  # noqa: BLE001 — PIL raises OSError, SyntaxError, ValueError... for bad bodies
        raise DataError("bad_image", f"image {image.name!r} does not decode: {e}", url=url, key=key,
                        value=image.name) from None
    if (im.width, im.height) != (image.header.width, image.header.height):
        raise DataError("bad_image", f"image {image.name!r} decoded to {im.width}x{im.height}, its header said "
                        f"{image.header.width}x{image.header.height}", url=url, key=key, value=image.name)
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        im = im.convert("RGBA")
        white = Image.new("RGBA", im.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, im).convert("RGB")
    return im.convert("RGB")


def _normalized(im: "PIL.Image.Image", options: MediaOptions) -> np.ndarray:  # noqa: F821
    """float32 ``[3, H, W]``: ``(x * rescale - mean) / std`` as one float32 multiply-add
    (transformers rescales in float64 first; the two differ by < 5e-7)."""
    scale = np.float32(options.rescale) / np.asarray(options.image_std, np.float32)
    shift = np.asarray(options.image_mean, np.float32) / np.asarray(options.image_std, np.float32)
    arr = np.asarray(im, dtype=np.float32) * scale - shift
    return arr.transpose(2, 0, 1)


def decode_image(image: MediaImage, options: MediaOptions, *, url: str, key: str) -> Pixels:
    """Decode, resize and normalise one image for ``options.rule``."""
    from PIL import Image

    rule = options.rule
    im = open_rgb(image, url=url, key=key)
    if isinstance(rule, DynamicResolution):
        h, w = rule.resized(im.width, im.height)
        arr = _normalized(im.resize((w, h), resample=Image.Resampling.BICUBIC), options)
        return Pixels(values=patchify(arr[None], rule), grid_thw=rule.grid(im.width, im.height))
    if isinstance(rule, FixedTokens):
        size = rule.size
        short, long = sorted((im.width, im.height))
        other = int(size * long / short)
        w, h = (size, other) if im.width <= im.height else (other, size)
        im = im.resize((w, h), resample=Image.Resampling.BICUBIC)
        top, left = (h - size) // 2, (w - size) // 2
        arr = _normalized(im, options)[:, top:top + size, left:left + size]
        return Pixels(values=np.ascontiguousarray(arr), grid_thw=(1, size, size))
    if isinstance(rule, AnyResTiles):
        tiles = tile_pixels(im, rule, options)
        return Pixels(values=tiles, grid_thw=(tiles.shape[0], rule.tile_size, rule.tile_size),
                      size=(im.height, im.width))
    raise ValueError(f"no pixel layout for {type(rule).__name__}")


def fit_size(width: int, height: int, target: tuple[int, int]) -> tuple[int, int]:
    """(height, width) of the image resized to fit ``target`` = (H, W) keeping its aspect ratio
    (transformers' ``get_patch_output_size``)."""
    target_h, target_w = target
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_h), target_w
    return target_h, min(math.ceil(width * scale_h), target_w)


def tile_pixels(im: "PIL.Image.Image", rule: AnyResTiles, options: MediaOptions) -> np.ndarray:  # noqa: F821
    """float32 ``[1 + tiles, 3, S, S]`` of the RGB image ``im`` (S = ``rule.tile_size``): pick the pinpoint
    (:meth:`~streampack.media.tokens.AnyResTiles.best`), resize keeping the aspect ratio, pad centred with black, cut
    into ``tile_size`` squares row-major, prepend the whole image squashed to one tile, rescale and normalise."""
    from PIL import Image

    bicubic = Image.Resampling.BICUBIC
    size = rule.tile_size
    best = rule.best(im.width, im.height)
    new_h, new_w = fit_size(im.width, im.height, best)
    resized = im if (new_w, new_h) == im.size else im.resize((new_w, new_h), resample=bicubic)
    canvas = Image.new("RGB", (best[1], best[0]), (0, 0, 0))
    canvas.paste(resized, ((best[1] - new_w) // 2, (best[0] - new_h) // 2))
    base = im if im.size == (size, size) else im.resize((size, size), resample=bicubic)
    grid = _normalized(canvas, options)  # [3, H, W]
    rows, cols = best[0] // size, best[1] // size
    tiles = grid.reshape(3, rows, size, cols, size).transpose(1, 3, 0, 2, 4).reshape(rows * cols, 3, size, size)
    return np.ascontiguousarray(np.concatenate([_normalized(base, options)[None], tiles]), dtype=np.float32)


def video_pixels(video: MediaVideo, options: MediaOptions, *, url: str, key: str) -> Pixels:
    """Decode, resize, normalise and patchify one video for ``options.video``."""
    import torch
    import torch.nn.functional as F

    rule = options.video
    assert rule is not None
    frames = np.stack([np.asarray(open_rgb(frame, url=url, key=key)) for frame in video.frames])
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()  # uint8 [n, 3, H, W]
    height, width = x.shape[-2:]
    h, w = rule.frame.resized(width, height)
    if (h, w) != (height, width):
        x = F.interpolate(x, size=(h, w), mode="bicubic", align_corners=False, antialias=True)
    mean = torch.tensor(options.image_mean, dtype=torch.float32) * (1.0 / options.rescale)
    std = torch.tensor(options.image_std, dtype=torch.float32) * (1.0 / options.rescale)
    x = x.to(torch.float32).sub_(mean[:, None, None]).div_(std[:, None, None])
    return Pixels(values=patchify(x.numpy(), rule.frame), grid_thw=rule.grid(len(video.frames), width, height))


def patchify(frames: np.ndarray, rule: DynamicResolution) -> np.ndarray:
    """float32 ``[n, C, H, W]`` -> Qwen2-VL's ``[t·gh·gw, C·tp·p·p]`` (``t = ceil(n / tp)``, the last frame repeated
    to fill the last temporal patch; an image is one frame), patches in merge-window order."""
    patch, merge, temporal = rule.patch_size, rule.merge_size, rule.temporal_patch_size
    n, c, height, width = frames.shape
    if n == 1:  # an image or a one-frame video: repeated over the temporal patch as a view, not a copy
        frames = np.broadcast_to(frames, (temporal, c, height, width))
    elif pad := -n % temporal:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    t, gh, gw = frames.shape[0] // temporal, height // patch, width // patch
    patches = frames.reshape(t, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(patches.reshape(t * gh * gw, c * temporal * patch * patch), dtype=np.float32)
