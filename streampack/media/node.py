"""Decode after packing: the stage right after the packer turns emitted packs' images into pixels.

Decoding here makes pixel memory and decode CPU scale with what is trained, never with the window: a waiting 640x480
JPEG holds 109 KB, its Qwen2-VL float32 patches 7.4 MB. The node is a map over packs (its state is its source's plus
counters). Each image or video becomes a :class:`DecodedImage` with where its tokens sit in its document; runs of image
tokens that do not match the images are ``DataError("image_tokens_mismatch")``, and a bad image follows ``on_error``
(``"skip"`` drops its sample from the pack, counted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from streampack.errors import DataError, ErrorPolicy
from streampack.layout.vision_batch import VisionLayout
from streampack.media.decode import decode_image, video_pixels
from streampack.media.options import MediaOptions
from streampack.media.stage import item_segments, media_spans
from streampack.media.tokens import AnyResTiles, DynamicResolution, FixedTokens
from streampack.media.video import MediaVideo
from streampack.plan.state import record_of, record_text
from streampack.sample import Sample


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodedImage:
    """One image of a packed document, ready for the batch."""

    pixels: np.ndarray
    """float32 ``[patches, C·t·p·p]`` (layout ``patches``), ``[3, H, W]`` (``image``) or
    ``[1 + tiles, 3, S, S]`` (``tiles``)."""
    grid_thw: tuple[int, int, int]
    offset: int
    """Index of its first image token inside its document."""
    length: int
    """Its image tokens in the text."""
    token_id: int
    merge_size: int
    """Spatial merge of the vision encoder (Qwen2-VL: 2; others: 1)."""
    layout: str
    """``patches`` (Qwen2-VL flattened patches), ``image`` (one fixed-size image) or ``tiles``
    (LLaVA-NeXT base view + tiles)."""
    size: tuple[int, int] = (0, 0)
    """(height, width) as stored (``tiles``: LLaVA-NeXT's ``image_sizes`` row)."""
    video: bool = False
    """A video (``pixel_values_videos``), not an image."""
    segments: tuple[int, ...] = ()
    """Patches of each of its vision attention segments (frames, tiles): what the encoder's cost is priced on
    (``CostModel(vision=...)``), from its header before decoding."""

    @property
    def flat(self) -> bool:
        """Whether ``pixels`` rows concatenate (patches, tiles) rather than stack (images)."""
        return self.layout != "image"


def vision_layout(options: MediaOptions) -> VisionLayout:
    """The layout every batch of a stream with ``options`` has, images or not."""
    rule = options.rule
    if isinstance(rule, DynamicResolution):
        shape: tuple[int, ...] = (3 * rule.temporal_patch_size * rule.patch_size ** 2,)
    elif isinstance(rule, AnyResTiles):
        shape = (3, rule.tile_size, rule.tile_size)
    else:
        assert isinstance(rule, FixedTokens)
        shape = (3, rule.size, rule.size)
    return VisionLayout(layout=options.layout, image_token_id=options.image_token_id,
                        merge_size=rule.merge_size if isinstance(rule, DynamicResolution) else 1,
                        pixel_shape=shape, video_token_id=options.video_token_id)


def decode_sample(sample: Sample, options: MediaOptions) -> Sample:
    """``sample`` with every image and video decoded and placed on its token run; raises DataError."""
    spans = media_spans(sample, options)  # also refuses placeholders in a sample without images
    merge = options.rule.merge_size if options.layout == "patches" else 1
    decoded = []
    for start, stop, i in zip(spans.start.tolist(), spans.stop.tolist(), spans.item.tolist()):
        item = sample.images[i]
        video = isinstance(item, MediaVideo)
        if video:
            px = video_pixels(item, options, url=sample.url, key=sample.key)
        else:
            px = decode_image(item, options, url=sample.url, key=sample.key)
        decoded.append(DecodedImage(pixels=px.values, grid_thw=px.grid_thw, offset=start, length=stop - start,
                                    size=px.size, token_id=options.video_token_id if video else options.image_token_id,
                                    merge_size=merge, layout="patches" if video else options.layout, video=video,
                                    segments=tuple(item_segments(item, options))))
    return sample.evolve(images=tuple(decoded))


class DecodeImages(BaseNode[list[Sample]]):
    """Packs in, the same packs out with their images decoded (see the module docstring)."""

    SOURCE_KEY = "source"
    COUNTERS_KEY = "counters"

    def __init__(self, source: BaseNode[list[Sample]], options: MediaOptions, *,
                 error_policy: ErrorPolicy | None = None) -> None:
        super().__init__()
        self.source, self.options = source, options
        self._policy = error_policy if error_policy is not None else ErrorPolicy()
        self.counters = {"images": 0, "videos": 0, "dropped": 0}

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(None if initial_state is None else initial_state[self.SOURCE_KEY])
        self.counters = {"images": 0, "videos": 0, "dropped": 0}
        if initial_state is not None:
            self.counters.update(record_of(initial_state[self.COUNTERS_KEY]))

    def next(self) -> list[Sample]:
        while True:
            out = []
            for sample in next(self.source):
                try:
                    out.append(decode_sample(sample, self.options))
                    self.counters["images"] += sum(not isinstance(m, MediaVideo) for m in sample.images)
                    self.counters["videos"] += sum(isinstance(m, MediaVideo) for m in sample.images)
                except DataError as e:
                    self._policy.handle(e)
                    self.counters["dropped"] += 1
            if out:
                return out

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict(), self.COUNTERS_KEY: record_text(self.counters)}
