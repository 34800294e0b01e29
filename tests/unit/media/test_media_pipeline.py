"""Image-text samples through PackedDataset: every format, true lengths, decode after packing,
exact resume with references only, hostile images under on_error."""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import streampack.media.node as media_node
from streampack import PackedDataset
from streampack.errors import DataError
from streampack.media import DynamicResolution, FixedTokens, MediaOptions
from streampack.options import PackOptions, ReadOptions, TopologyOptions
from tests.helpers_media import IMAGE_ID, image_bytes, png_header_only, sample_ids, write_tar

needs_vision = pytest.mark.skipif(importlib.util.find_spec("streampack.layout.vision") is None,
                                  reason="Qwen2-VL batches need streampack.layout.vision (mRoPE, vision cu_seqlens)")

RULE = DynamicResolution(patch_size=14, merge_size=2, min_pixels=28 * 28, max_pixels=28 * 28 * 9)
MEDIA = MediaOptions(rule=RULE, image_token_id=IMAGE_ID)
FIXED = MediaOptions(rule=FixedTokens(size=28, tokens=4), image_token_id=IMAGE_ID)


def dataset(urls: list[str], media: MediaOptions = MEDIA, **kw) -> PackedDataset:
    args = {"capacity": 96, "packing": PackOptions(window=8), "epochs": 1, "seed": 3, **kw}
    return PackedDataset(urls, media=media, **args)


def check_vision(batch, rule=RULE) -> int:
    """Every image sits on its own run of placeholders inside its own document; returns images."""
    v = batch.vision
    if v is None:
        assert not bool((batch.input_ids == IMAGE_ID).any())
        return 0
    cu = batch.cu_seqlens_padded.tolist()
    for d, s, n in zip(v.image_doc.tolist(), v.image_token_starts.tolist(), v.image_token_lengths.tolist()):
        assert bool((batch.input_ids[s:s + n] == IMAGE_ID).all())
        assert cu[d] <= s and s + n <= cu[d] + int(batch.doc_lengths[d])
        assert bool((batch.labels[s - 1:s + n - 1] == batch.ignore_index).all())  # nothing predicts an image token
    assert int((batch.input_ids == IMAGE_ID).sum()) == int(v.image_token_lengths.sum())
    if isinstance(rule, DynamicResolution):
        assert v.pixel_values.shape == (int(v.image_grid_thw.prod(1).sum()), 3 * 2 * 14 * 14)
        assert v.image_token_lengths.tolist() == (v.image_grid_thw.prod(1) // 4).tolist()
        assert v.vision_cu_seqlens.tolist()[-1] == v.pixel_values.shape[0]
        assert v.mrope_position_ids.shape == (3, batch.total_tokens)
    return v.num_images


@needs_vision
def test_tar_images_packed_by_true_length_and_laid_out(tmp_path: Path) -> None:
    url = str(write_tar(tmp_path / "a.tar", 30, max_images=3))
    batches = list(dataset([url]))
    images = sum(check_vision(b) for b in batches)
    assert images > 20  # the checks above ran on real images, not vacuously
    assert sum(b.num_docs for b in batches) == 30
    hf = batches[0].hf_inputs()
    assert hf.position_ids.shape == (4, 1, batches[0].total_tokens)
    assert hf.pixel_values is batches[0].vision.pixel_values


@needs_vision
def test_only_emitted_packs_are_decoded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = str(write_tar(tmp_path / "a.tar", 40, max_images=2))
    calls = []
    real = media_node.decode_image
    monkeypatch.setattr(media_node, "decode_image", lambda *a, **k: calls.append(1) or real(*a, **k))
    it = iter(dataset([url], packing=PackOptions(window=16)))
    first = next(it)
    assert len(calls) == (first.vision.num_images if first.vision is not None else 0)  # not the window's 16 samples


@needs_vision
def test_resume_is_exact_and_state_holds_no_image_bytes(tmp_path: Path) -> None:
    url = str(write_tar(tmp_path / "a.tar", 36, max_images=2))
    whole = list(dataset([url], packing=PackOptions(window=6)))
    ds = dataset([url], packing=PackOptions(window=6))
    it = iter(ds)
    head = [next(it) for _ in range(3)]
    buf = io.BytesIO()
    torch.save(ds.state_dict(), buf)
    assert buf.tell() < 64 * 1024  # references, not pixels or bytes
    resumed = dataset([url], packing=PackOptions(window=6))
    resumed.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    rest = list(resumed)
    assert len(head) + len(rest) == len(whole)
    for a, b in zip(head + rest, whole):
        assert torch.equal(a.input_ids, b.input_ids) and a.doc_keys == b.doc_keys
        assert (a.vision is None) == (b.vision is None)
        if a.vision is not None:
            assert torch.equal(a.vision.pixel_values, b.vision.pixel_values)
            assert torch.equal(a.vision.mrope_position_ids, b.vision.mrope_position_ids)


@needs_vision
def test_parquet_hf_image_column(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    rows = []
    for i in range(6):
        k = i % 3
        rows.append({"input_ids": sample_ids(rng, k, 10),
                     "images": [{"bytes": image_bytes(40 + 9 * j, 50, "PNG", seed=i + j), "path": f"{i}_{j}.png"}
                                for j in range(k)]})
    path = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    batches = list(dataset([str(path)], shuffle=False))
    assert sum(check_vision(b) for b in batches) == sum(i % 3 for i in range(6))


def test_jsonl_paths_under_image_root(tmp_path: Path) -> None:
    root = tmp_path / "images"
    (root / "sub").mkdir(parents=True)
    rng = np.random.default_rng(1)
    lines = []
    for i in range(5):
        (root / "sub" / f"{i}.jpg").write_bytes(image_bytes(60, 30 + i, "JPEG", seed=i))
        lines.append(json.dumps({"input_ids": sample_ids(rng, 1, 8), "images": [f"sub/{i}.jpg"]}))
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    media = MediaOptions(rule=FixedTokens(size=56, tokens=4), image_token_id=IMAGE_ID, image_root=str(root))
    batches = list(dataset([str(tmp_path / "a.jsonl")], media=media))
    assert sum(check_vision(b, media.rule) for b in batches) == 5
    assert batches[0].vision.pixel_values.shape[1:] == (3, 56, 56)
    assert "pixel_values" in batches[0].hf_inputs() and batches[0].vision.mrope_position_ids is None
    lines[2] = json.dumps({"input_ids": sample_ids(rng, 1, 8), "images": ["../../etc/passwd"]})
    (tmp_path / "b.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match="stay under image_root") as e:
        list(dataset([str(tmp_path / "b.jsonl")], media=media))
    assert e.value.key == "2"


@pytest.mark.parametrize("bad,reason", [(png_header_only(20_000, 20_000), "image_too_large"),
                                        (image_bytes(300, 200, "PNG", seed=9)[:400], "bad_image"),
                                        (png_header_only(8, 8, bit_depth=16, color_type=0), "unsupported_image_mode"),
                                        (b"not an image at all", "bad_image")])
def test_hostile_images_follow_on_error(tmp_path: Path, bad: bytes, reason: str) -> None:
    url = str(write_tar(tmp_path / "a.tar", 12, max_images=1, bad={5: bad}))
    with pytest.raises(DataError, match=reason) as e:
        list(dataset([url], media=FIXED))
    assert (e.value.url, e.value.key) == (url, "k5")
    ds = dataset([url], media=FIXED, read=ReadOptions(on_error="skip"))
    batches = list(ds)
    assert sorted(k for b in batches for k in b.doc_keys) == sorted(f"{url}#k{i}" for i in range(12) if i != 5)
    assert ds.metrics()["errors"]["counts"] == {reason: 1}


def test_per_sample_pixel_limit(tmp_path: Path) -> None:
    from streampack.io.limits import Limits

    url = str(write_tar(tmp_path / "a.tar", 8, max_images=3, sizes=(60, 61)))
    ds = dataset([url], media=FIXED, read=ReadOptions(on_error="skip", limits=Limits(max_sample_pixels=2 * 61 * 61)))
    kept = list(ds)
    assert ds.metrics()["errors"]["counts"]["sample_too_large"] >= 1
    assert all(b.vision is None or int(torch.bincount(b.vision.image_doc).max()) <= 2 for b in kept)


def test_any_res_tiles_stream_with_their_sizes(tmp_path: Path) -> None:
    from streampack.media import AnyResTiles

    rule = AnyResTiles(grid_pinpoints=((8, 16), (16, 8), (16, 16)), tile_size=8, patch_size=2)
    url = str(write_tar(tmp_path / "a.tar", 10, max_images=2, sizes=(5, 30)))
    batches = list(dataset([url], media=MediaOptions(rule=rule, image_token_id=IMAGE_ID), capacity=256))
    images = 0
    for b in batches:
        check_vision(b, rule)
        if b.vision is None:
            continue
        v, images = b.vision, images + b.vision.num_images
        tiles = v.image_grid_thw[:, 0]
        assert v.pixel_values.shape == (int(tiles.sum()), 3, 8, 8) and v.mrope_position_ids is None
        for (h, w), n, t in zip(v.image_sizes.tolist(), v.image_token_lengths.tolist(), tiles.tolist()):
            best = rule.best(w, h)
            assert n == rule.count(w, h) and t == 1 + best[0] * best[1] // 64
        hf = b.hf_inputs()
        assert hf.image_sizes is v.image_sizes and hf.pixel_values is v.pixel_values
    assert images > 5


@needs_vision
def test_planned_equal_batches_count_image_tokens(tmp_path: Path) -> None:
    """Several ranks, equal_batches="plan": each reader's count sees the image-expanded lengths
    (text-only counts would fall short of the batches the data makes: a surplus error)."""
    urls = [str(write_tar(tmp_path / f"{i}.tar", 12, seed=i, max_images=3)) for i in range(3)]
    make = lambda r: dataset(urls, topology=TopologyOptions(dp_rank=r, dp_size=2, equal_batches="count"),  # noqa: E731
                             packing=PackOptions(window=4), read=ReadOptions(cache_dir=str(tmp_path / "cache")))
    ranks = [make(r) for r in (0, 1)]
    got = [list(ds) for ds in ranks]
    assert len(got[0]) == len(got[1]) > 0
    keys = sorted(k for rank in got for b in rank for k in b.doc_keys if k != "<filler>")
    assert keys == sorted(f"{u}#k{i}" for u in urls for i in range(12))
    for ds, batches in zip(ranks, got):
        plan = ds.metrics()["plan"]
        assert plan["batches"] == sum(b.num_docs > 0 and b.doc_keys[0] != "<filler>" for b in batches)
    assert sum(check_vision(b) for rank in got for b in rank) > 20  # the counts included images


@needs_vision
@pytest.mark.parametrize("equal", ["sync", "count"])
def test_elastic_resume_trains_every_image_sample_once(tmp_path: Path, equal: str) -> None:
    from collections import Counter

    from streampack.plan import elastic
    from streampack.plan.state import table_size
    from tests.topology_sim import SimRank

    urls = [str(write_tar(tmp_path / f"{i}.tar", 14, seed=i, max_images=2)) for i in range(3)]
    make = lambda r, size: dataset(  # noqa: E731
        urls, topology=TopologyOptions(dp_rank=r, dp_size=size, equal_batches=equal), packing=PackOptions(window=6),
        read=ReadOptions(cache_dir=str(tmp_path / "cache")))
    old = [SimRank(lambda r=r: make(r, 2), 1) for r in range(2)]
    consumed = [next(rk) for rk in old for _ in range(2)]
    states = [s for rk in old for s in rk.states()]
    packers = [elastic.find_state(s["graph"], "WindowPacker") for s in states]
    carried = sum(table_size(elastic.WindowPacker.undelivered(p).carry) for p in packers if p is not None)
    assert carried > 0  # not vacuous
    for r in range(3):
        consumed += list(SimRank(lambda r=r: make(r, 3), 0, load=states))
    keys = Counter(k for b in consumed for k in b.doc_keys if k != "<filler>")
    assert keys == Counter(f"{u}#k{i}" for u in urls for i in range(14))
    assert sum(check_vision(b) for b in consumed) > 15
