"""The length stage: a tokenized image-text sample -> its true packing length, no pixel decoded.

A plain function stage between tokenizing and the overlong policy, so the resume replay repeats it and a state keeps
references only. Each image's token count comes from its header through the rule, each video's from its frame count and
first frame. The text holds one placeholder per image, in image order (Qwen2-VL's ``<|image_pad|>``, LLaVA's
``<image>``), and one ``video_token_id`` per video; each is repeated to its item's count as the HF processors do, with
loss mask 0. An already-expanded sample passes unchanged; any other count is ``image_placeholder_mismatch`` (or
``video_...``), and a bad sample follows ``on_error``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from streampack.errors import DataError, ErrorPolicy
from streampack.media.header import MediaImage
from streampack.media.options import MediaOptions
from streampack.media.video import MediaVideo
from streampack.sample import Sample


def image_starts(tokens: np.ndarray, image_token_id: int, counts: Sequence[int]) -> np.ndarray | None:
    """int64 ``[n_images]``: where each image's tokens start when the placeholders of ``tokens``
    are exactly ``counts[k]`` contiguous tokens per image, in order (two images with no text
    between them are two runs cut by their counts); None otherwise."""
    want = np.asarray(counts, dtype=np.int64)
    where = np.flatnonzero(tokens == image_token_id)
    if where.size != int(want.sum()):
        return None
    ends = np.cumsum(want)
    first, last = where[ends - want], where[ends - 1]
    return first.astype(np.int64) if np.array_equal(last - first, want - 1) else None


def expand_placeholders(sample: Sample, counts: Sequence[int], image_token_id: int, *, kind: str = "image") -> Sample:
    """``sample`` with every image placeholder repeated to its image's token count; labels, loss mask and extras follow
    (extras repeat the placeholder's row). ``kind`` (``"video"``) names what the placeholders stand for in the error."""
    assert sample.tokens is not None, "expand after tokenizing"
    tokens = sample.tokens
    where = np.flatnonzero(tokens == image_token_id)
    want = np.asarray(counts, dtype=np.int64)
    if where.size == len(want):
        reps = np.ones(tokens.shape[0], dtype=np.int64)
        reps[where] = want
    elif image_starts(tokens, image_token_id, want) is not None:
        reps = None  # already expanded
    else:
        raise DataError(f"{kind}_placeholder_mismatch", f"{where.size} {kind} tokens (id {image_token_id}) for "
                        f"{len(want)} {kind}s needing {want.tolist()} tokens: want one placeholder per {kind}",
                        url=sample.url, key=sample.key, value=where.size)
    if reps is not None:
        tokens = np.repeat(tokens, reps)
    image = tokens == image_token_id
    mask = np.ones(tokens.shape[0], dtype=bool) if sample.loss_mask is None else sample.loss_mask.astype(bool)
    labels, extras = sample.labels, sample.extras
    if reps is not None:
        mask = np.repeat(mask, reps) if sample.loss_mask is not None else mask
        labels = None if labels is None else np.repeat(labels, reps)
        extras = {k: np.repeat(v, reps, axis=0) for k, v in extras.items()}
    return sample.evolve(tokens=tokens, labels=labels, loss_mask=mask & ~image, extras=extras)


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


def vision_segments(sample: Sample, options: MediaOptions) -> np.ndarray:
    """int64 ``[k]``: the patches of every vision attention segment of ``sample``'s images and videos, in order (what
    ``CostModel.pack_cost(segments=)`` prices), from their headers through the rule: O(images), no pixel decoded.
    The sample passed :class:`ExpandImages`, so the rule accepts every item's size."""
    return np.asarray([n for item in sample.images for n in item_segments(item, options)], dtype=np.int64)


def item_segments(item: MediaImage | MediaVideo, options: MediaOptions) -> list[int]:
    """The patches of each vision attention segment of one image or video, from its header."""
    h = item.header
    if isinstance(item, MediaVideo):
        assert options.video is not None  # a video is read only with a video rule
        return options.video.segments(len(item.frames), h.width, h.height)
    return options.rule.segments(h.width, h.height)


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
