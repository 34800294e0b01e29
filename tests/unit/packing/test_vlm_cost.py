"""The vision part of ``CostModel``: hand-computed costs, the FLOP formula against torch's FLOP
counter on transformers' own Qwen2-VL vision tower, and the segments it prices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streampack.layout.vision import vision_cu_seqlens
from streampack.packing import CostModel, pack_flat
from streampack.packing.cost import VisionCost, VisionLoad, frame_patches


def test_vision_costs_by_hand() -> None:
    model = CostModel(linear=2.0, attention=3.0, vision=VisionCost(linear=5.0, attention=7.0))
    # text [4, 6] plus segments of 8 and 2 patches: 2·10 + 3·52 + 5·10 + 7·68
    assert model.pack_cost([4, 6], segments=[8, 2]) == 20 + 156 + 50 + 476
    assert model.pack_cost([4, 6]) == 20 + 156  # no images: the text cost, as before
    assert model.pack_cost([4, 6], padded_to=16, segments=[]) == 32 + 156
    # same patches, one image against four: attention is per image, so the big one costs more
    assert model.pack_cost([], segments=[16]) - model.pack_cost([], segments=[4] * 4) == 7.0 * (256 - 64)
    with pytest.raises(ValueError, match="no vision encoder"):
        CostModel(linear=1.0, attention=1.0).pack_cost([3], segments=[4])
    with pytest.raises(ValueError, match="vision coefficients must be >= 0"):
        VisionCost(linear=-1.0, attention=0.0)
    with pytest.raises(ValueError, match="spatial_merge=0"):
        VisionCost.from_shape(hidden=8, layers=1, mlp=8, patch_dim=4, spatial_merge=0)


def test_frame_patches_are_the_vision_cu_seqlens_segments() -> None:
    grid = np.array([[1, 4, 6], [2, 2, 2], [3, 8, 2]])
    assert frame_patches(grid).tolist() == [24, 4, 4, 16, 16, 16]
    assert frame_patches(grid).tolist() == torch.diff(vision_cu_seqlens(torch.from_numpy(grid))).tolist()
    assert frame_patches(np.zeros((0, 3))).size == 0
    with pytest.raises(ValueError, match=">= 1"):
        frame_patches(np.array([[1, 0, 4]]))


def test_vectorised_vision_costs_match_one_pack_at_a_time() -> None:
    rng = np.random.default_rng(0)
    model = CostModel.from_shape(hidden=64, layers=2, heads=4, ffn=256, vocab=100)
    model = CostModel(linear=model.linear, attention=model.attention,
                      vision=VisionCost.from_shape(hidden=32, layers=2, mlp=128, patch_dim=24, spatial_merge=2,
                                                   out_hidden=64))
    grids = [rng.integers(1, 9, (int(rng.integers(0, 4)), 3)) * np.array([1, 2, 2]) for _ in range(300)]
    segments = [frame_patches(g) for g in grids]
    lengths = rng.integers(1, 100, 300) + np.array([s.sum() // 4 for s in segments])
    result = pack_flat(lengths, 2048, "bfd")
    costs = model.pack_costs(result, lengths, vision=VisionLoad.of(segments))
    one_by_one = [model.pack_cost(lengths[b], segments=np.concatenate([segments[i] for i in b])) for b in result.bins()]
    assert np.allclose(costs, one_by_one, rtol=1e-12)
    text_only = model.pack_costs(result, lengths)
    assert (costs >= text_only).all() and (costs > text_only).sum() > result.num_bins // 2
    assert model.batch_cost(result, lengths, vision=VisionLoad.of(segments)) == pytest.approx(sum(one_by_one))
    with pytest.raises(ValueError, match="vision loads of shape"):
        model.pack_costs(result, lengths, vision=VisionLoad.of(segments[:5]))


def _tiny_vision_tower(layers: int, merge: int):
    transformers = pytest.importorskip("transformers", minversion="5.0")
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    assert transformers.__version__
    config = Qwen2VLVisionConfig(depth=layers, embed_dim=32, hidden_size=48, num_heads=2, mlp_ratio=4,
                                 patch_size=2, temporal_patch_size=2, spatial_merge_size=merge, in_channels=3)
    # eager attention: torch's FLOP counter does not count CPU sdpa's kernel, and eager's two
    # matmuls per segment are exactly what the formula prices (4eS² per layer)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return Qwen2VisionTransformerPretrainedModel(config).eval()


@pytest.mark.parametrize("merge", [1, 2])
def test_vision_formula_matches_counted_flops_of_transformers_qwen2_vl_tower(merge: int) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    tower = _tiny_vision_tower(layers=2, merge=merge)
    grid = torch.tensor([[1, 4, 6], [2, 2, 2], [1, 8, 8]])
    pixels = torch.randn(int(grid.prod(1).sum()), 3 * 2 * 2 * 2)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        tower(pixels, grid_thw=grid)
    model = VisionCost.from_shape(hidden=32, layers=2, mlp=128, patch_dim=24, spatial_merge=merge,
                                  out_hidden=48, training=False)
    assert model.cost(frame_patches(grid.numpy())) == counter.get_total_flops()
    trained = VisionCost.from_shape(hidden=32, layers=2, mlp=128, patch_dim=24, spatial_merge=merge,
                                    out_hidden=48)
    assert (trained.linear, trained.attention) == (3 * model.linear, 3 * model.attention)


def test_each_rules_segments_are_the_frames_and_tiles_its_encoder_attends_within() -> None:
    """What a media stream prices (``streampack.media.stage.vision_segments``) is each image's and video's patch
    grid, from its size alone: Qwen2-VL one segment per frame (``frame_patches`` of ``image_grid_thw`` /
    ``video_grid_thw``), LLaVA-NeXT one per tile and the base view (as many as ``decode_image`` makes), LLaVA-1.5
    one of its tokens."""
    from streampack.media import AnyResTiles, DynamicResolution, FixedTokens, MediaOptions, VideoFrames
    from streampack.media.decode import decode_image
    from tests.helpers_media import image_bytes
    from tests.unit.media.test_media import media_image

    rule, video = DynamicResolution(), VideoFrames()
    for w, h in ((640, 480), (28, 28), (3000, 20), (1920, 1080)):
        assert rule.segments(w, h) == frame_patches(np.array([rule.grid(w, h)])).tolist()
        assert video.segments(5, w, h) == frame_patches(np.array([video.grid(5, w, h)])).tolist()
        assert len(video.segments(5, w, h)) == 3  # 5 frames in temporal patches of 2
    tiles = AnyResTiles(grid_pinpoints=((8, 16), (16, 8), (16, 16)), tile_size=8, patch_size=2)
    for w, h in ((20, 9), (9, 20), (5, 5), (31, 30)):
        decoded = decode_image(media_image(image_bytes(w, h)), MediaOptions(rule=tiles, image_token_id=1),
                               url="u", key="k")
        assert tiles.segments(w, h) == [16] * decoded.values.shape[0]
    assert FixedTokens().segments(640, 480) == [576]


@pytest.mark.parametrize("name", ["qwen2-vl", "qwen2-vl video", "llava-next", "llava-1.5"])
def test_vision_bound_is_the_most_a_packs_images_cost(name: str) -> None:
    """The balanced emission's histogram spans a full pack's text cost plus ``MediaOptions.vision_bound``: no
    image of any size may cost its encoder more per token than the bound does."""
    from streampack.media import AnyResTiles, DynamicResolution, FixedTokens, MediaOptions, VideoFrames

    encoder = VisionCost(linear=5.0, attention=3.0)
    rule = {"llava-next": AnyResTiles(), "llava-1.5": FixedTokens()}.get(name, DynamicResolution())
    video = VideoFrames() if name == "qwen2-vl video" else None
    media = MediaOptions(rule=rule, image_token_id=1, video=video, video_token_id=None if video is None else 2)
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(300):
        w, h = (int(v) for v in np.exp(rng.uniform(np.log(8), np.log(6000), 2)))
        if max(w, h) / min(w, h) > 200:
            continue
        if video is not None:
            frames = int(rng.integers(1, 9))
            per_token = encoder.cost(video.segments(frames, w, h)) / video.count(frames, w, h)
        else:
            per_token = encoder.cost(rule.segments(w, h)) / rule.count(w, h)
        worst = max(worst, per_token)
    bound = media.vision_bound(encoder, 1)
    assert worst <= bound
    assert worst > {"llava-1.5": 0.99}.get(name, 0.5) * bound  # a bound, and not a loose one
