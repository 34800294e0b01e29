"""Videos as frame lists through PackedDataset: the tar / parquet / jsonl conventions, token counts
from the frame headers, the batch's video fields, hostile videos under on_error, and decode after
packing. Against transformers: ``tests/unit/media/test_media_video_hf.py``."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import streampack.media.node as media_node
from streampack import PackedDataset
from streampack.errors import DataError
from streampack.io.limits import Limits
from streampack.media import AnyResTiles, DynamicResolution, MediaOptions
from streampack.media.tokens import VideoFrames
from streampack.options import PackOptions, ReadOptions, TopologyOptions
from tests.helpers_media import IMAGE_ID, VIDEO_ID, image_bytes, write_tar, write_video_tar

RULE = DynamicResolution(patch_size=2, merge_size=2, min_pixels=8 * 8, max_pixels=24 * 24)
VIDEO = VideoFrames(frame=DynamicResolution(patch_size=2, merge_size=2, min_pixels=8 * 8, max_pixels=16 * 16),
                    max_frames=8)
MEDIA = MediaOptions(rule=RULE, image_token_id=IMAGE_ID, video=VIDEO, video_token_id=VIDEO_ID)


def dataset(urls: list[str], media: MediaOptions = MEDIA, **kw) -> PackedDataset:
    return PackedDataset(urls, media=media, **{"capacity": 128,
                                               "packing": PackOptions(window=8), "epochs": 1, "seed": 3, **kw})


def check_videos(batch) -> int:
    """Every video sits on its own run of video placeholders inside its own document, with its
    patches, grid and per-temporal-patch vision segments; returns the videos."""
    v = batch.vision
    if v is None or v.num_videos == 0:
        assert not bool((batch.input_ids == VIDEO_ID).any())
        return 0
    cu = batch.cu_seqlens_padded.tolist()
    for d, s, n in zip(v.video_doc.tolist(), v.video_token_starts.tolist(), v.video_token_lengths.tolist()):
        assert bool((batch.input_ids[s:s + n] == VIDEO_ID).all()) and cu[d] <= s and s + n <= cu[d + 1]
        assert bool((batch.labels[s - 1:s + n - 1] == batch.ignore_index).all())
    grid = v.video_grid_thw
    assert v.video_token_lengths.tolist() == (grid.prod(1) // 4).tolist()
    assert v.pixel_values_videos.shape == (int(grid.prod(1).sum()), 3 * 2 * 2 * 2)
    frames = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
    assert torch.diff(v.video_cu_seqlens).tolist() == frames.tolist()
    assert v.mrope_position_ids.shape == (3, batch.total_tokens)
    hf = batch.hf_inputs()
    assert hf.pixel_values_videos is v.pixel_values_videos and hf.video_grid_thw is v.video_grid_thw
    assert (hf.pixel_values is None) == (v.num_images == 0)
    return v.num_videos


def test_video_frames_count_from_their_headers() -> None:
    assert VideoFrames().count(4, 640, 480) == 2 * (476 // 28) * (644 // 28)  # smart_resize 480x640 -> 476x644
    assert VideoFrames().count(3, 640, 480) == VideoFrames().count(4, 640, 480)  # the last frame repeats
    with pytest.raises(ValueError, match="max_frames=8"):
        VIDEO.count(9, 16, 16)
    with pytest.raises(ValueError, match="one vision encoder"):
        MediaOptions(rule=DynamicResolution(), image_token_id=IMAGE_ID, video=VIDEO, video_token_id=VIDEO_ID)
    with pytest.raises(ValueError, match="go together"):
        MediaOptions(rule=RULE, image_token_id=IMAGE_ID, video=VIDEO)
    with pytest.raises(ValueError, match="other than image_token_id"):
        MediaOptions(rule=RULE, image_token_id=IMAGE_ID, video=VIDEO, video_token_id=IMAGE_ID)


def test_tar_videos_packed_by_true_length_and_laid_out(tmp_path: Path) -> None:
    url = str(write_video_tar(tmp_path / "a.tar", 24))
    batches = list(dataset([url]))
    assert sum(check_videos(b) for b in batches) > 10  # not vacuous
    assert sum(b.num_docs for b in batches) == 24
    assert sum(b.vision.num_images for b in batches if b.vision is not None) > 3  # images beside videos


def test_only_emitted_packs_are_decoded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = str(write_video_tar(tmp_path / "a.tar", 30))
    calls = []
    real = media_node.video_pixels
    monkeypatch.setattr(media_node, "video_pixels", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = next(iter(dataset([url], packing=PackOptions(window=16))))
    assert len(calls) == (first.vision.num_videos if first.vision is not None else 0)


def test_parquet_and_jsonl_frame_lists(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    root = tmp_path / "frames"
    root.mkdir()
    rows, lines = [], []
    for i in range(4):
        n = 1 + i
        frames = [image_bytes(20, 12, "JPEG", seed=10 * i + f) for f in range(n)]
        ids = [5, VIDEO_ID, 6] + ([VIDEO_ID, 7] if i == 3 else [])
        videos = [[{"bytes": b, "path": f"{i}_{f}.jpg"} for f, b in enumerate(frames)]]
        paths = []
        for f, b in enumerate(frames):
            (root / f"{i}_{f}.jpg").write_bytes(b)
            paths.append(f"{i}_{f}.jpg")
        if i == 3:  # two videos: a list of frame lists
            videos, paths = videos + [videos[0][:2]], [paths, paths[:2]]
        rows.append({"input_ids": ids, "video": videos})
        lines.append(json.dumps({"input_ids": ids, "video": paths}))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    want = [(1, 6, 10), (1, 6, 10), (2, 6, 10), (2, 6, 10), (1, 6, 10)]  # frames 1, 2, 3, 4 + 2 of 20x12
    for url, media in ((tmp_path / "a.parquet", MEDIA), (tmp_path / "a.jsonl", MediaOptions(
            rule=RULE, image_token_id=IMAGE_ID, video=VIDEO, video_token_id=VIDEO_ID, image_root=str(root)))):
        batches = list(dataset([str(url)], media=media, shuffle=False))
        assert sum(check_videos(b) for b in batches) == 5
        grids = sorted(tuple(g) for b in batches for g in b.vision.video_grid_thw.tolist())
        assert grids == sorted(want)


def _frame(w: int, h: int, seed: int = 0) -> bytes:
    return image_bytes(w, h, "JPEG", seed=seed)


@pytest.mark.parametrize("bad,reason,limits", [
    ([(f"video.{f}.jpg", _frame(12, 12, f)) for f in range(9)], "video_too_long", None),
    ([("video.0.jpg", _frame(12, 12)), ("video.1.jpg", _frame(14, 12))], "video_frame_size", None),
    ([("video.0.jpg", _frame(12, 12)), ("video.2.jpg", _frame(12, 12))], "bad_video", None),
    ([("video.x.jpg", _frame(12, 12))], "bad_video", None),
    ([(f"video.{f}.jpg", _frame(40, 40, f)) for f in range(4)], "sample_too_large", Limits(max_sample_pixels=5000)),
    ([("video.0.jpg", b"not a jpeg")], "bad_image", None)])
def test_hostile_videos_follow_on_error(tmp_path: Path, bad, reason: str, limits: Limits | None) -> None:
    url = str(write_video_tar(tmp_path / "a.tar", 10, sizes=(8, 20), frames=(1, 3), bad={4: bad}))
    read = ReadOptions() if limits is None else ReadOptions(limits=limits)
    with pytest.raises(DataError, match=reason) as e:
        list(dataset([url], read=read))
    assert (e.value.url, e.value.key) == (url, "k4")
    ds = dataset([url], read=dataclasses.replace(read, on_error="skip"))
    keys = sorted(k for b in ds for k in b.doc_keys)
    assert keys == sorted(f"{url}#k{i}" for i in range(10) if i != 4)
    assert ds.metrics()["errors"]["counts"] == {reason: 1}


def test_videos_off_reads_frames_as_images(tmp_path: Path) -> None:
    from streampack.media.read import MediaReader

    fields = {"json": b"{}", "video.1.jpg": _frame(12, 12, 1), "video.0.jpg": _frame(12, 12)}
    plain = MediaReader(options=MediaOptions(rule=RULE, image_token_id=IMAGE_ID)).tar_images(
        fields, Limits(), url="u", key="k")
    assert [m.name for m in plain] == ["video.0.jpg", "video.1.jpg"]
    (video,) = MediaReader(options=MEDIA).tar_images(fields, Limits(), url="u", key="k")
    assert [f.name for f in video.frames] == ["video.0.jpg", "video.1.jpg"]
    ten = {f"video.{f}.jpg": _frame(12, 12, f) for f in range(8)} | {"video.1.0.jpg": _frame(12, 12)}
    with pytest.raises(DataError, match="bad_video"):  # video.<f> and video.<v>.<f> in one sample
        MediaReader(options=MEDIA).tar_images(ten, Limits(), url="u", key="k")
    order = {f"video.{f}.jpg": _frame(12, 12, f) for f in (0, 1, 2, 3, 4, 5, 6, 7)}
    (video,) = MediaReader(options=MEDIA).tar_images(order, Limits(), url="u", key="k")
    assert np.array_equal([int(f.name.split(".")[1]) for f in video.frames], np.arange(8))


ANYRES = MediaOptions(rule=AnyResTiles(grid_pinpoints=((8, 16), (16, 8), (16, 16)), tile_size=8, patch_size=2),
                      image_token_id=IMAGE_ID)


@pytest.mark.parametrize("media,write", [(MEDIA, write_video_tar), (ANYRES, write_tar)], ids=["video", "any-res"])
def test_resume_is_exact_and_state_holds_references_only(tmp_path: Path, media: MediaOptions, write) -> None:
    url = str(write(tmp_path / "a.tar", 20, sizes=(5, 30)))
    make = lambda: dataset([url], media=media, packing=PackOptions(window=6), capacity=256)  # noqa: E731
    whole = list(make())
    ds = make()
    it = iter(ds)
    head = [next(it) for _ in range(3)]
    buf = io.BytesIO()
    torch.save(ds.state_dict(), buf)
    assert buf.tell() < 64 * 1024  # references, not pixels or frame bytes
    resumed = make()
    resumed.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    got = head + list(resumed)
    assert len(got) == len(whole) and sum(b.vision is not None for b in whole) > 3
    fields = ("pixel_values", "image_sizes", "pixel_values_videos", "video_grid_thw", "mrope_position_ids")
    for a, b in zip(got, whole):
        assert torch.equal(a.input_ids, b.input_ids) and a.doc_keys == b.doc_keys
        assert (a.vision is None) == (b.vision is None)
        for name in fields if a.vision is not None else ():
            x, y = getattr(a.vision, name), getattr(b.vision, name)
            assert (x is None and y is None) or torch.equal(x, y), name


def test_planned_equal_batches_count_video_tokens(tmp_path: Path) -> None:
    urls = [str(write_video_tar(tmp_path / f"{i}.tar", 8, seed=i)) for i in range(2)]
    got = [list(dataset(urls, topology=TopologyOptions(dp_rank=r, dp_size=2, equal_batches="count"),
                        packing=PackOptions(window=4), read=ReadOptions(cache_dir=str(tmp_path / "cache"))))
           for r in (0, 1)]
    assert len(got[0]) == len(got[1]) > 0
    keys = sorted(k for rank in got for b in rank for k in b.doc_keys if k != "<filler>")
    assert keys == sorted(f"{u}#k{i}" for u in urls for i in range(8))
    assert sum(check_videos(b) for rank in got for b in rank) > 5
