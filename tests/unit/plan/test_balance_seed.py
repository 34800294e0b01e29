"""Cost balance from step 0 (issue 21, item 4): every reader of every rank starts its cost
histogram from the same seed, packed from the data set's own index lengths, before its first pack."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from helpers_data import serve_directory, write_jsonl_shards
from node_checks import write_token_shards

from streampack.dataset import PackedDataset
from streampack.graph.build import build_graph
from streampack.io.decode import DecodeOptions
from streampack.io.index import index_decode
from streampack.io.index_cache import INDEX_SUFFIX
from streampack.io.limits import Limits
from streampack.io.manifest import build_manifest
from streampack.options import CostOptions, PackOptions, ReadOptions, TopologyOptions
from streampack.packing import CostModel
from streampack.packing.schedule import Balance, CostScale
from streampack.packing.window_rounds import PackerRules
from streampack.plan import cost_seed
from streampack.plan.cost_seed import SEED_WEIGHT, sample_lengths, seed_counts
from streampack.plan.epoch_plan import chunk_lengths
from streampack.settings import Placement

SHAPE = {"hidden": 64, "layers": 2, "heads": 4, "ffn": 128}
MODEL = CostModel.from_shape(**SHAPE)
CAP = 256


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_token_shards(tmp_path_factory.mktemp("seed"), 600, 6, mean=60, seed=3)


@pytest.fixture(autouse=True)
def few_seed_packs(monkeypatch):
    """256 seed packs, not 4,096: the same code, a fast test (window 32 makes many small rounds)."""
    monkeypatch.setattr(cost_seed, "SEED_PACKS", 256)


def _first_counts(urls: list[str], place: Placement, *, balance: Any, **kw) -> np.ndarray:
    """The histogram reader ``place`` holds when its first batch is asked for, before any pack."""
    ds = PackedDataset(urls, capacity=CAP, packing=PackOptions(window=32),
                       cost=CostOptions(model=SHAPE, balance=balance), **kw)
    graph = build_graph(ds.config, ds.sources, place)
    graph.root.reset(None)
    packer = graph.nodes["packer"]
    assert packer.metrics["packs"] == 0 and packer.reservoir is not None
    return packer.reservoir.counts.copy()


def _manifest(urls: list[str], directory: Any) -> str:
    location = str(directory / "manifest")
    build_manifest(urls, location, decode=index_decode(DecodeOptions(limits=Limits())))
    return location


@pytest.mark.parametrize("stream", ["finite", "infinite, manifest", "infinite, no manifest"])
def test_every_reader_of_every_rank_starts_from_the_same_histogram(shards, stream, tmp_path) -> None:
    """Finding: each reader's histogram started empty, so the ranks' cost levels disagreed for the
    first ~2,000 packs (straggler 1.064 over steps 0-500 end to end at 128k, against 1.027 seeded).
    An infinite stream without ``manifest=`` seeds from the same shards' own indexes: the same seed."""
    urls, _ = shards
    kw: dict[str, Any] = {"finite": {"epochs": 2}, "infinite, no manifest": {"epochs": None},
                          "infinite, manifest": {"epochs": None, "read": ReadOptions(manifest=_manifest(urls, tmp_path))}
                          }[stream]
    found = [_first_counts(urls, Placement(dp_rank=r, dp_size=4, worker_id=w, num_workers=2),
                           balance="cost", **kw) for r, w in ((0, 0), (3, 1))]
    assert found[0].sum() > 0.9 * SEED_WEIGHT  # not empty: the seed, counted as SEED_WEIGHT packs
    for counts in found[1:]:
        np.testing.assert_array_equal(counts, found[0])
    # every kind of stream seeds from the same sample: the planner's manifest or the shards' own indexes
    np.testing.assert_array_equal(found[0], _first_counts(urls, Placement(dp_rank=1, dp_size=4), balance="cost",
                                                          epochs=1))
    # the seed follows the data: the same sample under another stream seed gives a different histogram
    other = _first_counts(urls, Placement(dp_rank=0, dp_size=4), balance="cost", seed=7, **kw)
    assert other.sum() > 0.9 * SEED_WEIGHT and not np.array_equal(other, found[0])


def test_unseeded_and_single_readers_start_cold(shards) -> None:
    urls, _ = shards
    assert _first_counts(urls, Placement(dp_rank=1, dp_size=4), balance=Balance(seeded=False)).sum() == 0
    assert _first_counts(urls, Placement(), balance="cost", epochs=1).sum() == 0  # no other rank to agree with
    with pytest.raises(TypeError, match="seeded"):
        Balance(seeded=1)  # type: ignore[arg-type]


def test_an_infinite_stream_without_manifest_reads_a_few_indexes_and_builds_no_manifest(shards, tmp_path,
                                                                                         monkeypatch) -> None:
    """Seeding must not cost an infinite stream one pass over the data set: without ``manifest=`` it reads
    the indexes of the few shards its sample needs (here 3 of 6: 300 lengths, 100 a shard), kept where the
    readers keep theirs, and builds no manifest."""
    urls, _ = shards
    monkeypatch.setattr(cost_seed, "SEED_SAMPLES", 300)
    cache = tmp_path / "cache"
    counts = _first_counts(urls, Placement(dp_rank=1, dp_size=4), balance="cost",
                           read=ReadOptions(cache_dir=str(cache)))
    assert counts.sum() > 0.9 * SEED_WEIGHT
    written = [p.name for p in cache.rglob("*") if p.is_file() and not p.name.endswith(".lock")]
    assert len(written) == 3 and all(INDEX_SUFFIX in name for name in written), written


def test_infinite_remote_stream_without_manifest_seeds_from_its_indexes(shards) -> None:
    """An infinite stream of remote shards need not have a manifest: it seeds from the sampled shards'
    indexes (headers read by ranged requests), the same seed as its local copy, and starts."""
    urls, _ = shards
    local = _first_counts(urls, Placement(dp_rank=1, dp_size=4), balance="cost")
    assert local.sum() > 0.9 * SEED_WEIGHT
    with serve_directory(os.path.dirname(urls[0])) as server:
        remote = server.urls_for(urls)
        np.testing.assert_array_equal(_first_counts(remote, Placement(dp_rank=1, dp_size=4), balance="cost"), local)
        ds = PackedDataset(remote, capacity=CAP, packing=PackOptions(window=32),
                           cost=CostOptions(model=SHAPE, balance="cost"),
                           topology=TopologyOptions(dp_rank=1, dp_size=4))
        assert next(iter(ds)).num_tokens > 0


def test_text_tokenized_on_the_fly_starts_cold_after_one_index(tmp_path, monkeypatch) -> None:
    """Text has no token lengths in its index: the first sampled shard says so, and no other is read."""
    urls = write_jsonl_shards(tmp_path / "text", ["word " * (i % 50 + 1) for i in range(600)], 6)
    read: list[int] = []
    lengths_of = cost_seed.index_lengths(urls, ReadOptions(cache_dir=str(tmp_path / "cache")))
    monkeypatch.setattr(cost_seed, "index_lengths", lambda *a, **k: lambda s: read.append(s) or lengths_of(s))
    counts = _first_counts(urls, Placement(dp_rank=1, dp_size=4), balance="cost", tokenizer=lambda t: list(t.encode()),
                           read=ReadOptions(cache_dir=str(tmp_path / "cache")))
    assert counts.sum() == 0 and len(read) == 1


def test_a_mixture_seeds_from_each_source_by_weight(shards, tmp_path) -> None:
    """A mixture draws each document's source by weight; its seed is each source's sample in that
    proportion, the same on every reader. Finding: mixtures started cold."""
    urls, _ = shards
    long_urls, _ = write_token_shards(tmp_path / "long", 300, 3, mean=200, seed=4)
    mixture = {"short": (urls, 3.0), "long": (long_urls, 1.0)}
    found = [_first_counts(mixture, Placement(dp_rank=r, dp_size=4), balance="cost") for r in (0, 3)]
    assert found[0].sum() > 0.9 * SEED_WEIGHT
    np.testing.assert_array_equal(found[0], found[1])
    # the weights shape the seed: more of the long source makes costlier packs
    heavier = _first_counts({"short": (urls, 1.0), "long": (long_urls, 3.0)}, Placement(dp_rank=0, dp_size=4),
                            balance="cost")
    mean_bin = lambda c: float(np.arange(c.size) @ c) / c.sum()  # noqa: E731
    assert mean_bin(heavier) > mean_bin(found[0])


def test_seed_is_the_packers_own_packs_of_the_sample() -> None:
    rng = np.random.default_rng(0)
    lengths = np.maximum(1, rng.lognormal(np.log(300), 1.2, 5000).astype(np.int64))
    rules = PackerRules(capacity=4096, window=256, seed=0)
    scale = CostScale.of(MODEL.linear, MODEL.attention, 4096)
    cut = lambda n: chunk_lengths(n, 4096, "split")  # noqa: E731
    a = seed_counts(lengths, rules, MODEL, scale, seed=1, cut=cut)
    assert a is not None and abs(int(a.sum()) - SEED_WEIGHT) <= 1024 // 2 + 1  # rounding per bin
    np.testing.assert_array_equal(a, seed_counts(lengths, rules, MODEL, scale, seed=1, cut=cut))
    # lengths over the capacity enter as the overlong policy's chunks (here all full packs)
    over = seed_counts(np.full(400, 3 * 4096), rules, MODEL, scale, seed=1, cut=cut)
    assert over is not None and over[-1] == over.sum()  # every pack one full-length document: cost 1
    assert seed_counts(lengths[:cost_seed.MIN_SAMPLES - 1], rules, MODEL, scale, seed=1) is None


def test_sample_reads_a_few_shards_chosen_by_the_seed_alone(monkeypatch) -> None:
    monkeypatch.setattr(cost_seed, "SEED_SAMPLES", 250)
    read: list[int] = []

    def lengths_of(shard: int) -> np.ndarray:
        read.append(shard)
        return np.array([-1, 0] + [shard + 1] * 100)  # unknown / refused entries are skipped

    got = sample_lengths(1000, lengths_of, seed=5)
    assert len(read) == 3 and got.size == 300 and (got > 0).all()
    first = list(read)
    read.clear()
    sample_lengths(1000, lengths_of, seed=5)
    assert read == first  # every reader reads the same shards
    read.clear()
    monkeypatch.setattr(cost_seed, "SEED_SAMPLES", 10**9)
    sample_lengths(1000, lengths_of, seed=5)
    assert len(read) == cost_seed.SEED_SHARDS  # bounded, whatever the data set's size


def test_a_state_resumes_whether_or_not_the_histogram_was_seeded(shards) -> None:
    """``seeded`` only decides how a fresh run starts: a resume restores the saved histogram, so a
    checkpoint of a run saved before seeding existed (or with it off) resumes bit-identically."""
    urls, _ = shards
    kw = {"capacity": CAP, "packing": PackOptions(window=32), "topology": TopologyOptions(dp_rank=1, dp_size=4)}
    cold = PackedDataset(urls, cost=CostOptions(model=SHAPE, balance=Balance(reservoir=8, seeded=False)), **kw)
    stream = iter(cold)
    for _ in range(3):
        next(stream)
    state = cold.state_dict()
    expected = [next(stream).doc_keys for _ in range(3)]
    seeded = PackedDataset(urls, cost=CostOptions(model=SHAPE, balance=Balance(reservoir=8)), **kw)
    seeded.load_state_dict(state)
    assert [b.doc_keys for _, b in zip(range(3), seeded)] == expected
