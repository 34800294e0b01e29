"""``hf_inputs()`` of a batch with images: what transformers' Qwen2-VL, LLaVA and LLaVA-NeXT forwards take.

Qwen2-VL: ``pixel_values [Σ patches, C·t·p·p]``, ``image_grid_thw``, the video pair, and
``position_ids [4, 1, T]`` (text positions on the mRoPE ones, on every batch: with ``[1, T]`` each
document would attend to the ones before it). LLaVA: ``pixel_values [n, 3, H, W]``. LLaVA-NeXT:
``pixel_values [Σ (1 + tiles), 3, S, S]`` and ``image_sizes [n, 2]``. Image tokens' labels are -100.
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
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None


@dataclass(init=False, slots=True, kw_only=True, eq=False)
class LlavaHFInputs(HFInputs):
    """:class:`~streampack.layout.adapters.HFInputs` plus LLaVA's ``pixel_values``."""

    pixel_values: torch.Tensor | None = None


@dataclass(init=False, slots=True, kw_only=True, eq=False)
class LlavaNextHFInputs(HFInputs):
    """:class:`~streampack.layout.adapters.HFInputs` plus LLaVA-NeXT's ``pixel_values`` and ``image_sizes``."""

    pixel_values: torch.Tensor | None = None
    image_sizes: torch.Tensor | None = None


def hf_vision_inputs(batch: Any, text: HFInputs) -> HFInputs:
    vision = batch.vision
    base = {name: getattr(text, name) for name in text}
    # a batch without images (a media stream's, or its filler) gives None pixels: the models
    # skip their vision tower on None, and an empty tensor is not something every encoder takes
    images = vision.num_images > 0
    if vision.image_sizes is not None:
        return LlavaNextHFInputs(base, pixel_values=vision.pixel_values if images else None,
                                 image_sizes=vision.image_sizes if images else None)
    if vision.mrope_position_ids is None:
        return LlavaHFInputs(base, pixel_values=vision.pixel_values if images else None)
    base["position_ids"] = torch.cat([text.position_ids.unsqueeze(0), vision.mrope_position_ids.unsqueeze(1)])
    return VisionHFInputs(base, pixel_values=vision.pixel_values if images else None,
                          image_grid_thw=vision.image_grid_thw if images else None,
                          pixel_values_videos=vision.pixel_values_videos, video_grid_thw=vision.video_grid_thw)
