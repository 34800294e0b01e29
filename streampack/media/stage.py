"""The length stage: a tokenized image-text sample -> its true packing length, no pixel decoded.

Runs between tokenizing and the overlong policy as a plain function stage, so the resume replay
(:mod:`streampack.nodes.replay`) repeats it on re-read samples like any pure stage and a resume
state keeps references only. Each image's token count comes from its header through the rule
(:mod:`streampack.media.tokens`); each placeholder is expanded to that count
(:mod:`streampack.media.placeholders`). A bad sample follows ``on_error``: ``"skip"`` drops it
(counted with the reading errors), ``"raise"`` raises the :class:`DataError`.
"""

from __future__ import annotations

from streampack.errors import DataError, ErrorCounter, ErrorPolicy
from streampack.media.options import MediaOptions
from streampack.media.placeholders import expand_placeholders
from streampack.sample import Sample


class ExpandImages:
    """``Sample -> Sample | None``: placeholders expanded to the images' token counts."""

    def __init__(self, options: MediaOptions, *, on_error: str = "raise", errors: ErrorCounter | None = None) -> None:
        self.options = options
        self._policy = ErrorPolicy(on_error, errors)

    def counts(self, sample: Sample) -> list[int]:
        rule, out = self.options.rule, []
        for image in sample.images:
            try:
                out.append(rule.count(image.header.width, image.header.height))
            except ValueError as e:  # the rule refuses the shape (Qwen2-VL: aspect ratio over 200)
                raise DataError("bad_image", f"image {image.name!r}: {e}", url=sample.url, key=sample.key,
                                value=(image.header.width, image.header.height)) from None
        return out

    def __call__(self, sample: Sample) -> Sample | None:
        try:
            return expand_placeholders(sample, self.counts(sample), self.options.image_token_id)
        except DataError as e:
            self._policy.handle(e)
            return None

    def __repr__(self) -> str:
        return f"ExpandImages({self.options!r})"
