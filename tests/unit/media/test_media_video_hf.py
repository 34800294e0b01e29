"""Videos against transformers: pixels as ``Qwen2VLVideoProcessor`` makes them (where torchvision
is installed: transformers' video processors need it), the frames' patch layout against
``Qwen2VLImageProcessorPil`` (always), and a tiny random Qwen2-VL (built from a config, CPU) fed
a packed pipeline batch of image and video documents gives each document's logits and loss as
when run alone through the model's own unpacked path (its own mRoPE from ``mm_token_type_ids``).
Slow only because importing transformers' Qwen2-VL takes 10-20 s on the shared box."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from streampack import PackedDataset
from streampack.media import DynamicResolution, MediaImage, MediaOptions, read_header
from streampack.media.decode import video_pixels
from streampack.media.tokens import VideoFrames
from streampack.media.video import MediaVideo
from streampack.options import PackOptions, TopologyOptions
from tests.helpers_media import IMAGE_ID, VIDEO_ID, image_bytes, write_video_tar
from tests.unit.media.test_media_video import MEDIA, check_videos

pytestmark = pytest.mark.slow


def video(n: int, w: int, h: int, fmt: str = "JPEG") -> MediaVideo:
    frames = []
    for f in range(n):
        data = image_bytes(w, h, fmt, seed=f)
        frames.append(MediaImage(name=f"video.{f}.jpg", data=data,
                                 header=read_header(data, url="u", key="k", name="f", max_pixels=1 << 30)))
    return MediaVideo(name="video", frames=tuple(frames))


def options(rule: VideoFrames) -> MediaOptions:
    return MediaOptions(rule=DynamicResolution(), image_token_id=IMAGE_ID, video=rule, video_token_id=VIDEO_ID)


@pytest.mark.parametrize("rule", [VideoFrames(), VideoFrames(frame=DynamicResolution(min_pixels=28 * 28,
                                                                                     max_pixels=28 * 28 * 6))])
def test_video_pixels_match_transformers_qwen2_vl_video_processor(rule: VideoFrames) -> None:
    pytest.importorskip("torchvision")
    mod = pytest.importorskip("transformers.models.qwen2_vl.video_processing_qwen2_vl")
    proc = mod.Qwen2VLVideoProcessor(min_pixels=rule.frame.min_pixels, max_pixels=rule.frame.max_pixels,
                                     cap_pixels_per_frame=False)
    for n, w, h, fmt in ((4, 640, 480, "JPEG"), (3, 100, 37, "PNG"), (1, 56, 56, "JPEG"), (5, 200, 300, "WEBP")):
        clip = video(n, w, h, fmt)
        got = video_pixels(clip, options(rule), url="u", key="k")
        frames = [Image.open(io.BytesIO(f.data)).convert("RGB") for f in clip.frames]
        want = proc(videos=[frames], return_tensors="pt")
        assert got.grid_thw == tuple(want["video_grid_thw"][0].tolist())
        assert rule.count(n, w, h) == int(want["video_grid_thw"].prod()) // 4
        np.testing.assert_allclose(got.values, want["pixel_values_videos"].numpy(), atol=1e-5, rtol=0)


def test_video_frames_are_patched_as_the_image_processor_patches_each_frame() -> None:
    """Frames already of a ``smart_resize`` size (no resize): temporal slot ``s`` of temporal
    patch ``t`` holds frame ``2t + s`` (the last repeated), patch for patch as
    ``Qwen2VLImageProcessorPil`` cuts that frame alone."""
    mod = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    rule = VideoFrames(frame=DynamicResolution(min_pixels=28 * 28, max_pixels=28 * 28 * 40))
    proc = mod.Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 40)
    clip = video(3, 112, 84)
    got = video_pixels(clip, options(rule), url="u", key="k")
    assert got.grid_thw == (2, 6, 8)
    rows = got.values.reshape(2, 48, 3, 2, 14 * 14)
    for f, frame in enumerate(clip.frames + clip.frames[-1:]):
        alone = proc(images=[Image.open(io.BytesIO(frame.data))], return_tensors="np")["pixel_values"]
        alone = alone.reshape(48, 3, 2, 14 * 14)
        np.testing.assert_allclose(rows[f // 2, :, :, f % 2], alone[:, :, 0], atol=1e-5, rtol=0)


def test_packed_video_batch_equals_each_document_alone(tmp_path: Path) -> None:
    from tests.unit.media.test_media_vlm import tiny_qwen2_vl

    url = str(write_video_tar(tmp_path / "a.tar", 16, frames=(1, 5), sizes=(8, 24)))
    ds = PackedDataset([url], capacity=256, packing=PackOptions(window=16),
                       topology=TopologyOptions(align_multiple=8), epochs=1, seed=1, media=MEDIA)
    batch = max(ds, key=lambda b: (b.vision.num_videos, b.vision.num_images) if b.vision else (0, 0))
    v = batch.vision
    assert check_videos(batch) >= 3 and v.num_images >= 1 and int(v.video_doc.unique().numel()) >= 2
    model = tiny_qwen2_vl()
    rows = torch.cat([torch.zeros(1, dtype=torch.int64), v.image_grid_thw.prod(1).cumsum(0)])
    vrows = torch.cat([torch.zeros(1, dtype=torch.int64), v.video_grid_thw.prod(1).cumsum(0)])
    hf = batch.hf_inputs()
    with torch.no_grad():
        packed = model(**hf)
        total = 0.0
        for d, (start, n) in enumerate(zip(batch.cu_seqlens_padded[:-1].tolist(), batch.doc_lengths.tolist())):
            ids, labels = batch.input_ids[start:start + n], hf.labels[0, start:start + n]
            kw = {"mm_token_type_ids": ((ids == IMAGE_ID).int() + 2 * (ids == VIDEO_ID).int())[None]}
            if mine := (v.image_doc == d).nonzero().flatten().tolist():
                kw |= {"pixel_values": torch.cat([v.pixel_values[rows[i]:rows[i + 1]] for i in mine]),
                       "image_grid_thw": v.image_grid_thw[mine]}
            if mine := (v.video_doc == d).nonzero().flatten().tolist():
                kw |= {"pixel_values_videos": torch.cat([v.pixel_values_videos[vrows[i]:vrows[i + 1]] for i in mine]),
                       "video_grid_thw": v.video_grid_thw[mine]}
            alone = model(input_ids=ids[None], labels=labels[None], use_cache=False, **kw)
            torch.testing.assert_close(packed.logits[0, start:start + n], alone.logits[0], atol=2e-5, rtol=1e-4)
            total += float(alone.loss) * int((labels[1:] != -100).sum())
        hf.pixel_values_videos = v.pixel_values_videos.clone()  # one video perturbed: only its document moves
        hf.pixel_values_videos[vrows[0]:vrows[1]] += 1.0
        moved = model(**hf).logits[0]
    owner = int(v.video_doc[0])
    for d, (start, n) in enumerate(zip(batch.cu_seqlens_padded[:-1].tolist(), batch.doc_lengths.tolist())):
        assert torch.equal(moved[start:start + n], packed.logits[0, start:start + n]) != (d == owner), d
    torch.testing.assert_close(packed.loss, torch.tensor(total / batch.num_targets), atol=1e-5, rtol=1e-5)
