"""The seams of a media stream where a batch could be wrong without an error: a batch with no
image must keep the model's position layout (filler batches, worker hand-over and resume
included), and the overlong policy must never cut through an image's tokens nor leave an image
on a chunk that does not hold them."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from streampack import OverlongCounters, PackedDataset, Sample, apply_overlong
from streampack.media import DynamicResolution, FixedTokens, MediaImage, MediaOptions, read_header
from streampack.media.node import decode_sample
from streampack.media.stage import ExpandImages, image_starts, media_counts
from streampack.options import PackOptions, ReadOptions, TopologyOptions
from tests.helpers_media import IMAGE_ID, image_bytes, write_tar

RULE = DynamicResolution(patch_size=14, merge_size=2, min_pixels=28 * 28, max_pixels=28 * 28 * 9)
MEDIA = MediaOptions(rule=RULE, image_token_id=IMAGE_ID)
PATCH_ROW = 3 * 2 * 14 * 14


def dataset(urls: list[str], media: MediaOptions = MEDIA, **kw) -> PackedDataset:
    args = {"capacity": 96, "packing": PackOptions(window=8), "epochs": 1, "seed": 3, **kw}
    return PackedDataset(urls, media=media, **args)


def check_layout(batch) -> bool:
    """Qwen2-VL's ``[4, 1, T]`` positions on ``batch``; returns whether it has an image."""
    hf = batch.hf_inputs()
    T = batch.total_tokens
    assert batch.vision is not None and hf.position_ids.shape == (4, 1, T), hf.position_ids.shape
    text = hf.position_ids[0]
    if batch.vision.num_images == 0:
        # text only: the mRoPE rows are the text positions, restarted with them at every span
        assert torch.equal(hf.position_ids[1:], text.expand(3, 1, T))
        assert hf.pixel_values is None and hf.image_grid_thw is None
        assert batch.vision.pixel_values.shape == (0, PATCH_ROW) and batch.vision.vision_cu_seqlens.tolist() == [0]
        return False
    return True


def test_every_batch_of_a_media_stream_has_the_models_position_layout(tmp_path: Path) -> None:
    """No image in a batch, and filler batches, still give ``position_ids [4, 1, T]``: with
    ``[1, T]`` Qwen2-VL builds no per-document mask (``tests/unit/media/test_media_vlm.py`` measures it)."""
    text_only = str(write_tar(tmp_path / "t.tar", 8, max_images=0, seed=1))
    mixed = str(write_tar(tmp_path / "m.tar", 8, max_images=2, seed=2))
    batches = list(dataset([text_only, mixed], shuffle=False, packs_per_batch=2,
                           topology=TopologyOptions(batches_per_epoch=8)))
    with_images = [check_layout(b) for b in batches]
    fillers = [b for b in batches if set(b.doc_keys) == {"<filler>"}]
    assert any(with_images) and not all(with_images) and fillers  # every kind of batch was seen
    assert not any(with_images[-len(fillers):])


def test_a_fixed_size_stream_gives_no_empty_pixels(tmp_path: Path) -> None:
    """LLaVA-style: a batch without images has an empty ``vision`` of the stream's pixel shape
    and hands the model no ``pixel_values`` (its vision tower skips None, not an empty batch)."""
    url = str(write_tar(tmp_path / "t.tar", 6, max_images=0))
    media = MediaOptions(rule=FixedTokens(size=28, tokens=4), image_token_id=IMAGE_ID)
    (batch, *_) = list(dataset([url], media=media))
    assert batch.vision.pixel_values.shape == (0, 3, 28, 28) and batch.vision.mrope_position_ids is None
    hf = batch.hf_inputs()
    assert hf.pixel_values is None and hf.position_ids.shape == (1, batch.total_tokens)


def test_the_layout_survives_the_worker_hand_over_and_a_resume(tmp_path: Path) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    url = str(write_tar(tmp_path / "t.tar", 24, max_images=0))
    whole = list(dataset([url], packing=PackOptions(window=4)))
    loader = StatefulDataLoader(dataset([url], packing=PackOptions(window=4)), batch_size=None, num_workers=1)
    it = iter(loader)
    head = [next(it) for _ in range(2)]
    buf = io.BytesIO()
    torch.save(loader.state_dict(), buf)
    del it
    resumed = StatefulDataLoader(dataset([url], packing=PackOptions(window=4)), batch_size=None, num_workers=1)
    resumed.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    rest = list(resumed)
    assert len(head) + len(rest) == len(whole) >= 4
    for got, want in zip(head + rest, whole):
        assert not check_layout(got)
        assert torch.equal(got.hf_inputs().position_ids, want.hf_inputs().position_ids)


def test_a_document_with_stray_image_tokens_is_a_data_error() -> None:
    from streampack.errors import DataError

    sample = Sample(key="k", url="u.tar", tokens=np.array([1, 2, IMAGE_ID, 3]))
    with pytest.raises(DataError, match=r"image_tokens_mismatch.*1 image tokens \(id 90\) in a document without"):
        decode_sample(sample, MEDIA)


# ---- the overlong policy and images ------------------------------------------------------------

def image(side: int, seed: int = 0) -> MediaImage:
    data = image_bytes(side, side, seed=seed)
    return MediaImage(name=f"{seed}.png", data=data,
                      header=read_header(data, url="u.tar", key="k", name=f"{seed}.png", max_pixels=1 << 20))


def media_sample(parts: list[int | MediaImage], key: str = "k") -> Sample:
    """Text runs (an int: that many text tokens) and images, expanded like the stream does."""
    tokens, images, rng = [], [], np.random.default_rng(0)
    for part in parts:
        if isinstance(part, MediaImage):
            tokens.append(IMAGE_ID)
            images.append(part)
        else:
            tokens.extend(rng.integers(1, 89, part).tolist())
    out = ExpandImages(MEDIA)(Sample(key=key, url="u.tar", tokens=np.array(tokens), images=tuple(images)))
    assert out is not None
    return out


def check_chunks(sample: Sample, chunks: list[Sample], max_len: int) -> None:
    """Tokens conserved; each chunk holds exactly its images, each on its own run, and decodes."""
    assert np.array_equal(np.concatenate([c.tokens for c in chunks]), sample.tokens)
    assert [im.name for c in chunks for im in c.images] == [im.name for im in sample.images]
    for c in chunks:
        assert len(c) <= max_len
        counts = media_counts(c, MEDIA)[0]
        assert image_starts(c.tokens, IMAGE_ID, counts) is not None, c.key


def test_a_split_keeps_each_image_on_the_chunk_that_holds_it() -> None:
    """An image wholly in the first chunk: the text-only chunk after it carries no image (the
    decode after packing raised ``image_tokens_mismatch`` on it before)."""
    sample = media_sample([3, image(56), 20])  # 3 + 4 image tokens + 20 = 27
    chunks = apply_overlong(sample, 16, "split", media=MEDIA)
    assert [len(c) for c in chunks] == [16, 11] and [len(c.images) for c in chunks] == [1, 0]
    check_chunks(sample, chunks, 16)
    for c in chunks:
        decoded = decode_sample(c, MEDIA)
        assert [im.offset for im in decoded.images] == ([3] if c.images else [])


def test_a_cut_through_an_image_moves_to_its_start() -> None:
    sample = media_sample([10, image(56, 1), image(56, 2), 4, image(84, 3), 2])  # images of 4, 4, 9 tokens
    c = OverlongCounters()
    chunks = apply_overlong(sample, 12, "split", c, media=MEDIA)
    # 12 would cut the first image (tokens 10..13): the cut moves to 10; then 10 + 12 = 22 cuts the
    # third image (22..30): to 22
    assert [len(x) for x in chunks] == [10, 12, 11] and [len(x.images) for x in chunks] == [0, 2, 1]
    assert [x.key for x in chunks] == ["k/0", "k/1", "k/2"]
    check_chunks(sample, chunks, 12)
    assert (c.samples_split, c.chunks_created, c.tokens_split, c.media_overlong) == (1, 3, len(sample), 0)
    (head,) = apply_overlong(sample, 12, "truncate", media=MEDIA)
    assert len(head) == 10 and head.images == ()


def test_random_samples_split_and_truncate_around_their_images() -> None:
    rng = np.random.default_rng(7)
    images = [image(side, seed) for seed, side in enumerate((28, 56, 84))]  # 1, 4 and 9 tokens
    seen = 0
    for trial in range(60):
        parts: list[int | MediaImage] = []
        for _ in range(int(rng.integers(1, 6))):
            parts += [int(rng.integers(0, 12))] if rng.random() < 0.5 else [images[int(rng.integers(0, 3))]]
        sample = media_sample(parts, key=f"s{trial}")
        max_len = int(rng.integers(9, 16))
        chunks = apply_overlong(sample, max_len, "split", media=MEDIA)
        check_chunks(sample, chunks, max_len)
        (head,) = apply_overlong(sample, max_len, "truncate", media=MEDIA)
        check_chunks(head, [head], max_len)
        assert np.array_equal(head.tokens, sample.tokens[:len(head)])
        seen += len(chunks) > 1 and len(sample.images) > 0
    assert seen > 20  # the checks ran on split samples with images, not vacuously


def test_an_image_alone_over_the_capacity_is_dropped_and_counted() -> None:
    sample = media_sample([2, image(84), 3])  # the image alone is 9 tokens
    c = OverlongCounters()
    assert apply_overlong(sample, 8, "split", c, media=MEDIA) == []
    assert (c.samples_dropped, c.tokens_dropped, c.media_overlong, c.samples_split) == (1, 14, 1, 0)
    c = OverlongCounters()
    assert apply_overlong(media_sample([image(84), 3]), 8, "truncate", c, media=MEDIA) == []
    assert (c.samples_dropped, c.tokens_dropped, c.media_overlong, c.samples_truncated) == (1, 12, 1, 0)
    with pytest.raises(ValueError, match="overlong='error'"):
        apply_overlong(sample, 8, "error", media=MEDIA)
    # truncating before a too-long image keeps the head, without it
    (head,) = apply_overlong(sample, 8, "truncate", c, media=MEDIA)
    assert len(head) == 2 and head.images == () and c.tokens_truncated == 12


def test_overlong_samples_with_images_stream_whole(tmp_path: Path) -> None:
    """``overlong="split"`` (the default) on samples longer than the capacity with images: no
    error, no sample lost (``on_error="skip"`` would drop them silently), every image once on its
    own run of its own chunk."""
    url = str(write_tar(tmp_path / "a.tar", 6, max_images=3, sizes=(80, 84), text=(30, 40)))
    ds = dataset([url], capacity=32, read=ReadOptions(on_error="skip"))
    batches = list(ds)
    metrics = ds.metrics()
    assert metrics["errors"]["counts"] == {} and metrics["overlong"]["samples_split"] > 0
    images = 0
    for b in batches:
        v = b.vision
        cu = b.cu_seqlens_padded.tolist()
        for d, s, n in zip(v.image_doc.tolist(), v.image_token_starts.tolist(), v.image_token_lengths.tolist()):
            assert bool((b.input_ids[s:s + n] == IMAGE_ID).all()) and cu[d] <= s and s + n <= cu[d + 1]
        assert int((b.input_ids == IMAGE_ID).sum()) == int(v.image_token_lengths.sum())
        images += v.num_images
    with tarfile.open(url) as tf:
        stored = sum(not m.name.endswith(".json") for m in tf.getmembers())
    assert images == stored > 5 and metrics["overlong"]["media_overlong"] == 0


def test_a_resume_inside_a_split_sample_with_images_is_exact(tmp_path: Path) -> None:
    """The state holds the split sample by reference; the replay cuts it again around its images."""
    url = str(write_tar(tmp_path / "a.tar", 8, max_images=3, sizes=(28, 56), text=(30, 50)))
    whole = list(dataset([url], capacity=24, packing=PackOptions(window=2)))
    for stop in range(1, len(whole) - 1, 3):
        ds = dataset([url], capacity=24, packing=PackOptions(window=2))
        it = iter(ds)
        head = [next(it) for _ in range(stop)]
        resumed = dataset([url], capacity=24, packing=PackOptions(window=2))
        resumed.load_state_dict(ds.state_dict())
        rest = list(resumed)
        assert [b.doc_keys for b in head + rest] == [b.doc_keys for b in whole]
        for a, b in zip(head + rest, whole):
            assert torch.equal(a.vision.pixel_values, b.vision.pixel_values)
            assert torch.equal(a.hf_inputs().position_ids, b.hf_inputs().position_ids)
    assert any("/" in k.rsplit("#", 1)[1] for b in whole for k in b.doc_keys)  # a split sample was resumed through


def test_planned_counts_cut_around_images_like_the_stream(tmp_path: Path) -> None:
    """``equal_batches="plan"`` over two ranks: the count cuts over-long image samples where the
    stream does (a ceil(L / capacity) count fell one batch short: a surplus error at epoch end)."""
    urls = [str(write_tar(tmp_path / f"{i}.tar", 12, seed=i, max_images=3, sizes=(80, 84), text=(30, 40)))
            for i in range(3)]
    ranks = [dataset(urls, topology=TopologyOptions(dp_rank=r, dp_size=2, equal_batches="count"),
                     packing=PackOptions(window=4), capacity=24, read=ReadOptions(cache_dir=str(tmp_path / "c")))
             for r in (0, 1)]
    got = [list(ds) for ds in ranks]
    assert len(got[0]) == len(got[1]) > 0
    for ds, batches in zip(ranks, got):
        assert ds.metrics()["plan"]["batches"] == sum(b.doc_keys[0] != "<filler>" for b in batches)
        assert ds.metrics()["overlong"]["samples_split"] > 0


def test_an_elastic_resume_inside_a_split_image_sample_trains_every_chunk_once(tmp_path: Path) -> None:
    """Two ranks save while a split sample's chunks are pending (by reference, their lengths in
    the state: cut around images they are not ceil(L / capacity) of the capacity); three resume."""
    from collections import Counter

    from streampack.plan import elastic
    from streampack.plan.cursor import Split
    from streampack.plan.epoch_plan import chunk_lengths
    from tests.topology_sim import SimRank

    urls = [str(write_tar(tmp_path / f"{i}.tar", 10, seed=i, max_images=3, sizes=(80, 84), text=(30, 40)))
            for i in range(3)]
    make = lambda r, size: dataset(urls, topology=TopologyOptions(dp_rank=r, dp_size=size, equal_batches="sync"),  # noqa: E731
                                   packing=PackOptions(window=2),
                                   capacity=16, read=ReadOptions(cache_dir=str(tmp_path / "c")))
    whole = Counter(k for r in range(2) for b in make(r, 2) for k in b.doc_keys if k != "<filler>")
    old = [SimRank(lambda r=r: make(r, 2), 1) for r in range(2)]
    consumed = [next(rk) for rk in old for _ in range(2)]
    states = [s for rk in old for s in rk.states()]
    splits = [Split.from_state(elastic.find_state(s["graph"], "OverlongNode")["pending"]) for s in states]
    # not vacuous: a split sample was pending by reference, cut around its images otherwise than ceil(L / 16)
    assert any(p is not None and list(p.lengths) != chunk_lengths([p.tokens], 16, "split").tolist() for p in splits)
    for r in range(3):
        consumed += list(SimRank(lambda r=r: make(r, 3), 0, load=states))
    assert Counter(k for b in consumed for k in b.doc_keys if k != "<filler>") == whole
    for b in consumed:
        v = b.vision
        assert int((b.input_ids == IMAGE_ID).sum()) == int(v.image_token_lengths.sum())


def _drop_an_image_token(sample: Sample) -> Sample:
    """A user stage after the expansion that breaks a long sample's first image run."""
    if len(sample) <= 32 or not sample.images:
        return sample
    tokens = sample.tokens.copy()
    tokens[int(np.flatnonzero(tokens == IMAGE_ID)[0])] = 1
    return sample.evolve(tokens=tokens)


def test_image_tokens_a_stage_broke_follow_on_error_at_the_split(tmp_path: Path) -> None:
    from streampack.errors import DataError

    url = str(write_tar(tmp_path / "a.tar", 6, max_images=3, sizes=(80, 84), text=(30, 40)))
    with pytest.raises(DataError, match=r"image_tokens_mismatch.*a stage after the expansion") as e:
        list(dataset([url], capacity=32, stages=[_drop_an_image_token]))
    assert e.value.key.startswith("k") and e.value.url == url
    ds = dataset([url], capacity=32, stages=[_drop_an_image_token], read=ReadOptions(on_error="skip"))
    kept = {k.rsplit("#", 1)[1].split("/")[0] for b in ds for k in b.doc_keys}
    broken = ds.metrics()["errors"]["counts"]["image_tokens_mismatch"]
    assert broken > 0 and len(kept) == 6 - broken  # counted, and every other sample streamed


def test_a_document_whose_images_are_not_the_streams_layout_is_refused() -> None:
    from streampack import pack_batch
    from streampack.media.node import DecodedImage, vision_layout

    layout = vision_layout(MEDIA)
    assert layout.pixel_shape == (PATCH_ROW,) and layout.merge_size == 2 and layout.image_token_id == IMAGE_ID
    im = DecodedImage(pixels=np.zeros((4, 3, 28, 28), np.float32), grid_thw=(1, 28, 28), offset=1, length=4,
                      token_id=IMAGE_ID, merge_size=1, layout="image")
    doc = Sample(key="k", url="u.tar", tokens=np.array([1, *[IMAGE_ID] * 4, 2]), images=(im,))
    with pytest.raises(ValueError, match=r"'u.tar#k' has an image laid out as 'image'.*not as the stream's"):
        pack_batch([[doc]], capacity=8, vision_layout=layout)
