"""Tiny image-text shards for the media tests and the VLM example: images made with PIL, token
ids with one placeholder per image."""

from __future__ import annotations

import io
import json
import struct
import tarfile
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

IMAGE_ID = 90
"""The placeholder id the tests use (a tiny Qwen2-VL's ``image_token_id``)."""


def image_bytes(width: int, height: int, fmt: str = "PNG", *, seed: int = 0, mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode] if mode in ("RGB", "RGBA", "L") else 3
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    im = Image.fromarray(pixels[..., 0] if channels == 1 else pixels)
    if mode == "P":
        im = im.convert("P")
    out = io.BytesIO()
    im.save(out, fmt)
    return out.getvalue()


def png_header_only(width: int, height: int, *, bit_depth: int = 8, color_type: int = 2) -> bytes:
    """A PNG that declares ``width x height`` pixels and holds one empty IDAT: what a
    decompression bomb's header looks like (no pixel data needed to lie about the size)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def add_member(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def sample_ids(rng: np.random.Generator, n_images: int, text: int) -> list[int]:
    """Text ids in [1, 89) with ``n_images`` placeholders spread through them."""
    ids = rng.integers(1, 89, size=max(text, n_images + 1)).tolist()
    for k in range(n_images):
        ids.insert(1 + k * 2, IMAGE_ID)
    return ids


def write_tar(path: Path, n: int, *, seed: int = 0, max_images: int = 2, sizes: tuple[int, int] = (28, 96),
              text: tuple[int, int] = (3, 40), bad: dict[int, bytes] | None = None) -> Path:
    """``n`` samples ``k<i>``: a json ``input_ids`` member and 0..``max_images`` images
    ``<j>.png|jpg|webp`` of random sizes; ``bad[i]`` replaces sample i's first image."""
    rng = np.random.default_rng(seed)
    fmts = ("png", "jpg", "webp")
    with tarfile.open(path, "w") as tf:
        for i in range(n):
            k = int(rng.integers(0, max_images + 1))
            if bad and i in bad:
                k = max(k, 1)
            ids = sample_ids(rng, k, int(rng.integers(*text)))
            add_member(tf, f"k{i}.json", json.dumps({"input_ids": ids}).encode())
            for j in range(k):
                fmt = fmts[(i + j) % 3]
                w, h = (int(v) for v in rng.integers(*sizes, size=2))
                data = bad[i] if bad and i in bad and j == 0 else image_bytes(
                    w, h, {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}[fmt], seed=i * 10 + j)
                add_member(tf, f"k{i}.{j}.{fmt}", data)
    return path


VIDEO_ID = 91
"""The video placeholder id the tests use (a tiny Qwen2-VL's ``video_token_id``)."""


def write_video_tar(path: Path, n: int, *, seed: int = 0, frames: tuple[int, int] = (1, 6),
                    sizes: tuple[int, int] = (8, 40), text: tuple[int, int] = (3, 30),
                    bad: dict[int, list[tuple[str, bytes]]] | None = None) -> Path:
    """``n`` samples ``k<i>``: ids with placeholders for 0..1 image ``0.png`` and 0..2 videos;
    one video is members ``video.<f>.jpg``, two are ``video.<v>.<f>.jpg`` (frames of one video
    share a random size). ``bad[i]`` replaces sample i's videos with the given members."""
    rng = np.random.default_rng(seed)
    with tarfile.open(path, "w") as tf:
        for i in range(n):
            k, v = int(rng.integers(0, 2)), int(rng.integers(0, 3))
            members: list[tuple[str, bytes]] = []
            if k:
                w, h = (int(x) for x in rng.integers(*sizes, size=2))
                members.append(("0.png", image_bytes(w, h, "PNG", seed=i)))
            for j in range(v):
                w, h = (int(x) for x in rng.integers(*sizes, size=2))
                prefix = "video" if v == 1 else f"video.{j}"
                members += [(f"{prefix}.{f}.jpg", image_bytes(w, h, "JPEG", seed=100 * i + 10 * j + f))
                            for f in range(int(rng.integers(*frames)))]
            if bad and i in bad:
                members, v = [m for m in members if not m[0].startswith("video")] + bad[i], max(v, 1)
            ids = sample_ids(rng, k, int(rng.integers(*text)))
            for j in range(v):
                ids.insert(len(ids) // 2 + 2 * j, VIDEO_ID)  # text between: transformers reads adjacent runs as one
            add_member(tf, f"k{i}.json", json.dumps({"input_ids": ids}).encode())
            for name, data in members:
                add_member(tf, f"k{i}.{name}", data)
    return path
