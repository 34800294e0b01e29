"""Videos as ordered frame lists (where a sample's frames are: ``docs/multimodal.md``), checked on their headers.

Every frame is checked like an image; too many frames (``video_too_long``), frames of different sizes
(``video_frame_size``) or a gap (``bad_video``) is a :class:`~streampack.errors.DataError` under ``on_error``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from streampack.errors import DataError
from streampack.media.header import ImageHeader, MediaImage, read_images


@dataclass(frozen=True, slots=True, kw_only=True)
class MediaVideo:
    """One video of a sample between reading and decoding: its frames' encoded bytes and headers
    (a resume state never holds it; carried samples are re-read from their origin)."""

    name: str
    """Where it came from in the sample (``video``, ``video.1``, ``video[0]``)."""
    frames: tuple[MediaImage, ...]

    @property
    def header(self) -> ImageHeader:
        """The first frame's header (every frame has its size)."""
        return self.frames[0].header


def split_tar_fields(fields: Mapping[str, Any], videos_key: str, is_image: Any) -> tuple[
        list[tuple[str, Any]], dict[str, list[tuple[int, str, Any]]]]:
    """A tar sample's image fields, and its video frames by name: ``{video: [(frame, field, bytes), ...]}``
    (frame -1 for a malformed name, refused by the caller as ``bad_video``)."""
    images, videos = [], {}
    for field in sorted(fields):
        if not is_image(field):
            continue
        parts = field.split(".")
        if parts[0] != videos_key:
            images.append((field, fields[field]))
            continue
        middle = parts[1:-1]
        numeric = all(p.isdigit() for p in middle) and len(middle) in (1, 2)
        name = ".".join(parts[:2]) if numeric and len(middle) == 2 else parts[0]
        frame = int(middle[-1]) if numeric else -1
        videos.setdefault(name, []).append((frame, field, fields[field]))
    return images, videos


def tar_videos(videos: Mapping[str, list[tuple[int, str, Any]]], *, url: str, key: str) -> list[
        tuple[str, list[tuple[str, Any]]]]:
    """Each video's ``(name, [(field, bytes), ...])`` in frame order; videos in number order."""
    if len(videos) > 1 and any("." not in name for name in videos):
        raise DataError("bad_video", f"video frames named both <video>.<frame> and <video>.<v>.<frame>: "
                        f"{sorted(videos)}", url=url, key=key, value=sorted(videos))
    out = []
    for name in sorted(videos, key=lambda n: (len(n), n)):
        frames = sorted(videos[name])
        numbers = [f for f, _, _ in frames]
        if numbers != list(range(len(numbers))):
            raise DataError("bad_video", f"video {name!r} has frames numbered {numbers[:8]}: want 0..n-1 "
                            f"(fields {[f for _, f, _ in frames[:4]]})", url=url, key=key, value=name)
        out.append((name, [(field, data) for _, field, data in frames]))
    return out


def column_videos(value: Any, videos_key: str, *, url: str, key: str) -> list[tuple[str, list[Any]]]:
    """The ``(name, frames)`` of a json / parquet value: one frame list, or a list of frame lists."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError("bad_video", f"field {videos_key!r} must be a non-empty list of frames or of frame lists, "
                        f"got {type(value).__name__}", url=url, key=key, value=videos_key)
    nested = [isinstance(v, (list, tuple)) for v in value]
    if all(nested):
        return [(f"{videos_key}[{v}]", list(frames)) for v, frames in enumerate(value)]
    if any(nested):
        raise DataError("bad_video", f"field {videos_key!r} mixes frames and frame lists", url=url, key=key,
                        value=videos_key)
    return [(f"{videos_key}[0]", list(value))]


def read_video(name: str, frames: list[tuple[str, Any]], *, max_frames: int, max_pixels: int, url: str,
               key: str) -> MediaVideo:
    """One video from its ``(frame name, bytes)`` list, headers read and checked."""
    if not frames:
        raise DataError("bad_video", f"video {name!r} has no frame", url=url, key=key, value=name)
    if len(frames) > max_frames:
        raise DataError("video_too_long", f"video {name!r} has {len(frames)} frames, over max_frames={max_frames}",
                        url=url, key=key, value=len(frames))
    read = read_images(frames, url=url, key=key, max_pixels=max_pixels)
    size = (read[0].header.width, read[0].header.height)
    for frame in read[1:]:
        if (frame.header.width, frame.header.height) != size:
            raise DataError("video_frame_size", f"video {name!r}: frame {frame.name!r} is "
                            f"{frame.header.width}x{frame.header.height}, its first frame {size[0]}x{size[1]}",
                            url=url, key=key, value=frame.name)
    return MediaVideo(name=name, frames=read)
