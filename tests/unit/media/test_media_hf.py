"""streampack.media against transformers' own processors (token counts and pixels on the same
images). Slow only because importing transformers' image-processing stack takes 7-25 s on the
shared box; each comparison itself takes milliseconds."""

from __future__ import annotations

import io
import types

import numpy as np
import pytest
from PIL import Image

from streampack.media import AnyResTiles, DynamicResolution, FixedTokens, MediaOptions
from streampack.media.decode import decode_image
from tests.helpers_media import IMAGE_ID, image_bytes
from tests.unit.media.test_media import SIZES, media_image

pytestmark = pytest.mark.slow


def test_dynamic_resolution_matches_transformers_qwen2_vl() -> None:
    mod = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    proc = mod.Qwen2VLImageProcessorPil()
    rule = DynamicResolution()
    for w, h in SIZES:
        if max(w, h) / min(w, h) > 200:
            with pytest.raises(ValueError):
                mod.smart_resize(h, w)
            with pytest.raises(ValueError):
                rule.count(w, h)
            continue
        assert rule.resized(w, h) == mod.smart_resize(h, w), (w, h)
        patches = proc.get_number_of_image_patches(h, w, {})
        assert rule.count(w, h) == patches // 4, (w, h)
        assert np.prod(rule.grid(w, h)) == patches


def test_any_res_tiles_match_transformers_llava_next() -> None:
    proc = pytest.importorskip("transformers.models.llava_next.processing_llava_next").LlavaNextProcessor
    rule = AnyResTiles()
    fake = types.SimpleNamespace(image_processor=types.SimpleNamespace(image_grid_pinpoints=[list(p) for p in
                                                                                            rule.grid_pinpoints]),
                                 patch_size=14, num_additional_image_tokens=0)
    fake._get_unpadded_features = types.MethodType(proc._get_unpadded_features, fake)
    for w, h in SIZES:
        assert rule.count(w, h) == proc._get_number_of_features(fake, h, w, 336, 336), (w, h)



@pytest.mark.parametrize("fmt,mode", [("PNG", "RGB"), ("JPEG", "RGB"), ("WEBP", "RGB"), ("PNG", "RGBA"),
                                      ("PNG", "P"), ("PNG", "L")])
def test_decode_matches_transformers_qwen2_vl_processor(fmt: str, mode: str) -> None:
    mod = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    rule = DynamicResolution(min_pixels=28 * 28, max_pixels=28 * 28 * 40)
    data = image_bytes(173, 97, fmt, seed=3, mode=mode)
    got = decode_image(media_image(data), MediaOptions(rule=rule, image_token_id=IMAGE_ID), url="u", key="k")
    proc = mod.Qwen2VLImageProcessorPil(min_pixels=rule.min_pixels, max_pixels=rule.max_pixels)
    want = proc(images=[Image.open(io.BytesIO(data))], return_tensors="np")
    assert got.grid_thw == tuple(want["image_grid_thw"][0].tolist())
    assert got.values.shape == want["pixel_values"].shape and got.values.dtype == np.float32
    np.testing.assert_allclose(got.values, want["pixel_values"], atol=1e-5, rtol=0)


def test_decode_matches_transformers_llava_processor() -> None:
    mod = pytest.importorskip("transformers.models.llava.image_processing_pil_llava")
    data = image_bytes(200, 120, "JPEG", seed=4)
    got = decode_image(media_image(data, "0.jpg"), MediaOptions(rule=FixedTokens(), image_token_id=IMAGE_ID),
                       url="u", key="k")
    proc = mod.LlavaImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    want = proc(images=[Image.open(io.BytesIO(data))], return_tensors="np")["pixel_values"][0]
    assert got.values.shape == want.shape == (3, 336, 336)
    np.testing.assert_allclose(got.values, want, atol=1e-5, rtol=0)
