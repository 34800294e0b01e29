"""A sample's images and videos from each shard format (where they are: ``docs/multimodal.md``).

jsonl paths are read through the storage layer with the shards' retry, timeout and storage settings and I/O counters
(:meth:`MediaOptions.reading`), bounded by ``max_member_bytes``. Every header is checked here, so ``on_error`` applies
with the shard and key in the error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from streampack.errors import DataError
from streampack.io.limits import Limits
from streampack.io.open import OpenOptions
from streampack.io.retry import IOStats
from streampack.media.header import MediaImage, read_images
from streampack.media.paths import image_location
from streampack.media.video import MediaVideo, column_videos, read_video, split_tar_fields, tar_videos


@dataclass(frozen=True, slots=True, kw_only=True)
class MediaReader:
    """:class:`~streampack.media.options.MediaOptions` bound to how one reader fetches bytes;
    what the format readers (``streampack.io``) call, without importing this package."""

    options: Any
    """The :class:`~streampack.media.options.MediaOptions`."""
    open: OpenOptions = OpenOptions()
    stats: IOStats | None = None

    def columns(self) -> dict[str, str]:
        """The parquet columns holding media: ``{"images": ..., "videos": ...}``."""
        out = {"images": self.options.images_key}
        if self.options.video is not None:
            out["videos"] = self.options.videos_key
        return out

    def tar_images(self, fields: Mapping[str, bytes], limits: Limits, *, url: str, key: str) -> tuple[Any, ...]:
        if self.options.video is None:
            images, videos = [(f, raw) for f, raw in fields.items() if self.options.is_image_field(f)], []
        else:
            images, frames = split_tar_fields(fields, self.options.videos_key, self.options.is_image_field)
            videos = tar_videos(frames, url=url, key=key)
        return self._media(numbered(images, url=url, key=key), videos, limits, url=url, key=key)

    def column_media(self, row: Mapping[str, Any], limits: Limits, *, url: str, key: str) -> tuple[Any, ...]:
        """Images and videos of a parquet row (``{"images": value, "videos": value}``)."""
        images = [_column_item(item, f"{self.options.images_key}[{i}]", url=url, key=key)
                  for i, item in enumerate(_as_list(row.get("images")))]
        videos = [(name, [_column_item(item, f"{name}[{i}]", url=url, key=key) for i, item in enumerate(frames)])
                  for name, frames in self._videos(row.get("videos"), url=url, key=key)]
        return self._media(images, videos, limits, url=url, key=key)

    def record_media(self, record: Mapping[str, Any], limits: Limits, *, url: str, key: str) -> tuple[Any, ...]:
        """Images and videos of a jsonl record: paths under ``image_root``."""
        images = [self._path(p, limits, url=url, key=key) for p in _as_list(record.get(self.options.images_key))]
        videos = [(name, [self._path(p, limits, url=url, key=key) for p in frames])
                  for name, frames in self._videos(record.get(self.options.videos_key), url=url, key=key)]
        return self._media(images, videos, limits, url=url, key=key)

    def _videos(self, value: Any, *, url: str, key: str) -> list[tuple[str, list[Any]]]:
        if self.options.video is None:
            return []
        return column_videos(value, self.options.videos_key, url=url, key=key)

    def _media(self, images: list[tuple[str, Any]], videos: list[tuple[str, list[tuple[str, Any]]]], limits: Limits,
               *, url: str, key: str) -> tuple[Any, ...]:
        out: list[MediaImage | MediaVideo] = list(read_images(images, url=url, key=key,
                                                              max_pixels=limits.max_image_pixels))
        for name, frames in videos:
            out.append(read_video(name, frames, max_frames=self.options.video.max_frames,
                                  max_pixels=limits.max_image_pixels, url=url, key=key))
        total = sum(im.header.pixels for im in out if isinstance(im, MediaImage)) + sum(
            f.header.pixels for v in out if isinstance(v, MediaVideo) for f in v.frames)
        if total > limits.max_sample_pixels:
            raise DataError("sample_too_large", f"the sample's images{' and video frames' if videos else ''} declare "
                            f"{total} pixels, over max_sample_pixels={limits.max_sample_pixels}", url=url, key=key,
                            value=total)
        return tuple(out)

    def _path(self, path: Any, limits: Limits, *, url: str, key: str) -> tuple[str, bytes]:
        from streampack.io.open import open_shard

        where = image_location(self.options.image_root, path, url=url, key=key)
        try:
            with open_shard(where, opts=self.open, stats=self.stats) as f:
                data = f.read(limits.max_member_bytes + 1)
        except DataError as e:
            raise DataError("bad_image", f"image {path!r} cannot be read: {e.detail}", url=url, key=key,
                            value=path) from None
        if len(data) > limits.max_member_bytes:
            raise DataError("member_too_large", f"image {path!r} is over max_member_bytes={limits.max_member_bytes}",
                            url=url, key=key, value=path)
        return path, data


def numbered(members: list[tuple[str, Any]], *, url: str, key: str) -> list[tuple[str, Any]]:
    """A tar sample's image members in placeholder order, numbers compared as numbers (``2.png`` before
    ``10.png``). One image may have any name; with more, every name must end in its number, each once."""
    if len(members) <= 1:
        return members
    keyed: dict[tuple[tuple[int, int | str], ...], str] = {}
    for field, _ in members:
        parts = field.split(".")[:-1]
        if not parts or not _is_number(parts[-1]):
            raise DataError("bad_image", f"image member {field!r} has no number: with more than one image each is "
                            f"named <number>.<ext> (0.jpg, 1.png, ...) to say its placeholder; members "
                            f"{sorted(f for f, _ in members)[:8]}", url=url, key=key, value=field)
        order = tuple((0, int(p)) if _is_number(p) else (1, p) for p in parts)
        if order in keyed:
            raise DataError("bad_image", f"image members {keyed[order]!r} and {field!r} have the same number",
                            url=url, key=key, value=field)
        keyed[order] = field
    by_field = dict(members)
    return [(keyed[order], by_field[keyed[order]]) for order in sorted(keyed)]


def _is_number(part: str) -> bool:
    return part.isascii() and part.isdigit()


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _column_item(item: Any, name: str, *, url: str, key: str) -> tuple[str, Any]:
    """``(name, bytes)`` of one parquet image value: raw bytes or a ``datasets.Image`` struct."""
    if isinstance(item, Mapping):
        name = str(item.get("path") or name)
        item = item.get("bytes")
        if item is None:
            raise DataError("bad_image", f"image {name!r} has no bytes (a path-only datasets.Image is not read)",
                            url=url, key=key, value=name)
    return name, item
