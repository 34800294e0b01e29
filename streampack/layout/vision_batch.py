"""The vision side of a :class:`~streampack.layout.batch.PackedBatch`: pixels and where they go.

Worked example (Qwen2-VL, merge 2; capacity 16): document ``a`` = 2 text tokens, one image of
grid (1, 4, 4) -> 16 patches, 4 image tokens ``I``, then 2 text tokens; document ``b`` text only::

    input_ids              a0 a1 I  I  I  I  a2 a3 | b0 b1 b2 P ...
    pixel_values           [16, 3·2·14·14]           (the image's patches, merge-window order)
    image_grid_thw         [[1, 4, 4]]
    image_doc              [0]                       (document index in the batch)
    image_token_starts     [2]; image_token_lengths [4]
    vision_cu_seqlens      [0, 16]                   (patches per image: varlen attention in the ViT)
    mrope_position_ids     [3, T]: per document, restarting at 0 (Qwen2-VL's rule)

Videos have the same fields prefixed ``video_``; a LLaVA-NeXT image is ``1 + tiles`` rows with its ``(height, width)``
in ``image_sizes``. A media stream gives every batch its :class:`VisionLayout`, so a batch without images (a filler
included) is an empty ``VisionBatch`` and keeps the model's ``position_ids`` layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch


@dataclass(slots=True, kw_only=True, eq=False)
class VisionBatch:
    """Every image (then every video) of a batch, in document order, then order inside a document."""

    pixel_values: torch.Tensor
    """float32 ``[Σ patches, C·t·p·p]`` (Qwen2-VL flattened patches), ``[n_images, 3, H, W]``
    (fixed-size encoders such as LLaVA-1.5's CLIP) or ``[Σ (1 + tiles), 3, S, S]`` (LLaVA-NeXT
    any-res: each image's base view, then its tiles); 0 rows when the batch has only videos."""
    image_grid_thw: torch.Tensor
    """int64 ``[n_images, 3]``: (t, h, w) in patches (Qwen2-VL); (1, H, W) pixels for fixed
    size; (1 + tiles, S, S) for any-res."""
    image_doc: torch.Tensor
    """int64 ``[n_images]``: index of the document (``doc_keys``) each image belongs to."""
    image_token_starts: torch.Tensor
    """int64 ``[n_images]``: position in the batch's token axis of each image's first token."""
    image_token_lengths: torch.Tensor
    """int64 ``[n_images]``: image tokens of each image (a run of the image token id)."""
    image_token_id: int
    vision_cu_seqlens: torch.Tensor | None = None
    """int32 ``[n_images·t + 1]``: cumulative patches per frame, for varlen attention inside the
    vision encoder (flattened patches only)."""
    mrope_position_ids: torch.Tensor | None = None
    """int64 ``[3, T]``: Qwen2-VL 3-D rotary positions (temporal, height, width) of images and
    videos, restarting at each document (flattened patches only)."""
    image_sizes: torch.Tensor | None = None
    """int64 ``[n_images, 2]``: (height, width) of each image as stored (any-res only)."""
    pixel_values_videos: torch.Tensor | None = None
    """float32 ``[Σ t·h·w, C·tp·p·p]``: the videos' flattened patches (None: no video)."""
    video_grid_thw: torch.Tensor | None = None
    """int64 ``[n_videos, 3]``: (t, h, w), t = temporal patches (frames / 2, rounded up)."""
    video_doc: torch.Tensor | None = None
    video_token_starts: torch.Tensor | None = None
    video_token_lengths: torch.Tensor | None = None
    video_token_id: int | None = None
    video_cu_seqlens: torch.Tensor | None = None
    """int32 ``[Σ t + 1]``: cumulative patches per temporal patch of the videos (the vision
    encoder attends inside one at a time)."""

    @property
    def num_images(self) -> int:
        return int(self.image_doc.shape[0])

    @property
    def num_videos(self) -> int:
        return 0 if self.video_doc is None else int(self.video_doc.shape[0])

    def map_tensors(self, once: Any) -> VisionBatch:
        return replace(self, **{f.name: once(v) for f in fields(self)
                                if isinstance(v := getattr(self, f.name), torch.Tensor)})


def _gather(items: list[tuple[int, Any, Any]], starts: Sequence[int]) -> dict[str, torch.Tensor]:
    """Document index, token start, token length and grid of each ``(doc index, doc, item)``."""
    return {"doc": torch.tensor([d for d, _, _ in items], dtype=torch.int64),
            "starts": torch.tensor([starts[d] + im.offset for d, _, im in items], dtype=torch.int64),
            "lengths": torch.tensor([im.length for _, _, im in items], dtype=torch.int64),
            "grid": torch.tensor([im.grid_thw for _, _, im in items], dtype=torch.int64).reshape(-1, 3)}


@dataclass(frozen=True, slots=True, kw_only=True)
class VisionLayout:
    """How a media stream lays out its images, known before any batch has one; given to
    :func:`vision_batch` (``pack_batch(vision_layout=)``), every batch carries a :class:`VisionBatch`."""

    layout: str
    """``patches`` (Qwen2-VL flattened patches), ``image`` (one fixed-size image) or ``tiles``."""
    image_token_id: int
    merge_size: int = 1
    """Spatial merge of the vision encoder (Qwen2-VL: 2; others: 1)."""
    pixel_shape: tuple[int, ...]
    """Trailing shape of ``pixel_values`` rows: ``(C·t·p·p,)``, ``(3, H, W)`` or ``(3, S, S)``."""
    video_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} must be one of {LAYOUTS}")
        if self.merge_size < 1 or not self.pixel_shape or min(self.pixel_shape) < 1:
            raise ValueError(f"merge_size={self.merge_size} and pixel_shape={self.pixel_shape} must be >= 1")


LAYOUTS = ("patches", "image", "tiles")


def _inferred(images: list[tuple[int, Any, Any]], videos: list[tuple[int, Any, Any]]) -> VisionLayout:
    """The layout of a batch given without one: its first image's (or video's), which all must share."""
    first = (images or videos)[0][2]
    if any((im.layout, im.token_id, im.merge_size) != (first.layout, first.token_id, first.merge_size)
           for _, _, im in images) or any(im.merge_size != first.merge_size for _, _, im in videos):
        raise ValueError("documents of one batch mix image layouts (flat patches / tiles / image token id / merge)")
    return VisionLayout(layout=first.layout if images else "patches", image_token_id=first.token_id if images else -1,
                        merge_size=first.merge_size, pixel_shape=tuple(first.pixels.shape[1 if first.flat else 0:]),
                        video_token_id=videos[0][2].token_id if videos else None)


def _check_layout(every: list[tuple[int, Any, Any]], layout: VisionLayout) -> None:
    for _, doc, im in every:
        want = ("patches", layout.video_token_id) if im.video else (layout.layout, layout.image_token_id)
        if (im.layout, im.token_id, im.merge_size) != (*want, layout.merge_size):
            raise ValueError(f"document {doc.doc_key!r} has an image laid out as {im.layout!r} (token id "
                             f"{im.token_id}, merge {im.merge_size}), not as the stream's {layout}")


def vision_batch(docs: Sequence[Any], starts: Sequence[int], input_ids: torch.Tensor,
                 varlen_cu_seqlens: torch.Tensor, layout: VisionLayout | None = None) -> VisionBatch | None:
    """The batch's images and videos from its documents laid out at token offsets ``starts`` (mRoPE restarting at
    ``varlen_cu_seqlens``); with ``layout`` a batch without images is an empty :class:`VisionBatch`, without it None."""
    every = [(d, doc, im) for d, doc in enumerate(docs) for im in doc.images]
    for _, doc, im in every:
        if not hasattr(im, "pixels"):
            raise ValueError(f"document {doc.doc_key!r} carries undecoded images: pack_batch needs them decoded "
                             f"(streampack.media.node.DecodeImages)")
    if not every and layout is None:
        return None
    images = [x for x in every if not x[2].video]
    videos = [x for x in every if x[2].video]
    if layout is None:
        layout = _inferred(images, videos)
    else:
        _check_layout(every, layout)
    got = _gather(images, starts)
    if images:
        pixels = [im.pixels for _, _, im in images]
        pixel_values = torch.from_numpy(np.concatenate(pixels) if layout.layout != "image" else np.stack(pixels))
    else:
        pixel_values = torch.zeros((0, *layout.pixel_shape), dtype=torch.float32)
    out = VisionBatch(pixel_values=pixel_values, image_grid_thw=got["grid"], image_doc=got["doc"],
                      image_token_starts=got["starts"], image_token_lengths=got["lengths"],
                      image_token_id=layout.image_token_id)
    if layout.layout == "tiles":
        out.image_sizes = torch.tensor([im.size for _, _, im in images], dtype=torch.int64).reshape(-1, 2)
    if videos:
        vid = _gather(videos, starts)
        out.pixel_values_videos = torch.from_numpy(np.concatenate([im.pixels for _, _, im in videos]))
        out.video_grid_thw, out.video_doc = vid["grid"], vid["doc"]
        out.video_token_starts, out.video_token_lengths = vid["starts"], vid["lengths"]
        out.video_token_id = videos[0][2].token_id
    if layout.layout == "patches":
        from streampack.layout.vision import mrope_position_ids, vision_cu_seqlens

        out.vision_cu_seqlens = vision_cu_seqlens(out.image_grid_thw)
        if videos:
            out.video_cu_seqlens = vision_cu_seqlens(out.video_grid_thw)
        out.mrope_position_ids = mrope_position_ids(input_ids, varlen_cu_seqlens, out.image_grid_thw,
                                                    out.image_token_id, layout.merge_size,
                                                    video_grid_thw=out.video_grid_thw,
                                                    video_token_id=out.video_token_id)
    return out
