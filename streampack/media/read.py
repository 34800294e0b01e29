"""A sample's images from each shard format, as :class:`~streampack.media.header.MediaImage`.

- webdataset tar: the sample's members whose extension is an image extension
  (``MediaOptions.image_exts``), in member-name order (``0.jpg``, ``1.png``...); the tar reader
  already bounds each member by ``max_member_bytes`` and the sample by ``max_sample_bytes``.
- parquet (HF datasets layout): the ``images_key`` column holds one image or a list, each an
  ``{"bytes": ..., "path": ...}`` struct (the ``datasets.Image`` feature) or raw bytes.
- jsonl: the ``images_key`` field holds one path or a list, relative to
  ``MediaOptions.image_root`` (NeVA's ``image_folder``), local or any fsspec URL, each read
  whole through the storage layer and bounded by ``max_member_bytes``.

Every image's header is read and checked here (:func:`~streampack.media.header.read_images`):
the reader, not the packer, is where a bad image is found, so ``on_error`` applies with the
shard and key in the error.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from typing import Any

from streampack.errors import DataError
from streampack.io.limits import Limits
from streampack.media.header import MediaImage, read_images


def _images(named: list[tuple[str, Any]], limits: Limits, *, url: str, key: str) -> tuple[MediaImage, ...]:
    return read_images(named, url=url, key=key, max_pixels=limits.max_image_pixels,
                       max_sample_pixels=limits.max_sample_pixels)


def tar_images(fields: Mapping[str, bytes], media: Any, limits: Limits, *, url: str,
               key: str) -> tuple[MediaImage, ...]:
    named = sorted((f, raw) for f, raw in fields.items() if media.is_image_field(f))
    return _images(named, limits, url=url, key=key)


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def column_images(value: Any, media: Any, limits: Limits, *, url: str, key: str) -> tuple[MediaImage, ...]:
    """Images of a parquet row's ``images_key`` value."""
    named = []
    for i, item in enumerate(_as_list(value)):
        name = f"{media.images_key}[{i}]"
        if isinstance(item, Mapping):
            name = str(item.get("path") or name)
            item = item.get("bytes")
            if item is None:
                raise DataError("bad_image", f"image {name!r} has no bytes (a path-only datasets.Image is not "
                                f"read)", url=url, key=key, value=name)
        named.append((name, item))
    return _images(named, limits, url=url, key=key)


def path_images(value: Any, media: Any, limits: Limits, *, url: str, key: str) -> tuple[MediaImage, ...]:
    """Images of a jsonl record's ``images_key`` value: paths under ``image_root``."""
    from streampack.io.open import open_shard

    named = []
    for path in _as_list(value):
        if not isinstance(path, str) or not path:
            raise DataError("bad_image", f"image path {path!r} is not a non-empty string", url=url, key=key,
                            value=path)
        norm = posixpath.normpath(path)
        if path.startswith("/") or "://" in path or norm.startswith(".."):
            # paths come from the data: they may not escape the root the user chose
            raise DataError("bad_image", f"image path {path!r} must be relative and stay under image_root",
                            url=url, key=key, value=path)
        if media.image_root is None:
            raise DataError("bad_image", "the record names image paths but MediaOptions.image_root is not set",
                            url=url, key=key, value=path)
        where = media.image_root.rstrip("/") + "/" + norm
        try:
            with open_shard(where) as f:
                data = f.read(limits.max_member_bytes + 1)
        except DataError as e:
            raise DataError("bad_image", f"image {path!r} cannot be read: {e.detail}", url=url, key=key,
                            value=path) from None
        if len(data) > limits.max_member_bytes:
            raise DataError("member_too_large", f"image {path!r} is over max_member_bytes={limits.max_member_bytes}",
                            url=url, key=key, value=path)
        named.append((path, data))
    return _images(named, limits, url=url, key=key)
