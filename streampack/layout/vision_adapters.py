"""``hf_inputs()`` of a batch with images: what transformers' Qwen2-VL and LLaVA forwards take.

- Qwen2-VL / Qwen2.5-VL (flattened patches): ``pixel_values [Σ patches, C·t·p·p]``,
  ``image_grid_thw [n, 3]`` and ``position_ids [4, 1, T]`` — the text positions (row 0, from
  which the model builds its packed attention mask when no ``attention_mask`` is given) stacked
  on the 3-D mRoPE positions (rows 1-3), the layout transformers 5 documents for packed input.
- LLaVA (fixed-size images): ``pixel_values [n, 3, H, W]``; text positions as for a text model.

``PackedBatch.hf_inputs()`` adds these to :func:`streampack.layout.adapters.hf_inputs` (which
stays text-only). The image tokens' own labels are already ``-100`` (their loss mask is 0), so no position is
trained to predict an image token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from streampack.layout.adapters import HFInputs


@dataclass(init=False, slots=True, kw_only=True, eq=False)
class VisionHFInputs(HFInputs):
    """:class:`~streampack.layout.adapters.HFInputs` plus the vision inputs."""

    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None


@dataclass(init=False, slots=True, kw_only=True, eq=False)
class LlavaHFInputs(HFInputs):
    """:class:`~streampack.layout.adapters.HFInputs` plus LLaVA's ``pixel_values``."""

    pixel_values: torch.Tensor | None = None


def hf_vision_inputs(batch: Any, text: HFInputs) -> HFInputs:
    vision = batch.vision
    base = {name: getattr(text, name) for name in text}
    if vision.mrope_position_ids is None:
        return LlavaHFInputs(base, pixel_values=vision.pixel_values)
    base["position_ids"] = torch.cat([text.position_ids.unsqueeze(0), vision.mrope_position_ids.unsqueeze(1)])
    return VisionHFInputs(base, pixel_values=vision.pixel_values, image_grid_thw=vision.image_grid_thw)
