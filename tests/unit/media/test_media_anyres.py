"""LLaVA-NeXT any-res end to end: pixels against transformers' ``LlavaNextImageProcessorPil``,
and a tiny random ``LlavaNextForConditionalGeneration`` (built from a config, CPU) fed a packed
pipeline batch gives each document's logits and loss as when run alone through the model's
own unpacked path (the processor's padded ``[1, max_tiles, 3, S, S]`` form). Slow only because
importing transformers' LLaVA-NeXT stack takes 10-20 s on the shared box."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from streampack import PackedDataset
from streampack.media import AnyResTiles, MediaOptions
from streampack.media.decode import decode_image
from streampack.options import PackOptions, TopologyOptions
from tests.helpers_media import IMAGE_ID, image_bytes, write_tar
from tests.unit.media.test_media import media_image

pytestmark = pytest.mark.slow
TINY = AnyResTiles(grid_pinpoints=((8, 16), (16, 8), (16, 16)), tile_size=8, patch_size=2)
"""CLIP tiles of 8 px, patches of 2: 16 tokens per tile, grids 1x2, 2x1, 2x2."""


def processor(rule: AnyResTiles):
    mod = pytest.importorskip("transformers.models.llava_next.image_processing_pil_llava_next")
    s = rule.tile_size
    return mod.LlavaNextImageProcessorPil(size={"shortest_edge": s}, crop_size={"height": s, "width": s},
                                          image_grid_pinpoints=[list(p) for p in rule.grid_pinpoints])


@pytest.mark.parametrize("rule,sizes", [
    (AnyResTiles(), [(640, 480), (300, 900), (1920, 1080), (100, 37), (336, 336), (1000, 1010)]),
    (TINY, [(20, 9), (9, 20), (5, 5), (31, 30), (8, 8), (16, 8)])])
def test_tiles_match_transformers_llava_next_processor(rule: AnyResTiles, sizes: list[tuple[int, int]]) -> None:
    proc = processor(rule)
    options = MediaOptions(rule=rule, image_token_id=IMAGE_ID)
    for w, h in sizes:
        for fmt, mode in (("PNG", "RGB"), ("JPEG", "RGB"), ("PNG", "RGBA"), ("PNG", "P")):
            data = image_bytes(w, h, fmt, seed=w + h, mode=mode)
            got = decode_image(media_image(data), options, url="u", key="k")
            want = proc(images=[Image.open(io.BytesIO(data))], return_tensors="np")
            assert got.values.shape == want["pixel_values"][0].shape, (w, h)
            np.testing.assert_allclose(got.values, want["pixel_values"][0], atol=1e-5, rtol=0)
            assert got.size == tuple(want["image_sizes"][0].tolist()) == (h, w)
            assert got.grid_thw[0] == got.values.shape[0]


def tiny_llava_next() -> torch.nn.Module:
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    config = LlavaNextConfig(
        vision_config={"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": TINY.tile_size,
                       "patch_size": TINY.patch_size, "projection_dim": 32},
        text_config={"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 1024},
        image_token_index=IMAGE_ID, image_grid_pinpoints=[list(p) for p in TINY.grid_pinpoints],
        vision_feature_select_strategy="default", vision_feature_layer=-1)
    torch.manual_seed(0)
    return LlavaNextForConditionalGeneration(config).eval()


def test_packed_pipeline_batch_equals_each_document_alone(tmp_path: Path) -> None:
    url = str(write_tar(tmp_path / "a.tar", 16, max_images=2, sizes=(5, 30), text=(3, 30)))
    ds = PackedDataset([url], capacity=512, packing=PackOptions(window=16),
                       topology=TopologyOptions(align_multiple=8), epochs=1, seed=1,
                       media=MediaOptions(rule=TINY, image_token_id=IMAGE_ID))
    batch = max(ds, key=lambda b: (int(b.vision.image_doc.unique().numel()), b.num_docs) if b.vision else (0, 0))
    v = batch.vision
    assert v.num_images >= 3 and batch.num_docs >= 3 and int(v.image_doc.unique().numel()) >= 2
    hf = batch.hf_inputs()
    assert hf.pixel_values.shape == (int(v.image_grid_thw[:, 0].sum()), 3, 8, 8) and hf.image_sizes.shape == (
        v.num_images, 2)
    model = tiny_llava_next()
    rows = torch.cat([torch.zeros(1, dtype=torch.int64), v.image_grid_thw[:, 0].cumsum(0)])
    with torch.no_grad():
        packed = model(**hf)
        total = 0.0
        for d, (start, n) in enumerate(zip(batch.cu_seqlens_padded[:-1].tolist(), batch.doc_lengths.tolist())):
            ids, labels = batch.input_ids[start:start + n], hf.labels[0, start:start + n]
            mine = (v.image_doc == d).nonzero().flatten().tolist()
            kw = {}
            if mine:  # the processor's padded form: [n_images, max_tiles, 3, S, S]
                tiles = [v.pixel_values[rows[i]:rows[i + 1]] for i in mine]
                most = max(len(t) for t in tiles)
                kw = {"pixel_values": torch.stack([torch.cat([t, t.new_zeros(most - len(t), *t.shape[1:])])
                                                   for t in tiles]),
                      "image_sizes": v.image_sizes[mine]}
            alone = model(input_ids=ids[None], labels=labels[None], use_cache=False, **kw)
            torch.testing.assert_close(packed.logits[0, start:start + n], alone.logits[0], atol=2e-5, rtol=1e-4)
            total += float(alone.loss) * int((labels[1:] != -100).sum())
        hf.pixel_values = v.pixel_values.clone()  # one image perturbed: only its own document moves
        hf.pixel_values[rows[0]:rows[1]] += 1.0
        moved = model(**hf).logits[0]
    owner = int(v.image_doc[0])
    for d, (start, n) in enumerate(zip(batch.cu_seqlens_padded[:-1].tolist(), batch.doc_lengths.tolist())):
        assert torch.equal(moved[start:start + n], packed.logits[0, start:start + n]) != (d == owner), d
    torch.testing.assert_close(packed.loss, torch.tensor(total / batch.num_targets), atol=1e-5, rtol=1e-5)
