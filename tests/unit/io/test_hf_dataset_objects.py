"""A ``datasets.Dataset`` object as a source, each kind through ``PackedDataset``: an in-memory table (``from_dict``,
read in place as row ranges named by its fingerprint), one with an indices mapping (``shuffle``: sample ``i`` is
``ds[i]``), one backed by its cache files (``load_from_disk``: the ``.arrow`` files read) and a memory-mapped one with a
mapping. Every row as ``ds[i]`` gives it, with blocks and per sample; three ranks with equal batch counts and every row
once; exact and elastic resume; DataLoader workers; a state of another dataset refused; the hostile-input contract."""

from __future__ import annotations

import re

import numpy as np
import pytest
from node_checks import (
    canon,
    check_elastic_resume_every_document_once,
    check_exact_resume,
    check_ranks_deliver_every_document_once,
    documents_by_key,
    planned_dataset,
    read_as,
    roundtrip,
    take,
)

from streampack.dataset import PackedDataset
from streampack.errors import DataError
from streampack.io import hf_dataset
from streampack.io.decode import DecodeOptions
from streampack.io.formats import ShardRange, open_range
from streampack.io.storage import OpenOptions
from streampack.io.urls import ShardList
from streampack.options import PackOptions, ReadOptions

datasets = pytest.importorskip("datasets")
CAP = 256
KINDS = ("memory", "shuffled", "files", "files_shuffled")
MAPPED = ("memory", "shuffled", "files")
SECRET = "TOPSECRET"


@pytest.fixture(scope="module")
def ids() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(0, 50_000, int(n)).tolist() for n in np.clip(rng.lognormal(4.5, 0.9, 300), 1, 3 * CAP)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, ids) -> str:
    datasets.disable_progress_bars()
    path = str(tmp_path_factory.mktemp("hfobj") / "ds")
    datasets.Dataset.from_dict({"input_ids": ids}).save_to_disk(path, num_shards=4)
    return path


@pytest.fixture(autouse=True)
def small_shards(monkeypatch):
    """64-row shards, so the 300 rows of an object are 5 shards to order and split."""
    monkeypatch.setattr(hf_dataset, "ROWS_PER_SHARD", 64)


def make(kind: str, ids: list[list[int]], saved: str):
    if kind in ("memory", "shuffled"):
        ds = datasets.Dataset.from_dict({"input_ids": ids})
    else:
        ds = datasets.load_from_disk(saved)
    return ds.shuffle(seed=5) if kind.endswith("shuffled") else ds


def keys_of(ds) -> list[str]:
    """The key ``PackedDataset`` gives ``ds[i]``, for every ``i``."""
    urls = ShardList.of(ds).urls
    if hf_dataset.is_object_url(urls[0]):
        return [f"{u}#{k}" for u in urls for k in range(int(u.rsplit("-", 1)[1]) - int(re.search(r"rows-(\d+)", u)[1]))]
    return [f"{u}#{r}" for u in urls for r in range(datasets.Dataset.from_file(u).num_rows)]


def expected_of(ds) -> dict[str, list[int]]:
    rows = ds["input_ids"]
    return dict(zip(keys_of(ds), rows, strict=True))


@pytest.mark.parametrize("kind", KINDS)
def test_every_row_is_ds_i(kind, ids, saved, tmp_path, monkeypatch):
    ds = make(kind, ids, saved)
    expected = expected_of(ds)
    assert len(expected) == len(ids) and sorted(expected.values()) != list(expected.values())  # not vacuous
    for blocks in (True, False):
        read_as(monkeypatch, blocks)
        got = documents_by_key(PackedDataset(ds, capacity=CAP, epochs=1, read=ReadOptions(cache_dir=str(tmp_path))))
        assert got == expected


def test_what_each_kind_reads(ids, saved):
    """Whole cache files are read as files; a mapping, a slice, a renamed column (the file's names differ) or an
    in-memory table as row ranges of the object."""
    loaded = datasets.load_from_disk(saved)
    assert ShardList.of(loaded).urls == tuple(f["filename"] for f in loaded.cache_files)
    assert ShardList.of(loaded).held is None
    for ds in (loaded.shuffle(seed=1), loaded.select(range(3, 200)), loaded.rename_column("input_ids", "ids"),
               datasets.Dataset.from_dict({"input_ids": ids})):
        shards = ShardList.of(ds)
        assert shards.urls[0] == f"hf-dataset://{ds._fingerprint}/rows-0-64" and shards.held.ds is ds
        assert shards.urls[-1].endswith(f"-{len(ds)}")


def test_load_dataset_and_a_cached_map_are_read_as_their_cache_files(ids, tmp_path):
    """``load_dataset`` (its builder's cache file) and a ``map`` writing a cache file: the files themselves, each row
    as ``ds[i]``."""
    import json

    with open(tmp_path / "rows.jsonl", "w") as f:
        f.writelines(json.dumps({"input_ids": row}) + "\n" for row in ids)
    loaded = datasets.load_dataset("json", data_files=str(tmp_path / "rows.jsonl"), split="train",
                                   cache_dir=str(tmp_path / "hf"))
    mapped = loaded.map(lambda row: {"input_ids": row["input_ids"][::-1]})
    for ds in (loaded, mapped):
        assert ShardList.of(ds).urls == tuple(f["filename"] for f in ds.cache_files)
        got = documents_by_key(PackedDataset(ds, capacity=CAP, epochs=1, read=ReadOptions(cache_dir=str(tmp_path))))
        assert got == expected_of(ds)


@pytest.mark.parametrize("kind", [k if k in ("shuffled", "files") else pytest.param(k, marks=pytest.mark.slow)
                                  for k in KINDS])
def test_three_ranks_equal_steps_every_row_once(kind, ids, saved, tmp_path, monkeypatch):
    ds = make(kind, ids, saved)
    read = ReadOptions(cache_dir=str(tmp_path))
    check_ranks_deliver_every_document_once(lambda r: planned_dataset(ds, read, r, 3, capacity=CAP),
                                            expected_of(ds), monkeypatch)


@pytest.mark.parametrize("kind", [k if k == "shuffled" else pytest.param(k, marks=pytest.mark.slow) for k in KINDS])
def test_exact_resume(kind, ids, saved, tmp_path):  # ~2 s each: the mapped table in the fast loop, all in the slow set
    ds = make(kind, ids, saved)
    read = ReadOptions(cache_dir=str(tmp_path))
    check_exact_resume(lambda: planned_dataset(ds, read, 0, 2, capacity=CAP))


@pytest.mark.parametrize("kind", MAPPED)
def test_elastic_resume_three_to_two_ranks_every_row_once(kind, ids, saved, tmp_path):
    ds = make(kind, ids, saved)
    read = ReadOptions(cache_dir=str(tmp_path))
    build = lambda r, size: planned_dataset(ds, read, r, size, capacity=CAP, packs_per_batch=1,  # noqa: E731
                                            packing=PackOptions(window=8))
    check_elastic_resume_every_document_once(build, expected_of(ds), old=(3, 1), new=(2, 2), taken=3)


@pytest.mark.slow  # ~3 s; a stream's worker resume stays in the fast loop (test_hf_stream.py)
def test_forked_dataloader_workers_read_every_row_once_and_resume(ids, tmp_path):
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = datasets.Dataset.from_dict({"input_ids": ids}).shuffle(seed=2)
    make_ds = lambda: PackedDataset(ds, capacity=CAP, epochs=1, seed=3,  # noqa: E731
                                    read=ReadOptions(cache_dir=str(tmp_path)))
    loader = lambda d: StatefulDataLoader(d, batch_size=None, num_workers=2,  # noqa: E731
                                          multiprocessing_context="fork")
    whole = list(loader(make_ds()))
    assert documents_by_key(whole) == expected_of(ds)
    first = loader(make_ds())
    head = list(take(iter(first), 3))
    state = roundtrip(first.state_dict())
    again = loader(make_ds())
    again.load_state_dict(state)
    assert [canon(b) for b in head + list(again)] == [canon(b) for b in whole]


@pytest.mark.slow
def test_spawned_dataloader_workers_get_the_table_with_the_dataset(ids, tmp_path):
    from torch.utils.data import DataLoader

    ds = datasets.Dataset.from_dict({"input_ids": ids})
    pd = PackedDataset(ds, capacity=CAP, epochs=1, read=ReadOptions(cache_dir=str(tmp_path)))
    got = documents_by_key(DataLoader(pd, batch_size=None, num_workers=2, multiprocessing_context="spawn"))
    assert got == expected_of(ds)


def test_another_holder_of_the_same_dataset_going_away_orphans_nothing(ids, tmp_path):
    """The registry is weak and by fingerprint: a second holder of the same data (here the same object listed again,
    then dropped) must not take the first holder's entry with it."""
    import gc

    ds = datasets.Dataset.from_dict({"input_ids": ids})
    pd = PackedDataset(ds, capacity=CAP, epochs=1, read=ReadOptions(cache_dir=str(tmp_path)))
    ShardList.of(datasets.Dataset.from_dict({"input_ids": ids}))  # the same fingerprint, dropped at once
    gc.collect()
    assert documents_by_key(pd) == expected_of(ds)


def test_a_state_of_another_dataset_is_refused(ids, tmp_path):
    read = ReadOptions(cache_dir=str(tmp_path))
    one = PackedDataset(datasets.Dataset.from_dict({"input_ids": ids}), capacity=CAP, epochs=1, read=read)
    next(iter(one))
    other = PackedDataset(datasets.Dataset.from_dict({"input_ids": ids[::-1]}), capacity=CAP, epochs=1, read=read)
    with pytest.raises(ValueError, match="sources"):
        other.load_state_dict(roundtrip(one.state_dict()))


def test_its_urls_name_the_object_while_it_is_held(ids, tmp_path):
    """``PackedDataset(ds).urls`` given as URLs read the same rows while the object is held (a second dataset over the
    same sources, the ``streampack`` command's data lists)."""
    ds = datasets.Dataset.from_dict({"input_ids": ids})
    first = PackedDataset(ds, capacity=CAP, epochs=1, read=ReadOptions(cache_dir=str(tmp_path)))
    again = PackedDataset(first.urls, capacity=CAP, epochs=1, read=ReadOptions(cache_dir=str(tmp_path)))
    assert [canon(b) for b in again] == [canon(b) for b in first]


def test_a_url_without_its_dataset_is_named(ids):
    url = ShardList.of(datasets.Dataset.from_dict({"input_ids": ids})).urls[0].replace("rows", "rows", 1)
    gone = url.replace(url[len("hf-dataset://"):].split("/")[0], "0" * 16)
    with pytest.raises(DataError, match="no datasets.Dataset with fingerprint 0{16}") as e:
        list(open_range(gone, ShardRange(start=0, first=0), decode=DecodeOptions(), opts=OpenOptions(), streams=[]))
    assert e.value.url == gone


def test_text_is_tokenized_and_ids_are_read(tmp_path):
    ds = datasets.Dataset.from_dict({"text": ["abc", "de", "fghij"]})
    got = documents_by_key(PackedDataset(ds, capacity=32, epochs=1, shuffle=False, tokenizer=lambda t: [ord(c) for c in t],
                                         read=ReadOptions(cache_dir=str(tmp_path))))
    assert sorted(got.values()) == sorted([[ord(c) for c in t] for t in ds["text"]])


@pytest.mark.parametrize("blocks", [True, False])
def test_hostile_rows_name_the_shard_and_row_never_the_content(blocks, tmp_path, monkeypatch):
    """An id out of the vocabulary is a ``DataError`` naming the shard and the row (its position in the mapped
    dataset), never a value of another column; under ``skip`` exactly the bad rows (that one, a null, an empty list)
    are dropped and counted."""
    read_as(monkeypatch, blocks)
    rows = [[1, 2], [3, 4, 5], [7, 99_999], None, [], [6]]
    ds = datasets.Dataset.from_dict({"input_ids": rows, "note": [SECRET] * len(rows)}).shuffle(seed=0)
    url = ShardList.of(ds).urls[0]
    first = next(i for i in range(len(ds)) if ds[i]["input_ids"] != [1, 2] and ds[i]["input_ids"] != [3, 4, 5]
                 and ds[i]["input_ids"] != [6])
    with pytest.raises(DataError) as e:
        list(PackedDataset(ds, capacity=32, epochs=1, shuffle=False,
                           read=ReadOptions(vocab_size=1000, cache_dir=str(tmp_path))))
    assert e.value.url == url and e.value.key == str(first) and SECRET not in str(e.value)
    skip = PackedDataset(ds, capacity=32, epochs=1, shuffle=False,
                         read=ReadOptions(vocab_size=1000, on_error="skip", cache_dir=str(tmp_path)))
    assert sorted(documents_by_key(skip).values()) == [[1, 2], [3, 4, 5], [6]]
    assert skip.metrics()["errors"]["counts"] == {"out_of_vocab_id": 1, "missing_field": 1, "empty_sample": 1}


def test_a_transform_applied_on_read_is_refused_naming_map(ids):
    """``ds[i]`` of a dataset with ``set_transform`` is the transform's output, not the table's row."""
    ds = datasets.Dataset.from_dict({"input_ids": ids}).with_transform(lambda batch: batch)
    with pytest.raises(ValueError, match=r"with_transform.*ds\.map"):
        PackedDataset(ds, capacity=CAP)
