"""The length stage: a tokenized image-text sample -> its true packing length, no pixel decoded.

Runs between tokenizing and the overlong policy as a plain function stage, so the resume replay
(:mod:`streampack.plan.replay`) repeats it on re-read samples like any pure stage and a resume
state keeps references only. Each image's token count comes from its header through the rule
(:mod:`streampack.media.tokens`), each video's from its frame count and first frame's header
(``VideoFrames``); each placeholder is expanded to that count
(:mod:`streampack.media.placeholders`): image placeholders, then video placeholders. A bad
sample follows ``on_error``: ``"skip"`` drops it
(counted with the reading errors), ``"raise"`` raises the :class:`DataError`.
"""

from __future__ import annotations

from streampack.errors import DataError, ErrorCounter, ErrorPolicy
from streampack.media.options import MediaOptions
from streampack.media.placeholders import expand_placeholders
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


class ExpandImages:
    """``Sample -> Sample | None``: placeholders expanded to the images' token counts."""

    def __init__(self, options: MediaOptions, *, on_error: str = "raise", errors: ErrorCounter | None = None) -> None:
        self.options = options
        self._policy = ErrorPolicy(on_error, errors)

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
