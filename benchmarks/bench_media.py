"""Header-only image lengths against decode-then-count, per image, for JPEG / PNG / WebP.

Rows (``run()``), one per format and size: the encoded size; ``header_bytes``, the bytes
``read_header`` reads (PIL's lazy ``Image.open`` through a counting stream for JPEG and PNG; the
30-byte RIFF header for WebP) and ``pil_open_bytes``, what ``Image.open`` alone reads; ``header_us``, streampack's ``read_header`` (open + checks); ``decode_us``, a full
decode to RGB (what a decode-then-count length would cost); ``pixels_us``, the whole
after-packing path of one image (decode, Qwen2-VL ``smart_resize``, normalise, patchify);
``anyres_us``, the same path for LLaVA-NeXT any-res (decode, best pinpoint, resize + pad,
base view + tiles of 336 px, normalise; ``tiles`` of them); and the ratio decode / header.
Best of ``repeats`` timings, all in one process side by side.

Video rows (``run_video()``): one 8-frame video of JPEG frames per size, per frame: the header
(``read_header``), a full decode, and the video's whole after-packing path
(``video_pixels``: decode, torch's antialiased bicubic to the ``VideoFrames()`` size, normalise,
patchify) divided by its frames.

The images are smooth gradients plus noise (photographs compress between flat colour and pure
noise). Run: ``python benchmarks/bench_media.py`` (``--quick`` for fewer repeats).

The last numbers: ``benchmarks/README.md``, "Images: header-only against decode".
"""

from __future__ import annotations

import argparse
import io
import time
from typing import Any

import numpy as np
from PIL import Image

from streampack.io.limits import Limits
from streampack.media import AnyResTiles, DynamicResolution, MediaImage, MediaOptions, read_header
from streampack.media.decode import decode_image, open_rgb, video_pixels
from streampack.media.tokens import VideoFrames
from streampack.media.video import MediaVideo

SIZES = ((640, 480), (1920, 1080))
FORMATS = (("jpg", "JPEG"), ("png", "PNG"), ("webp", "WEBP"))


class _Counting(io.BytesIO):
    """A stream that records the furthest byte any read reached."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.furthest = 0

    def read(self, n: int | None = -1) -> bytes:  # type: ignore[override]
        out = super().read(n)
        self.furthest = max(self.furthest, self.tell())
        return out


def photo(width: int, height: int, fmt: str, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], -1)
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt, **({"quality": 90} if fmt in ("JPEG", "WEBP") else {}))
    return out.getvalue()


def best_us(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def pil_open_bytes(data: bytes) -> int:
    stream = _Counting(data)
    with Image.open(stream, formats=[f for _, f in FORMATS]):
        return stream.furthest


def run(quick: bool = False) -> list[dict[str, Any]]:
    repeats = 5 if quick else 30
    options = MediaOptions(rule=DynamicResolution(), image_token_id=0)
    anyres = MediaOptions(rule=AnyResTiles(), image_token_id=0)
    limit = Limits().max_image_pixels
    rows = []
    for width, height in SIZES:
        for ext, fmt in FORMATS:
            data = photo(width, height, fmt)
            header = read_header(data, url="bench", key="k", name=ext, max_pixels=limit)
            image = MediaImage(name=ext, data=data, header=header)
            h_us = best_us(lambda: read_header(data, url="bench", key="k", name=ext, max_pixels=limit), repeats)
            d_us = best_us(lambda: open_rgb(image, url="bench", key="k"), max(3, repeats // 3))
            p_us = best_us(lambda: decode_image(image, options, url="bench", key="k"), max(3, repeats // 3))
            a_us = best_us(lambda: decode_image(image, anyres, url="bench", key="k"), max(3, repeats // 3))
            rows.append({"format": ext, "size": f"{width}x{height}", "bytes": len(data),
                         "header_bytes": 30 if fmt == "WEBP" else pil_open_bytes(data),
                         "pil_open_bytes": pil_open_bytes(data), "header_us": round(h_us, 1),
                         "decode_us": round(d_us, 1), "pixels_us": round(p_us, 1),
                         "anyres_us": round(a_us, 1),
                         "tiles": decode_image(image, anyres, url="bench", key="k").values.shape[0],
                         "decode_over_header": round(d_us / h_us, 1),
                         "tokens": options.rule.count(width, height)})
    return rows


def run_video(quick: bool = False, frames: int = 8) -> list[dict[str, Any]]:
    repeats = 3 if quick else 10
    rule = VideoFrames()
    options = MediaOptions(rule=DynamicResolution(), image_token_id=0, video=rule, video_token_id=1)
    limit = Limits().max_image_pixels
    rows = []
    for width, height in SIZES:
        data = [photo(width, height, "JPEG", seed=f) for f in range(frames)]
        heads = [read_header(d, url="bench", key="k", name=str(f), max_pixels=limit) for f, d in enumerate(data)]
        clip = MediaVideo(name="video", frames=tuple(MediaImage(name=str(f), data=d, header=h)
                                                      for f, (d, h) in enumerate(zip(data, heads))))
        h_us = best_us(lambda: [read_header(d, url="bench", key="k", name="f", max_pixels=limit) for d in data],
                       repeats) / frames
        d_us = best_us(lambda: [open_rgb(f, url="bench", key="k") for f in clip.frames], repeats) / frames
        v_us = best_us(lambda: video_pixels(clip, options, url="bench", key="k"), repeats) / frames
        rows.append({"video": f"{frames} x JPEG {width}x{height}", "bytes_per_frame": sum(map(len, data)) // frames,
                     "header_us_per_frame": round(h_us, 1), "decode_us_per_frame": round(d_us, 1),
                     "pixels_us_per_frame": round(v_us, 1), "grid_thw": rule.grid(frames, width, height),
                     "tokens": rule.count(frames, width, height)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    for row in run(quick=args.quick) + run_video(quick=args.quick):
        print(row)


if __name__ == "__main__":
    main()
