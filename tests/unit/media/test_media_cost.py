"""The vision encoder's cost in a media stream: ``CostOptions(model=CostModel(..., vision=VisionCost(...)))`` prices
every pack's images and videos from their patch grids, in the balanced emission and in each batch's ``est_cost``; a
vision cost on a stream without media is refused; the balance seed stays cold under it."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from node_checks import write_token_shards

from streampack import PackedDataset
from streampack.graph.build import build_graph
from streampack.media import DynamicResolution, MediaOptions
from streampack.media.tokens import VideoFrames
from streampack.options import CostOptions, PackOptions, TopologyOptions
from streampack.packing import CostModel
from streampack.packing.cost import VisionCost, frame_patches
from streampack.packing.schedule import Balance
from streampack.settings import Placement
from tests.helpers_media import IMAGE_ID, VIDEO_ID, add_member, image_bytes, write_tar, write_video_tar

RULE = DynamicResolution(patch_size=14, merge_size=2, min_pixels=28 * 28, max_pixels=28 * 28 * 16)
MEDIA = MediaOptions(rule=RULE, image_token_id=IMAGE_ID)
TEXT = CostModel.from_shape(hidden=64, layers=2, heads=4, ffn=128)
VISION = CostModel(linear=TEXT.linear, attention=TEXT.attention,
                   vision=VisionCost(linear=2 * TEXT.linear, attention=TEXT.linear / 8))
"""An encoder that makes an image's 64 patches cost about as much as 150 text tokens."""
LENGTH = 24
"""Every document's tokens after expansion: an image-heavy one is 9 text ids and a 112x112 image (16 tokens)."""


def write_equal_length_tar(path: Path, n: int, *, seed: int) -> str:
    """``n`` documents of ``LENGTH`` tokens each: 30% hold one 112x112 image (4x4 tokens, one frame of 8x8 patches),
    the rest only text, so the text cost cannot tell them apart and the vision cost can."""
    rng = np.random.default_rng(seed)
    image = image_bytes(112, 112, "PNG", seed=seed)
    with tarfile.open(path, "w") as tf:
        for i in range(n):
            heavy = bool(rng.random() < 0.3)
            ids = rng.integers(1, 89, size=LENGTH - 15 if heavy else LENGTH).tolist()
            if heavy:
                ids[1] = IMAGE_ID
            add_member(tf, f"k{i}.json", json.dumps({"input_ids": ids}).encode())
            if heavy:
                add_member(tf, f"k{i}.0.png", image)
    return str(path)


@pytest.fixture(scope="module")
def equal_length(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("vcost")
    return [write_equal_length_tar(root / f"s{j}.tar", 70, seed=j) for j in range(4)]


def true_cost(batch) -> float:
    """What the step costs: its documents' text cost and its images' encoder cost, from the batch's own grids."""
    v = batch.vision
    segments = [frame_patches(g.numpy()) for g in (v.image_grid_thw, v.video_grid_thw) if g is not None]
    real = [n for n, key in zip(batch.doc_lengths.tolist(), batch.doc_keys) if key != "<filler>"]
    return VISION.pack_cost(np.asarray(real, dtype=np.int64), segments=np.concatenate(segments))


def ranks(urls: list[str], model: CostModel, dp_size: int = 4) -> list[list]:
    return [list(PackedDataset(urls, capacity=2 * LENGTH, epochs=1, seed=5, media=MEDIA, packing=PackOptions(window=16),
                               cost=CostOptions(model=model, balance=Balance(reservoir=16)),
                               topology=TopologyOptions(dp_rank=r, dp_size=dp_size, equal_batches="count")))
            for r in range(dp_size)]


def test_balance_prices_the_vision_encoder(equal_length: list[str]) -> None:
    """Finding: the packer priced packs by text length alone, so a VLM job that configured its vision encoder's
    cost was balanced as if every document of equal length cost the same. Here every pack has the same text
    cost; with the encoder priced, the slowest rank's step is closer to the mean (straggler 2.08 -> 1.28)."""
    text_only, priced = ranks(equal_length, TEXT), ranks(equal_length, VISION)
    stragglers = []
    for run in (text_only, priced):
        steps = {len(r) for r in run}
        assert len(steps) == 1, steps
        cost = np.array([[true_cost(r[s]) for r in run] for s in range(steps.pop())])
        assert len(cost) > 25 and cost.std() > 0.2 * cost.mean()  # not vacuous: the steps differ in images
        stragglers.append(float((cost.max(1) / cost.mean(1)).mean()))
    assert stragglers[1] < 0.85 * stragglers[0], stragglers
    for batch in (b for r in priced for b in r):  # the estimate is the formula over the batch's own images
        assert batch.est_cost == true_cost(batch)
    # the same packs leave, in another order: balance never changes what is trained
    keys = [sorted(k for r in run for b in r for k in b.doc_keys if k != "<filler>") for run in (text_only, priced)]
    assert keys[0] == keys[1]


def test_est_cost_prices_images_and_videos_by_frame(tmp_path: Path) -> None:
    """Unbalanced: each batch's ``est_cost`` and the readers' total include the encoder's cost of every image and
    of every video's temporal patches (one attention segment each), from their headers' grids."""
    rule = DynamicResolution(patch_size=2, merge_size=2, min_pixels=8 * 8, max_pixels=24 * 24)
    video = VideoFrames(frame=DynamicResolution(patch_size=2, merge_size=2, min_pixels=8 * 8, max_pixels=16 * 16),
                        max_frames=8)
    media = MediaOptions(rule=rule, image_token_id=IMAGE_ID, video=video, video_token_id=VIDEO_ID)
    url = str(write_video_tar(tmp_path / "v.tar", 40, seed=2))
    ds = PackedDataset([url], capacity=128, epochs=1, seed=3, media=media, packing=PackOptions(window=8),
                       cost=CostOptions(model=VISION))
    batches = list(ds)
    videos = sum(b.vision.num_videos for b in batches)
    frames = sum(int(b.vision.video_grid_thw[:, 0].sum()) for b in batches if b.vision.num_videos)
    assert videos > 5 and frames > videos and sum(b.vision.num_images for b in batches) > 5  # not vacuous
    for b in batches:
        assert b.est_cost == true_cost(b) > TEXT.pack_cost(b.doc_lengths.numpy())
    assert ds.metrics()["batches"]["cost"] == pytest.approx(sum(b.est_cost for b in batches))


def test_vision_cost_without_media_is_refused(tmp_path: Path) -> None:
    """A vision cost on a text stream would price nothing and say nothing: refused when the dataset is made."""
    urls, _ = write_token_shards(tmp_path, 40, 2, mean=30, seed=1)
    for balance in (None, "cost"):
        with pytest.raises(ValueError, match="prices the images of a media stream"):
            PackedDataset(urls, capacity=128, cost=CostOptions(model=VISION, balance=balance))


def test_the_balance_seed_stays_cold_under_a_vision_cost(equal_length: list[str]) -> None:
    """The seed packs index lengths (text): under a vision cost its levels would sit below every real pack."""
    def first_counts(model: CostModel) -> torch.Tensor:
        ds = PackedDataset(equal_length, capacity=2 * LENGTH, epochs=1, media=MEDIA, packing=PackOptions(window=16),
                           cost=CostOptions(model=model, balance="cost"))
        graph = build_graph(ds.config, ds.sources, Placement(dp_rank=1, dp_size=4))
        graph.root.reset(None)
        return graph.nodes["packer"].reservoir.counts.sum()

    assert first_counts(TEXT) > 0  # the same stream seeds under a text cost
    assert first_counts(VISION) == 0


@pytest.mark.slow  # ~3 s; a balanced stream's resume and a media stream's resume each stay in the fast loop
def test_a_balanced_vision_stream_resumes_exactly(tmp_path: Path) -> None:
    """A restore prices its reservoir's packs and the packs its carried documents join from their re-read headers:
    the same picks, so the same batches and estimates as never having stopped."""
    urls = [str(write_tar(tmp_path / f"{j}.tar", 40, seed=j, max_images=2)) for j in range(2)]

    def make(balance: Balance | None = Balance(reservoir=3)) -> PackedDataset:
        return PackedDataset(urls, capacity=96, epochs=1, seed=5, media=MEDIA, packing=PackOptions(window=8),
                             cost=CostOptions(model=VISION, balance=balance),
                             topology=TopologyOptions(dp_rank=1, dp_size=2, equal_batches="count"))

    def seen(batches) -> list:
        return [(b.doc_keys, b.est_cost) for b in batches]

    whole = seen(make())
    for stop in (2, 5, 9):
        ds = make()
        it = iter(ds)
        head = [next(it) for _ in range(stop)]
        resumed = make()
        resumed.load_state_dict(torch.load(_saved(ds.state_dict()), weights_only=True))
        assert seen(head) + seen(resumed) == whole
    assert sorted(seen(make(None))) != whole and sorted(seen(make(None))) == sorted(whole)  # balance reordered


def _saved(state) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf
