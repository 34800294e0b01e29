"""The length stage: a tokenized image-text sample -> its true packing length, no pixel decoded.

A plain function stage between tokenizing and the overlong policy, so the resume replay repeats it and a state keeps
references only. Each image's token count comes from its header through the rule, each video's from its frame count and
first frame; image then video placeholders are expanded. A bad sample follows ``on_error``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from streampack.errors import DataError, ErrorPolicy
from streampack.media.options import MediaOptions
from streampack.media.placeholders import expand_placeholders, image_starts
from streampack.media.video import MediaVideo
from streampack.sample import Sample


def media_counts(sample: Sample, options: MediaOptions) -> tuple[list[int], list[int]]:
    """Tokens of each image and of each video of ``sample``, in order; a shape the rule refuses
    (Qwen2-VL: an aspect ratio over 200) is ``DataError("bad_image")``."""
    images, videos = [], []
    for item in sample.images:
        h = item.header
        try:
            if isinstance(item, MediaVideo):
                videos.append(options.video.count(len(item.frames), h.width, h.height))
            else:
                images.append(options.rule.count(h.width, h.height))
        except ValueError as e:
            what = "video" if isinstance(item, MediaVideo) else "image"
            raise DataError("bad_image", f"{what} {item.name!r}: {e}", url=sample.url, key=sample.key,
                            value=(h.width, h.height)) from None
    return images, videos


@dataclass(frozen=True, slots=True, kw_only=True)
class MediaSpans:
    """Where the expanded images and videos of one sample sit in its tokens, sorted by start
    (what the overlong policy must not cut through)."""

    start: np.ndarray
    """int64 ``[k]``: first token of each image or video."""
    stop: np.ndarray
    """int64 ``[k]``: one past its last token."""
    item: np.ndarray
    """int64 ``[k]``: its index in ``sample.images``."""


def media_spans(sample: Sample, options: MediaOptions) -> MediaSpans:
    """The token span of every image and video of the expanded ``sample``; a sample whose placeholder runs are not its
    items' counts (a stage after the expansion changed the tokens, or placeholders with no item) is
    ``DataError("image_tokens_mismatch")``."""
    assert sample.tokens is not None
    counts = media_counts(sample, options)
    is_video = np.fromiter((isinstance(m, MediaVideo) for m in sample.images), dtype=bool, count=len(sample.images))
    starts, stops, items = [], [], []
    for kind, token_id, n, index in (("image", options.image_token_id, counts[0], np.flatnonzero(~is_video)),
                                     ("video", options.video_token_id, counts[1], np.flatnonzero(is_video))):
        if token_id is None:
            continue
        first = image_starts(sample.tokens, token_id, n)
        if first is None:
            found = int((sample.tokens == token_id).sum())
            # without items the batch would hand the model placeholders with no pixels (it raises mid-step)
            what = (f"are not {len(n)} contiguous runs of {n} (a stage after the expansion changed the tokens?)" if n
                    else f"in a document without {kind}s")
            raise DataError("image_tokens_mismatch", f"{found} {kind} tokens (id {token_id}) {what}", url=sample.url,
                            key=sample.key, value=found)
        starts.append(first)
        stops.append(first + np.asarray(n, dtype=np.int64))
        items.append(index)
    start, stop, item = (np.concatenate(a).astype(np.int64) for a in (starts, stops, items))
    order = np.argsort(start, kind="stable")
    return MediaSpans(start=start[order], stop=stop[order], item=item[order])


class ExpandImages:
    """``Sample -> Sample | None``: placeholders expanded to the images' token counts."""

    def __init__(self, options: MediaOptions, *, error_policy: ErrorPolicy | None = None) -> None:
        self.options = options
        self._policy = error_policy if error_policy is not None else ErrorPolicy()

    def __call__(self, sample: Sample) -> Sample | None:
        try:
            images, videos = media_counts(sample, self.options)
            sample = expand_placeholders(sample, images, self.options.image_token_id)
            vid = self.options.video_token_id
            if videos or (vid is not None and bool((sample.tokens == vid).any())):
                sample = expand_placeholders(sample, videos, vid, kind="video")
            return sample
        except DataError as e:
            self._policy.handle(e)
            return None

    def __repr__(self) -> str:
        return f"ExpandImages({self.options!r})"
