"""``streampack.layout.vision`` against the installed transformers' own Qwen2-VL rules.

Pinned to transformers 5.x (checked on 5.24.0): there ``Qwen2VLModel.get_rope_index`` reads the
modality of each token from ``mm_token_type_ids`` (0 text, 1 image, 2 video) and the vision
tower's segments come from ``transformers.vision_utils.get_vision_cu_seqlens``. transformers 4.x
found images by ``vision_start_token_id`` instead; these tests skip there rather than guess.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from streampack.layout.vision import image_spans, mrope_position_ids, vision_cu_seqlens

transformers = pytest.importorskip("transformers", minversion="5.0")
from transformers.vision_utils import get_vision_cu_seqlens  # noqa: E402

IMAGE, VIDEO, VOCAB = 7, 8, 50


@functools.cache
def qwen2_vl_model() -> type:
    """transformers' ``Qwen2VLModel``, imported when first used: its module costs ~2.5 s, which
    collection would pay in every pytest worker, the ones that never run this file too."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    return Qwen2VLModel


def hf_rope_index(ids: torch.Tensor, image_grid: torch.Tensor | None, video_grid: torch.Tensor | None,
                  merge: int) -> torch.Tensor:
    """transformers' ``get_rope_index`` on one document ``[L]``: ``[3, L]``. It reads only the
    merge size from the config and its own static-like ``get_vision_position_ids``."""
    model = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merge)))
    qwen = qwen2_vl_model()
    model.get_vision_position_ids = functools.partial(qwen.get_vision_position_ids, model)
    types = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    if image_grid is None and video_grid is None:  # text only: the model falls back to arange
        return torch.arange(len(ids)).expand(3, -1)
    pos, _ = qwen.get_rope_index(model, ids[None], mm_token_type_ids=types[None],
                                 image_grid_thw=image_grid, video_grid_thw=video_grid)
    return pos[:, 0]


def random_document(gen: torch.Generator, merge: int, videos: bool) -> dict:
    """Text runs around 0-3 images (and maybe a video); each placeholder run is closed by text,
    as Qwen2-VL's template does with <|vision_end|> (transformers merges adjacent runs)."""
    first = torch.randint(10, VOCAB, (int(torch.randint(0, 5, (), generator=gen)),), generator=gen)
    parts, grids, vgrids = [first], [], []
    for _ in range(int(torch.randint(0, 4, (), generator=gen))):
        is_video = videos and bool(torch.rand((), generator=gen) < 0.4)
        t = int(torch.randint(1, 4, (), generator=gen)) if is_video else 1
        h, w = (merge * int(torch.randint(1, 5, (), generator=gen)) for _ in range(2))
        (vgrids if is_video else grids).append([t, h, w])
        parts.append(torch.full((t * h * w // merge**2,), VIDEO if is_video else IMAGE))
        parts.append(torch.randint(10, VOCAB, (int(torch.randint(1, 6, (), generator=gen)),), generator=gen))
    grid = lambda g: torch.tensor(g, dtype=torch.long).reshape(-1, 3)  # noqa: E731
    return {"ids": torch.cat(parts), "image": grid(grids), "video": grid(vgrids)}


@pytest.mark.parametrize("merge", [1, 2])
@pytest.mark.parametrize("videos", [False, True])
def test_packed_mrope_equals_transformers_per_document(merge: int, videos: bool) -> None:
    gen = torch.Generator().manual_seed(merge + 10 * videos)
    checked_images = 0
    for _ in range(25):
        docs = [random_document(gen, merge, videos) for _ in range(int(torch.randint(1, 5, (), generator=gen)))]
        none = torch.zeros(0, 3, dtype=torch.long)
        docs = [d for d in docs if len(d["ids"])] or [{"ids": torch.tensor([11]), "image": none, "video": none}]
        ids = torch.cat([d["ids"] for d in docs])
        cu = torch.tensor([0] + [len(d["ids"]) for d in docs]).cumsum(0).int()
        want = torch.cat([hf_rope_index(d["ids"], d["image"] if len(d["image"]) else None,
                                        d["video"] if len(d["video"]) else None, merge) for d in docs], 1)
        kw = {"video_grid_thw": torch.cat([d["video"] for d in docs]), "video_token_id": VIDEO} if videos else {}
        got = mrope_position_ids(ids, cu, torch.cat([d["image"] for d in docs]), IMAGE, merge, **kw)
        assert got.dtype == torch.int64 and got.shape == (3, len(ids))
        assert torch.equal(got, want)
        checked_images += sum(len(d["image"]) + len(d["video"]) for d in docs)
    assert checked_images > 20  # the documents did carry images: the equality was not vacuous


def test_worked_example_and_padding_spans() -> None:
    # the module docstring's example, then 3 tokens of pack padding past cu_seqlens[-1]
    ids = torch.tensor([11, 12, IMAGE, IMAGE, IMAGE, IMAGE, 13, 0, 0, 0])
    got = mrope_position_ids(ids, torch.tensor([0, 7], dtype=torch.int32), torch.tensor([[1, 4, 4]]), IMAGE, 2)
    assert got.tolist() == [[0, 1, 2, 2, 2, 2, 4, 0, 1, 2],
                            [0, 1, 2, 2, 3, 3, 4, 0, 1, 2],
                            [0, 1, 2, 3, 2, 3, 4, 0, 1, 2]]


def test_adjacent_images_stay_two_images() -> None:
    # two 1x2x2 images back to back (no text between): cut by token count, not by run
    ids = torch.tensor([11] + [IMAGE] * 8 + [12])
    got = mrope_position_ids(ids, torch.tensor([0, 10]), torch.tensor([[1, 4, 4], [1, 4, 4]]), IMAGE, 2)
    assert got[:, 5:].tolist() == [[3, 3, 3, 3, 5], [3, 3, 4, 4, 5], [3, 4, 3, 4, 5]]


def test_image_spans_record_and_refusals() -> None:
    ids = torch.tensor([11, IMAGE, IMAGE, 12, 13, IMAGE, IMAGE, IMAGE, IMAGE, 14])
    spans = image_spans(ids, torch.tensor([0, 4, 10]), torch.tensor([[1, 2, 4], [1, 4, 4]]), IMAGE, 2)
    assert spans.document.tolist() == [0, 1] and spans.token_start.tolist() == [1, 5]
    assert spans.num_tokens.tolist() == [2, 4] and spans.llm_grid_thw.tolist() == [[1, 1, 2], [1, 2, 2]]
    with pytest.raises(ValueError, match="6 placeholder tokens .* need 8"):
        image_spans(ids, torch.tensor([0, 10]), torch.tensor([[1, 4, 4], [1, 4, 4]]), IMAGE, 2)
    with pytest.raises(ValueError, match="crosses the document boundary at 7"):
        image_spans(ids, torch.tensor([0, 7, 10]), torch.tensor([[1, 2, 4], [1, 4, 4]]), IMAGE, 2)
    with pytest.raises(ValueError, match="not contiguous"):
        image_spans(ids, torch.tensor([0, 10]), torch.tensor([[1, 4, 6]]), IMAGE, 2)
    with pytest.raises(ValueError, match="divisible by spatial_merge_size=2"):
        image_spans(ids, torch.tensor([0, 10]), torch.tensor([[1, 3, 4]]), IMAGE, 2)
    with pytest.raises(ValueError, match=r"\[n_images, 3\]"):
        vision_cu_seqlens(torch.tensor([1, 2, 2]))
    with pytest.raises(ValueError, match="end <= 10"):
        mrope_position_ids(ids, torch.tensor([0, 11]), torch.tensor([[1, 2, 4], [1, 4, 4]]), IMAGE, 2)


def test_vision_cu_seqlens_equals_transformers() -> None:
    gen = torch.Generator().manual_seed(0)
    for n in range(6):
        grid = torch.stack([torch.randint(1, 4, (n,), generator=gen), 2 * torch.randint(1, 9, (n,), generator=gen),
                            2 * torch.randint(1, 9, (n,), generator=gen)], 1)
        got = vision_cu_seqlens(grid)
        assert got.dtype == torch.int32 and torch.equal(got, get_vision_cu_seqlens(grid))
        assert int(got[-1]) == int(grid.prod(1).sum())
    assert vision_cu_seqlens(torch.tensor([[1, 4, 6], [2, 2, 2]])).tolist() == [0, 24, 28, 32]
