"""The vision side of a packed batch in vectorised torch: per-frame attention spans for the vision
encoder and Qwen2-VL's 3-D rotary positions (mRoPE), per document.

Qwen2-VL's vision tower attends inside one frame: an image of grid ``(t, h, w)`` is ``t`` segments of
``h·w`` patches (grids ``[[1, 4, 6], [2, 2, 2]]`` give ``cu_seqlens = [0, 24, 28, 32]``). mRoPE
(``get_rope_index``, per document): a text token has the same id on all three axes, one more than the
previous item; placeholder ``(ti, hi, wi)`` of an image gets ``start + (ti, hi, wi)`` and the text
after it resumes at ``start + max(h/m, w/m)``. With m = 2, ``[txt, txt, img×4 (grid 1×4×4), txt]``::

    temporal  0 1  2 2 2 2  4
    height    0 1  2 2 3 3  4
    width     0 1  2 3 2 3  4

Positions restart at every span. A placeholder run is cut by each image's token count, so adjacent
images stay two (transformers would merge them); elsewhere both agree (``tests/unit/layout/test_vision_layout.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageSpans:
    """Where each image's placeholder tokens sit in a packed token axis (one row per image, in order of appearance)."""

    document: torch.Tensor
    """int64 ``[n_images]``: index of the ``cu_seqlens`` span (document) holding the image."""
    token_start: torch.Tensor
    """int64 ``[n_images]``: token index of its first placeholder in the packed axis."""
    num_tokens: torch.Tensor
    """int64 ``[n_images]``: its placeholder count, ``t · (h/m) · (w/m)``."""
    llm_grid_thw: torch.Tensor
    """int64 ``[n_images, 3]``: its grid as the language model sees it, ``(t, h/m, w/m)``."""

    def __len__(self) -> int:
        return int(self.num_tokens.numel())


def _check_grid(grid_thw: torch.Tensor, what: str) -> torch.Tensor:
    if grid_thw.ndim != 2 or grid_thw.shape[1] != 3:
        raise ValueError(f"{what} must be [n_images, 3] (t, h, w), got shape {tuple(grid_thw.shape)}")
    if grid_thw.is_floating_point() or grid_thw.dtype == torch.bool:
        raise TypeError(f"{what} must be an integer tensor, got {grid_thw.dtype}")
    if grid_thw.numel() and int(grid_thw.min()) < 1:
        raise ValueError(f"{what} must be >= 1 everywhere, got {grid_thw.tolist()}")
    return grid_thw.long()


def vision_cu_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    """int32 ``[Σ t + 1]``: cumulative patch counts of the vision encoder's attention segments, one per
    frame, leading 0, from ``grid_thw`` (int ``[n_images, 3]`` patch grids before the spatial merge)."""
    grid = _check_grid(grid_thw, "grid_thw")
    frames = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
    return F.pad(frames.cumsum(0, dtype=torch.int32), (1, 0), value=0)


def _spans(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """int64 span offsets covering ``[0, total)``: ``cu_seqlens``, plus a final span for the
    trailing tokens past ``cu_seqlens[-1]`` (pack padding)."""
    cu = cu_seqlens.long()
    if cu.ndim != 1 or cu.numel() < 1 or int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must be 1-D and start at 0, got {cu_seqlens.tolist()}")
    if bool((cu[1:] < cu[:-1]).any()) or int(cu[-1]) > total:
        raise ValueError(f"cu_seqlens must be non-decreasing and end <= {total} tokens, "
                         f"got {cu_seqlens.tolist()}")
    return cu if int(cu[-1]) == total else torch.cat([cu, cu.new_tensor([total])])


def image_spans(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, image_grid_thw: torch.Tensor,
                image_token_id: int, spatial_merge_size: int) -> ImageSpans:
    """Map each image (a row of ``image_grid_thw``) to its document and its run of placeholders in the
    packed ``input_ids`` (int ``[T]``); ``ValueError`` when the counts differ, a run is not contiguous or
    crosses a document boundary (an image's features would land on another document's tokens)."""
    if input_ids.ndim != 1:
        raise ValueError(f"input_ids must be the packed token axis [T], got shape {tuple(input_ids.shape)}")
    if spatial_merge_size < 1:
        raise ValueError(f"{spatial_merge_size=} must be >= 1")
    grid = _check_grid(image_grid_thw, "image_grid_thw").to(input_ids.device)
    m = spatial_merge_size
    if bool((grid[:, 1:] % m).any()):
        raise ValueError(f"image grids must have h and w divisible by {spatial_merge_size=}, "
                         f"got {grid.tolist()}")
    llm_grid = torch.stack([grid[:, 0], grid[:, 1] // m, grid[:, 2] // m], 1)
    counts = llm_grid.prod(1)
    where = (input_ids == image_token_id).nonzero().flatten()
    if where.numel() != int(counts.sum()):
        raise ValueError(f"{where.numel()} placeholder tokens (id {image_token_id}) but the "
                         f"{len(grid)} image grids need {int(counts.sum())}: {grid.tolist()}")
    ends = counts.cumsum(0)
    first = where[ends - counts] if len(grid) else where[:0]
    last = where[ends - 1] if len(grid) else where[:0]
    if bool((last - first != counts - 1).any()):
        bad = int((last - first != counts - 1).nonzero()[0])
        raise ValueError(f"image {bad}'s {int(counts[bad])} placeholders are not contiguous "
                         f"(tokens {int(first[bad])}..{int(last[bad])})")
    spans = _spans(cu_seqlens.to(input_ids.device), input_ids.numel())
    doc = torch.searchsorted(spans, first, right=True) - 1
    crosses = torch.searchsorted(spans, last, right=True) - 1 != doc
    if bool(crosses.any()):
        bad = int(crosses.nonzero()[0])
        raise ValueError(f"image {bad} (tokens {int(first[bad])}..{int(last[bad])}) crosses the "
                         f"document boundary at {int(spans[doc[bad] + 1])}")
    return ImageSpans(document=doc, token_start=first, num_tokens=counts, llm_grid_thw=llm_grid)


def _vision_offsets(spans: ImageSpans, total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The placeholders of ``spans``: token indices, (ti, hi, wi) offsets ``[n, 3]`` and image index."""
    counts = spans.num_tokens
    image = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
    local = torch.arange(image.numel(), device=counts.device) - (counts.cumsum(0) - counts)[image]
    h, w = spans.llm_grid_thw[image, 1], spans.llm_grid_thw[image, 2]
    offsets = torch.stack([local // (h * w), (local % (h * w)) // w, local % w], 1)
    return spans.token_start[image] + local, offsets, image


def mrope_position_ids(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, image_grid_thw: torch.Tensor,
                       image_token_id: int, spatial_merge_size: int, *,
                       video_grid_thw: torch.Tensor | None = None,
                       video_token_id: int | None = None) -> torch.Tensor:
    """int64 ``[3, T]``: Qwen2-VL's mRoPE positions of the packed ``input_ids`` (int ``[T]``), restarting
    at every span of ``cu_seqlens`` (int ``[n+1]``); ``get_rope_index`` run on each document alone.
    ``image_grid_thw`` / ``video_grid_thw``: int ``[n, 3]`` patch grids before the merge, in run order."""
    total = input_ids.numel()
    kinds = [image_spans(input_ids, cu_seqlens, image_grid_thw, image_token_id, spatial_merge_size)]
    if video_grid_thw is not None:
        if video_token_id is None or video_token_id == image_token_id:
            raise ValueError(f"video_grid_thw needs its own video_token_id, got {video_token_id=}")
        kinds.append(image_spans(input_ids, cu_seqlens, video_grid_thw, video_token_id, spatial_merge_size))
    # advance[i]: how far token i moves the next item's start; a text token moves it by 1, an
    # image by max(h/m, w/m), charged at its last placeholder; its other placeholders by 0.
    advance = torch.ones(total, dtype=torch.long, device=input_ids.device)
    placed = []
    for spans in kinds:
        index, offsets, image = _vision_offsets(spans, total)
        advance[index] = 0
        last = spans.token_start + spans.num_tokens - 1
        advance[last] = spans.llm_grid_thw[:, 1:].amax(1)
        placed.append((index, offsets, spans.token_start[image]))
    start = advance.cumsum(0) - advance  # exclusive prefix sum over the whole pack ...
    bounds = _spans(cu_seqlens.to(input_ids.device), total)
    doc = torch.searchsorted(bounds, torch.arange(total, device=input_ids.device), right=True) - 1
    start = start - start[bounds[doc]]  # ... restarted at each document's first token
    positions = start.expand(3, total).clone()
    for index, offsets, first in placed:
        positions[:, index] = (start[first][:, None] + offsets).T
    return positions
