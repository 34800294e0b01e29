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

The pure functions that compute ``vision_cu_seqlens`` and the 3-D mRoPE position ids live in
:mod:`streampack.layout.vision`; this module only gathers a batch's images and calls them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch


@dataclass(slots=True, kw_only=True, eq=False)
class VisionBatch:
    """Every image of a batch, in document order, then image order inside a document."""

    pixel_values: torch.Tensor
    """float32 ``[Σ patches, C·t·p·p]`` (Qwen2-VL flattened patches) or ``[n_images, 3, H, W]``
    (fixed-size encoders such as LLaVA-1.5's CLIP)."""
    image_grid_thw: torch.Tensor
    """int64 ``[n_images, 3]``: (t, h, w) in patches (Qwen2-VL); (1, H, W) pixels for fixed size."""
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
    """int64 ``[3, T]``: Qwen2-VL 3-D rotary positions (temporal, height, width), restarting at
    each document (flattened patches only)."""

    @property
    def num_images(self) -> int:
        return int(self.image_doc.shape[0])

    def map_tensors(self, once: Any) -> VisionBatch:
        return replace(self, **{name: once(getattr(self, name)) for name in _TENSORS if getattr(self, name) is not None})


_TENSORS = ("pixel_values", "image_grid_thw", "image_doc", "image_token_starts", "image_token_lengths",
            "vision_cu_seqlens", "mrope_position_ids")


def vision_batch(docs: Sequence[Any], starts: Sequence[int], input_ids: torch.Tensor,
                 varlen_cu_seqlens: torch.Tensor) -> VisionBatch | None:
    """The batch's images from its documents (``streampack.media.node.DecodedImage`` each) laid
    out at token offsets ``starts``; None when no document has an image. mRoPE positions
    restart at the spans of ``varlen_cu_seqlens``, the spans ``hf_inputs``' text positions
    restart at (a pack's trailing padding is its own span)."""
    images = [(d, doc, im) for d, doc in enumerate(docs) for im in doc.images]
    if not images:
        return None
    first = images[0][2]
    for _, doc, im in images:
        if not hasattr(im, "pixels"):
            raise ValueError(f"document {doc.doc_key!r} carries undecoded images: pack_batch needs them decoded "
                             f"(streampack.media.node.DecodeImages)")
        if (im.flat, im.token_id, im.merge_size) != (first.flat, first.token_id, first.merge_size):
            raise ValueError("documents of one batch mix image layouts (flat patches / image token id / merge)")
    doc_index = torch.tensor([d for d, _, _ in images], dtype=torch.int64)
    token_starts = torch.tensor([starts[d] + im.offset for d, _, im in images], dtype=torch.int64)
    lengths = torch.tensor([im.length for _, _, im in images], dtype=torch.int64)
    grid = torch.tensor([im.grid_thw for _, _, im in images], dtype=torch.int64).reshape(-1, 3)
    if first.flat:
        pixels = torch.from_numpy(np.concatenate([im.pixels for _, _, im in images]))
    else:
        pixels = torch.from_numpy(np.stack([im.pixels for _, _, im in images]))
    out = VisionBatch(pixel_values=pixels, image_grid_thw=grid, image_doc=doc_index, image_token_starts=token_starts,
                      image_token_lengths=lengths, image_token_id=first.token_id)
    if first.flat:
        from streampack.layout.vision import mrope_position_ids, vision_cu_seqlens

        out.vision_cu_seqlens = vision_cu_seqlens(grid)
        out.mrope_position_ids = mrope_position_ids(input_ids, varlen_cu_seqlens, grid, first.token_id,
                                                    first.merge_size)
    return out
