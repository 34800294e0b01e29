"""A streaming ``datasets.IterableDataset`` as a source: each of its shards read as ``ds.shard(n, i)`` yields it (with
its ``map`` and buffer ``shuffle`` steps), an exact resume with a window of carried documents (finite and forever),
infinite ranks taking whole shards, and a finite multi-rank plan refused naming what to do instead."""

from __future__ import annotations

import numpy as np
import pytest
from node_checks import canon, documents_by_key, read_as, roundtrip, take

from streampack.dataset import PackedDataset
from streampack.errors import DataError
from streampack.io.decode import DecodeOptions
from streampack.io.formats import ShardRange, open_range
from streampack.io.storage import OpenOptions
from streampack.io.urls import ShardList
from streampack.options import PackOptions, ReadOptions, TopologyOptions
from streampack.plan import elastic
from streampack.plan.state import table_size

datasets = pytest.importorskip("datasets")
CAP = 128
SHARDS = 4


@pytest.fixture(scope="module")
def ids() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 50_000, int(n)).tolist() for n in np.clip(rng.lognormal(3.5, 0.9, 160), 1, 2 * CAP)]


def plus_one(row: dict) -> dict:
    return {"input_ids": [t + 1 for t in row["input_ids"]]}


def stream(ids, kind: str = "plain"):
    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_dict({"input_ids": ids}).to_iterable_dataset(num_shards=SHARDS)
    return ds if kind == "plain" else ds.map(plus_one).shuffle(seed=4, buffer_size=16)


def expected_of(ds) -> dict[str, list[int]]:
    """Every row by the key ``PackedDataset`` gives it: row ``k`` of what ``ds.shard(n, i)`` yields."""
    urls = ShardList.of(ds).urls
    return {f"{u}#{k}": row["input_ids"] for i, u in enumerate(urls)
            for k, row in enumerate(ds.shard(num_shards=len(urls), index=i, contiguous=True))}


def packed(ds, tmp_path, **kw) -> PackedDataset:
    return PackedDataset(ds, capacity=CAP, seed=1, packs_per_batch=2, packing=PackOptions(window=16, max_wait=3),
                         read=ReadOptions(cache_dir=str(tmp_path)), **kw)


@pytest.mark.parametrize("kind", ["plain", "mapped_shuffled"])
@pytest.mark.parametrize("blocks", [True, False])
def test_every_row_once_as_the_stream_yields_it(kind, blocks, ids, tmp_path, monkeypatch):
    read_as(monkeypatch, blocks)
    ds = stream(ids, kind)
    expected = expected_of(ds)
    assert len(expected) == len(ids) and len(ShardList.of(ds).urls) == SHARDS
    assert documents_by_key(packed(ds, tmp_path, epochs=1)) == expected


@pytest.mark.parametrize("kind", ["plain", pytest.param("mapped_shuffled", marks=pytest.mark.slow)])  # ~5 s
def test_exact_resume_with_carried_documents(kind, ids, tmp_path):
    """Stopped after k batches (the window holding documents read but not packed) and resumed from the saved state in
    a new dataset: the same batches as never stopping, finite and forever."""
    ds = stream(ids, kind)
    whole = [canon(b) for b in packed(ds, tmp_path, epochs=1)]
    assert len(whole) > 8
    for stop in (1, len(whole) // 2, len(whole) - 1):
        first = packed(ds, tmp_path, epochs=1)
        head = [canon(b) for b in take(iter(first), stop)]
        state = roundtrip(first.state_dict())
        packer = elastic.find_state(state["graph"], "WindowPacker")
        assert table_size(elastic.WindowPacker.undelivered(packer).carry) > 0, "nothing carried: the test is vacuous"
        again = packed(ds, tmp_path, epochs=1)
        again.load_state_dict(state)
        assert head + [canon(b) for b in again] == whole, f"resume after {stop} batches diverged"
    forever = [canon(b) for b in take(iter(packed(ds, tmp_path)), 2 * len(whole))]
    first = packed(ds, tmp_path)
    head = [canon(b) for b in take(iter(first), len(whole) + 3)]
    again = packed(ds, tmp_path)
    again.load_state_dict(roundtrip(first.state_dict()))
    assert head + [canon(b) for b in take(iter(again), len(whole) - 3)] == forever


def test_infinite_ranks_take_whole_shards(ids, tmp_path):
    ds = stream(ids)
    seen = []
    for rank in range(2):
        batches = take(iter(packed(ds, tmp_path, topology=TopologyOptions(dp_rank=rank, dp_size=2))), 6)
        seen.append({key.split("#")[0] for key in documents_by_key(batches)})
    assert seen[0] and seen[1] and not seen[0] & seen[1]


@pytest.mark.parametrize("topology", [TopologyOptions(dp_rank=0, dp_size=3, equal_batches="count"),
                                      TopologyOptions(dp_rank=1, dp_size=3)])
def test_a_finite_multi_rank_plan_is_refused_naming_what_to_do(topology, ids, tmp_path):
    with pytest.raises(ValueError, match=r"no row counts.*save_to_disk.*hf://datasets"):
        next(iter(packed(stream(ids), tmp_path, epochs=1, topology=topology)))


def test_a_url_without_its_stream_is_named(ids):
    url = ShardList.of(stream(ids)).urls[0].replace("hf-stream://", "hf-stream://0000")
    with pytest.raises(DataError, match="no datasets.IterableDataset named") as e:
        list(open_range(url, ShardRange(start=0, first=0), decode=DecodeOptions(), opts=OpenOptions(), streams=[]))
    assert e.value.reason == "missing_shard" and e.value.url == url


def test_a_stateful_dataloader_worker_resumes_exactly(ids, tmp_path):
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = stream(ids, "mapped_shuffled")
    loader = lambda: StatefulDataLoader(packed(ds, tmp_path, epochs=1), batch_size=None,  # noqa: E731
                                        num_workers=1, multiprocessing_context="fork")
    whole = [canon(b) for b in loader()]
    first = loader()
    head = [canon(b) for b in take(iter(first), 4)]
    again = loader()
    again.load_state_dict(roundtrip(first.state_dict()))
    assert head + [canon(b) for b in again] == whole


@pytest.mark.parametrize("blocks", [True, False])
def test_a_bad_row_names_the_shard_and_row_never_the_content(blocks, tmp_path, monkeypatch):
    read_as(monkeypatch, blocks)
    rows = [[1, 2], [3, 99_999], [4], [5, 6]]
    ds = datasets.Dataset.from_dict({"input_ids": rows, "note": ["TOPSECRET"] * 4}).to_iterable_dataset(num_shards=2)
    with pytest.raises(DataError) as e:
        list(PackedDataset(ds, capacity=32, epochs=1, read=ReadOptions(vocab_size=1000, cache_dir=str(tmp_path))))
    assert e.value.reason == "out_of_vocab_id" and e.value.url == ShardList.of(ds).urls[0] and e.value.key == "1"
    assert "TOPSECRET" not in str(e.value)
    skip = PackedDataset(ds, capacity=32, epochs=1, read=ReadOptions(vocab_size=1000, on_error="skip",
                                                                     cache_dir=str(tmp_path)))
    assert sorted(documents_by_key(skip).values()) == [[1, 2], [4], [5, 6]]
    assert skip.metrics()["errors"]["counts"] == {"out_of_vocab_id": 1}


def test_streams_of_other_datasets_have_other_names(ids):
    """``to_iterable_dataset`` of two tables with the same shape: named by the tables' fingerprints, never one for the
    other."""
    one = ShardList.of(stream(ids)).urls
    other = ShardList.of(stream(ids[::-1])).urls
    assert len(set(one) | set(other)) == 2 * SHARDS
