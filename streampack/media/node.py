"""Decode after packing: the stage right after the packer turns emitted packs' images into pixels.

The packer has seen lengths only; a pack leaving it is what will be trained, so decoding here
makes pixel memory and decode CPU scale with what is trained, never with the window: samples
waiting in a window hold their encoded bytes (a 640x480 JPEG: 109 KB), not their pixels (the
same image as Qwen2-VL float32 patches, 3 channels x 2 temporal copies: 1,564 x 1,176 floats,
7.4 MB). The node is a map over packs: its state is its source's plus counters,
so resume is exactly the packer's.

Each image becomes a :class:`DecodedImage` carrying where its tokens sit in its document (the
run of ``image_token_id`` of the same length, in order); a sample whose image runs do not
match its images (a document split by ``overlong="split"`` through an image, a stage that
changed the tokens) is ``DataError("image_tokens_mismatch")``. A bad image follows ``on_error``:
``"skip"`` drops its sample from the pack (counted), ``"raise"`` raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from streampack.errors import DataError, ErrorCounter, ErrorPolicy
from streampack.media.decode import decode_image
from streampack.media.options import MediaOptions
from streampack.media.placeholders import image_starts
from streampack.media.tokens import DynamicResolution
from streampack.sample import Sample


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodedImage:
    """One image of a packed document, ready for the batch."""

    pixels: np.ndarray
    """float32 ``[patches, C·t·p·p]`` (flat patches) or ``[3, H, W]``."""
    grid_thw: tuple[int, int, int]
    offset: int
    """Index of its first image token inside its document."""
    length: int
    """Its image tokens in the text."""
    token_id: int
    merge_size: int
    """Spatial merge of the vision encoder (Qwen2-VL: 2; fixed-size encoders: 1)."""
    flat: bool
    """Whether ``pixels`` are flattened patches (else one ``[3, H, W]`` image)."""


def decode_sample(sample: Sample, options: MediaOptions) -> Sample:
    """``sample`` with every image decoded and placed on its token run; raises DataError."""
    if not sample.images:
        return sample
    assert sample.tokens is not None
    counts = [options.rule.count(im.header.width, im.header.height) for im in sample.images]
    starts = image_starts(sample.tokens, options.image_token_id, counts)
    if starts is None:
        found = int((sample.tokens == options.image_token_id).sum())
        raise DataError("image_tokens_mismatch", f"{found} image tokens are not {len(counts)} contiguous runs of "
                        f"{counts} (a split through an image? use overlong='drop' or a larger capacity)",
                        url=sample.url, key=sample.key, value=found)
    merge = options.rule.merge_size if isinstance(options.rule, DynamicResolution) else 1
    decoded = []
    for image, start, n in zip(sample.images, starts.tolist(), counts):
        px = decode_image(image, options, url=sample.url, key=sample.key)
        decoded.append(DecodedImage(pixels=px.values, grid_thw=px.grid_thw, offset=start, length=n,
                                    token_id=options.image_token_id, merge_size=merge, flat=options.flat_patches))
    return sample.evolve(images=tuple(decoded))


class DecodeImages(BaseNode[list[Sample]]):
    """Packs in, the same packs out with their images decoded (see the module docstring)."""

    SOURCE_KEY = "source"
    COUNTERS_KEY = "counters"

    def __init__(self, source: BaseNode[list[Sample]], options: MediaOptions, *, on_error: str = "raise",
                 errors: ErrorCounter | None = None) -> None:
        super().__init__()
        if not options.decodes:
            raise ValueError(f"{type(options.rule).__name__} counts tokens only; pixels are produced for "
                             f"FixedTokens and DynamicResolution")
        self.source, self.options = source, options
        self._policy = ErrorPolicy(on_error, errors)
        self.counters = {"images": 0, "dropped": 0}

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(None if initial_state is None else initial_state[self.SOURCE_KEY])
        self.counters = {"images": 0, "dropped": 0} if initial_state is None else dict(initial_state[self.COUNTERS_KEY])

    def next(self) -> list[Sample]:
        while True:
            out = []
            for sample in next(self.source):
                try:
                    out.append(decode_sample(sample, self.options))
                    self.counters["images"] += len(sample.images)
                except DataError as e:
                    self._policy.handle(e)
                    self.counters["dropped"] += 1
            if out:
                return out

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict(), self.COUNTERS_KEY: dict(self.counters)}
