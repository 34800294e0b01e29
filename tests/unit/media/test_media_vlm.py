"""A batch from PackedDataset(media=...) drives a tiny transformers Qwen2-VL (random weights,
built from a config, CPU): the packed forward equals each document run alone through the
model's own unpacked path (its own mRoPE from ``mm_token_type_ids``), logits and loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streampack import PackedDataset
from streampack.media import DynamicResolution, MediaOptions
from streampack.options import PackOptions, TopologyOptions
from tests.helpers_media import IMAGE_ID, write_tar

pytestmark = pytest.mark.slow  # importing transformers' Qwen2-VL takes 10-20 s on the shared box
pytest.importorskip("streampack.layout.vision")
RULE = DynamicResolution(patch_size=2, merge_size=2, min_pixels=8 * 8, max_pixels=24 * 24)


def tiny_qwen2_vl() -> torch.nn.Module:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config={"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "in_channels": 3,
                       "patch_size": 2, "temporal_patch_size": 2, "spatial_merge_size": 2},
        image_token_id=IMAGE_ID, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93)
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(config).eval()


def test_packed_pipeline_batch_equals_each_document_alone(tmp_path: Path) -> None:
    url = str(write_tar(tmp_path / "a.tar", 16, max_images=3, sizes=(8, 30), text=(3, 30)))
    ds = PackedDataset([url], capacity=192, packing=PackOptions(window=16),
                       topology=TopologyOptions(align_multiple=8), epochs=1, seed=1,
                       media=MediaOptions(rule=RULE, image_token_id=IMAGE_ID))
    batch = max(ds, key=lambda b: b.vision.num_images if b.vision is not None else 0)
    v = batch.vision
    assert v.num_images >= 3 and batch.num_docs >= 3 and int(v.image_doc.unique().numel()) >= 2
    model = tiny_qwen2_vl()
    rows = torch.cat([torch.zeros(1, dtype=torch.int64), v.image_grid_thw.prod(1).cumsum(0)])
    with torch.no_grad():
        packed = model(**batch.hf_inputs())
        total = 0.0
        for d, (start, n) in enumerate(zip(batch.cu_seqlens_padded[:-1].tolist(), batch.doc_lengths.tolist())):
            ids, labels = batch.input_ids[start:start + n], batch.hf_inputs().labels[0, start:start + n]
            mine = (v.image_doc == d).nonzero().flatten().tolist()
            kw = {}
            if mine:
                kw = {"pixel_values": torch.cat([v.pixel_values[rows[i]:rows[i + 1]] for i in mine]),
                      "image_grid_thw": v.image_grid_thw[mine], "mm_token_type_ids": (ids == IMAGE_ID).int()[None]}
            alone = model(input_ids=ids[None], labels=labels[None], use_cache=False, **kw)
            torch.testing.assert_close(packed.logits[0, start:start + n], alone.logits[0], atol=2e-5, rtol=1e-4)
            total += float(alone.loss) * int((labels[1:] != -100).sum())
        # one image perturbed: only its own document's logits move (by 0.42 here). The others are held within 1e-5
        # rather than bit-equal: one CI run saw another document's logits differ, by an amount a bit-equality check
        # could not report, and no local run (alone, under load, in the whole slow set) reproduced it; a leak across
        # documents moves logits by 0.4-0.6 (test_a_batch_without_images_keeps_documents_apart)
        hf = batch.hf_inputs()
        owner = int(v.image_doc[0])
        hf.pixel_values = v.pixel_values.clone()
        hf.pixel_values[rows[0]:rows[1]] += 1.0
        moved = model(**hf).logits[0]
    for d, (start, n) in enumerate(zip(batch.cu_seqlens_padded[:-1].tolist(), batch.doc_lengths.tolist())):
        change = float((moved[start:start + n] - packed.logits[0, start:start + n]).abs().max())
        assert change > 1e-2 if d == owner else change < 1e-5, (d, owner, change)
    torch.testing.assert_close(packed.loss, torch.tensor(total / batch.num_targets), atol=1e-5, rtol=1e-5)


def test_a_batch_without_images_keeps_documents_apart(tmp_path: Path) -> None:
    """A media stream batch with no image at all: Qwen2-VL builds its per-document mask from
    ``position_ids [4, 1, T]`` only (with ``[1, T]`` every document attended to the ones before
    it: logits off by 0.4-0.6), so the batch must have that layout too."""
    url = str(write_tar(tmp_path / "t.tar", 12, max_images=0, text=(20, 60)))
    ds = PackedDataset([url], capacity=192, packing=PackOptions(window=12),
                       topology=TopologyOptions(align_multiple=8), epochs=1, seed=1,
                       media=MediaOptions(rule=RULE, image_token_id=IMAGE_ID))
    batch = max(ds, key=lambda b: b.num_docs)
    assert batch.num_docs >= 3 and not bool((batch.input_ids == IMAGE_ID).any())
    model = tiny_qwen2_vl()
    with torch.no_grad():
        packed = model(**batch.hf_inputs()).logits[0]
        for start, n in zip(batch.cu_seqlens_padded[:-1].tolist(), batch.doc_lengths.tolist()):
            alone = model(input_ids=batch.input_ids[None, start:start + n], use_cache=False).logits[0]
            torch.testing.assert_close(packed[start:start + n], alone, atol=2e-5, rtol=1e-4)
    hf = batch.hf_inputs()
    assert hf.position_ids.shape == (4, 1, batch.total_tokens) and hf.pixel_values is None
