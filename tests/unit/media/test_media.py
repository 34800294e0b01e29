"""streampack.media units: header-only sizes, token rules and pixels against transformers'
processors, placeholders."""

from __future__ import annotations

import io

import numpy as np
import pytest

from streampack.errors import DataError
from streampack.media import DynamicResolution, FixedTokens, MediaImage, MediaOptions, read_header
from streampack.media.decode import decode_image
from streampack.media.stage import expand_placeholders
from streampack.sample import Sample
from tests.helpers_media import IMAGE_ID, image_bytes, png_header_only

SIZES = [(1, 1), (27, 29), (56, 56), (100, 37), (37, 100), (640, 480), (1920, 1080), (4000, 3000), (3, 500),
         (1023, 7), (28, 2000), (5000, 30), (333, 333), (11, 2100)]


def media_image(data: bytes, name: str = "0.png") -> MediaImage:
    return MediaImage(name=name, data=data, header=read_header(data, url="u", key="k", name=name, max_pixels=1 << 30))


def test_fixed_tokens_is_llava_1_5() -> None:
    assert FixedTokens().count(17, 4000) == 576 == (336 // 14) ** 2


def test_header_is_read_without_decoding_pixels() -> None:
    data = image_bytes(640, 480, "PNG", seed=1)
    cut = data[: len(data) // 3]  # header intact, pixels gone
    header = read_header(cut, url="u", key="k", name="0.png", max_pixels=1 << 30)
    assert (header.width, header.height, header.mode, header.format) == (640, 480, "RGB", "PNG")
    with pytest.raises(DataError, match="bad_image") as e:
        decode_image(MediaImage(name="0.png", data=cut, header=header),
                     MediaOptions(rule=DynamicResolution(), image_token_id=IMAGE_ID), url="u", key="k")
    assert e.value.url == "u" and e.value.key == "k"


def test_bomb_unsupported_mode_and_garbage_are_data_errors() -> None:
    with pytest.raises(DataError, match="image_too_large") as e:
        read_header(png_header_only(10_000, 10_000), url="s.tar", key="k7", name="0.png", max_pixels=32 << 20)
    assert (e.value.url, e.value.key, e.value.value) == ("s.tar", "k7", (10_000, 10_000))
    # past PIL's own bomb limit (2 x Image.MAX_IMAGE_PIXELS) PIL refuses first: still our DataError
    with pytest.raises(DataError, match="image_too_large") as e:
        read_header(png_header_only(50_000, 50_000), url="s.tar", key="k7", name="0.png", max_pixels=1 << 40)
    assert (e.value.url, e.value.key) == ("s.tar", "k7")
    with pytest.raises(DataError, match="unsupported_image_mode"):
        read_header(png_header_only(8, 8, bit_depth=16, color_type=0), url="s", key="k", name="0.png", max_pixels=64)
    with pytest.raises(DataError, match="bad_image"):
        read_header(b"GIF89a" + b"\0" * 40, url="s", key="k", name="0.gif", max_pixels=64)
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n"  # PIL would hand this to Ghostscript
    with pytest.raises(DataError, match="bad_image"):
        read_header(eps, url="s", key="k", name="0.eps", max_pixels=64)


def test_placeholders_expand_with_labels_mask_and_extras() -> None:
    tokens = np.array([5, IMAGE_ID, 6, 7, IMAGE_ID, 8])
    s = Sample(key="k", tokens=tokens, labels=tokens.copy(), extras={"e": np.arange(6)[:, None]})
    out = expand_placeholders(s, [3, 2], IMAGE_ID)
    assert out.tokens.tolist() == [5, 90, 90, 90, 6, 7, 90, 90, 8]
    assert out.loss_mask.tolist() == [True, False, False, False, True, True, False, False, True]
    assert out.labels.tolist() == [5, 90, 90, 90, 6, 7, 90, 90, 8]
    assert out.extras["e"][:, 0].tolist() == [0, 1, 1, 1, 2, 3, 4, 4, 5]
    assert expand_placeholders(out, [3, 2], IMAGE_ID).tokens.tolist() == out.tokens.tolist()  # already expanded
    with pytest.raises(DataError, match="image_placeholder_mismatch") as e:
        expand_placeholders(s, [3], IMAGE_ID)
    assert e.value.key == "k"


def test_adjacent_images_are_cut_by_their_counts() -> None:
    from streampack.media.stage import image_starts

    tokens = np.array([5, IMAGE_ID, IMAGE_ID, 6])
    out = expand_placeholders(Sample(key="k", tokens=tokens), [2, 3], IMAGE_ID)
    assert out.tokens.tolist() == [5] + [IMAGE_ID] * 5 + [6]
    assert image_starts(out.tokens, IMAGE_ID, [2, 3]).tolist() == [1, 3]
    assert image_starts(out.tokens, IMAGE_ID, [2, 2]) is None
    assert expand_placeholders(out, [2, 3], IMAGE_ID).tokens.tolist() == out.tokens.tolist()


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA"])
@pytest.mark.parametrize("lossless", [False, True])
def test_webp_header_from_riff_agrees_with_pil(mode: str, lossless: bool) -> None:
    from PIL import Image

    from streampack.media.header import webp_header

    rng = np.random.default_rng(0)
    for w, h in ((1, 1), (9, 7), (300, 17), (2000, 3)):
        im = Image.fromarray(rng.integers(0, 255, (h, w, 4), dtype=np.uint8), "RGBA").convert(mode)
        out = io.BytesIO()
        im.save(out, "WEBP", lossless=lossless)
        data = out.getvalue()
        pil = Image.open(io.BytesIO(data))
        got = webp_header(data)
        assert got is not None and (got.width, got.height, got.mode) == (pil.width, pil.height, pil.mode)
    assert webp_header(b"RIFF\0\0\0\0WEBPVP8Z" + b"\0" * 20) is None  # unknown chunk: left to PIL
