"""Parquet shards: token and text columns, labels / loss masks, bad rows under raise and skip,
resume at (row group, row) without reading earlier row groups, splitting a file by rows, the
footer-only index, directories and any fsspec filesystem (memory:// standing in for hf://)."""

from __future__ import annotations

import io
import os

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers_data import CountingFile, make_text_docs, make_token_docs
from helpers_formats import write_parquet, write_parquet_shards

from streampack.dataset import PackedDataset
from streampack.errors import DataError, ErrorCounter, ErrorPolicy
from streampack.io import open as open_mod
from streampack.io.index import load_or_build_index
from streampack.io.urls import expand_urls
from streampack.nodes.reader import OFFSET_KEY, SAMPLE_KEY, ShardReader
from streampack.options import ReadOptions
from streampack.options.topology import Placement


def read_all(urls, **kw) -> list:
    return list(ShardReader(urls, shuffle=False, epochs=1, **kw))


@pytest.mark.parametrize("token_type", [pa.int32(), pa.int64(), pa.uint16()])
def test_token_column_roundtrip(tmp_path, token_type):
    docs = make_token_docs(50, seed=1, max_len=60)
    urls = write_parquet_shards(tmp_path, docs, 2, token_type=token_type)
    out = read_all(urls)
    assert [s.tokens.tolist() for s in out] == docs
    assert all(s.tokens.dtype == np.int64 for s in out)
    assert [s.key for s in out] == [str(i) for i in range(25)] * 2 and out[30].url == urls[1]


def test_large_list_and_text_columns(tmp_path):
    docs = make_token_docs(10, seed=2)
    path = tmp_path / "large.parquet"
    pq.write_table(pa.table({"input_ids": pa.array(docs, pa.large_list(pa.int64()))}), path)
    assert [s.tokens.tolist() for s in read_all(str(path))] == docs
    texts = make_text_docs(12, seed=3)
    (url,) = write_parquet_shards(tmp_path / "t", texts, 1)
    assert [s.text for s in read_all(url)] == texts
    binary = tmp_path / "b.parquet"
    pq.write_table(pa.table({"content": pa.array([t.encode() for t in texts], pa.binary())}), binary)
    assert [s.text for s in read_all(str(binary), read=ReadOptions(text_key="content"))] == texts


def test_labels_and_loss_mask_columns(tmp_path):
    docs = make_token_docs(8, seed=4)
    labels = [[t if i % 2 else -100 for i, t in enumerate(d)] for d in docs]
    masks = [[i % 2 for i in range(len(d))] for d in docs]
    url = write_parquet(tmp_path / "l.parquet", docs, extra={
        "labels": pa.array(labels, pa.list_(pa.int64())), "mask": pa.array(masks, pa.list_(pa.int8()))})
    out = read_all(url, read=ReadOptions(labels_key="labels", loss_mask_key="mask"))
    assert [s.labels.tolist() for s in out] == labels
    assert [s.loss_mask.astype(int).tolist() for s in out] == masks


BAD_ROWS = {
    "missing_field": None,
    "empty_sample": [],
    "negative_id": [3, -1],
    "bad_dtype": [1, None, 2],
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_row_raise_and_skip(tmp_path, case):
    good = make_token_docs(4, seed=5)
    rows = [*good[:2], BAD_ROWS[case], *good[2:]]
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"input_ids": pa.array(rows, pa.list_(pa.int64()))}), path, row_group_size=2)
    with pytest.raises(DataError) as info:
        read_all(str(path))
    assert info.value.reason == case and info.value.key == "2" and str(path) in str(info.value)
    errors = ErrorCounter()
    out = read_all(str(path), error_policy=ErrorPolicy("skip", errors))
    assert [s.tokens.tolist() for s in out] == good and [s.key for s in out] == ["0", "1", "3", "4"]
    assert errors.counts == {case: 1}


def test_float_column_and_missing_columns(tmp_path):
    path = tmp_path / "f.parquet"
    pq.write_table(pa.table({"input_ids": pa.array([[1.5, 2.0]], pa.list_(pa.float64()))}), path)
    with pytest.raises(DataError, match="non_integer_id|bad_dtype"):
        read_all(str(path))
    other = tmp_path / "o.parquet"
    pq.write_table(pa.table({"body": ["x"]}), other)
    with pytest.raises(DataError, match=r"missing_field: no column 'input_ids' or 'text'.*body") as info:
        read_all(str(other))
    assert str(other) in str(info.value)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_unreadable_file_is_corrupt_shard(tmp_path, damage):
    docs = make_token_docs(20, seed=6)
    (bad, good) = write_parquet_shards(tmp_path, docs, 2)
    data = open(bad, "rb").read()
    open(bad, "wb").write(b"not parquet at all" if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(DataError, match="corrupt_shard") as info:
        read_all([bad, good])
    assert bad in str(info.value)
    errors = ErrorCounter()
    assert [s.tokens.tolist() for s in read_all([bad, good], error_policy=ErrorPolicy("skip", errors))] == docs[10:]
    assert errors.counts == {"corrupt_shard": 1}


def _row_group_spans(path: str) -> list[tuple[int, int]]:
    md = pq.ParquetFile(path).metadata
    spans = []
    for g in range(md.num_row_groups):
        cols = [md.row_group(g).column(c) for c in range(md.row_group(g).num_columns)]
        start = min(c.dictionary_page_offset or c.data_page_offset for c in cols)
        spans.append((start, start + sum(c.total_compressed_size for c in cols)))
    return spans


def test_resume_seeks_to_the_row_group_without_reading_earlier_ones(tmp_path, monkeypatch):
    docs = make_token_docs(200, seed=7, min_len=400, max_len=500, vocab=2**30)  # incompressible
    url = write_parquet(tmp_path / "big.parquet", docs, row_group_size=20)
    reader = ShardReader(url, epochs=1)
    head = [next(reader) for _ in range(127)]  # row group 6, row 7 inside it
    state = reader.state_dict()
    assert (state[OFFSET_KEY], state[SAMPLE_KEY]) == (127, 127)

    CountingFile.log = []
    monkeypatch.setattr(open_mod, "_open_local", lambda p: io.BufferedReader(CountingFile(p)))
    resumed = ShardReader(url, epochs=1)
    resumed.reset(state)
    assert [s.tokens.tolist() for s in head + list(resumed)] == docs
    spans, size = _row_group_spans(url), os.path.getsize(url)
    footer = size - 64 * 1024  # pyarrow reads the file's last 64 KiB to find the footer
    assert CountingFile.log and footer > spans[5][1], "the byte check would pass vacuously"
    for pos, n in CountingFile.log:
        assert pos >= spans[6][0] or pos >= footer or pos + n <= spans[0][0], (pos, n, spans[:7])


def test_fewer_files_than_workers_split_by_rows_with_a_footer_index(tmp_path, monkeypatch):
    docs = make_token_docs(100, seed=8, min_len=1500, max_len=2000, vocab=2**30)
    url = write_parquet(tmp_path / "one.parquet", docs, row_group_size=8)
    CountingFile.log = []
    monkeypatch.setattr(open_mod, "_open_local", lambda p: io.BufferedReader(CountingFile(p)))
    index = load_or_build_index(url, cache_dir=str(tmp_path / "cache"), positions_only=True)  # as a reader asks
    assert len(index) == 100 and index.part(37, 100) == (37, 38, 37) and index.part(99, 100) == (99, 100, 99)
    footer = sum(n for _, n in CountingFile.log)
    assert footer < 0.2 * os.path.getsize(url), "the index of a parquet file is its footer, not a scan"
    parts = [[s.tokens.tolist() for s in ShardReader(url, place=Placement(worker_id=w, num_workers=3), epochs=1,
                                                     read=ReadOptions(cache_dir=str(tmp_path / "cache")))]
             for w in range(3)]
    assert [len(p) for p in parts] == [34, 33, 33] and sum(parts, []) == docs


def test_directory_and_memory_filesystem_as_urls(tmp_path):
    docs = make_token_docs(30, seed=9)
    urls = write_parquet_shards(tmp_path / "repo" / "data", docs, 3)
    (tmp_path / "repo" / "README.md").write_text("a dataset card")
    assert expand_urls(str(tmp_path / "repo")) == urls
    fs = fsspec.filesystem("memory")
    for u in urls:  # an hf://datasets/... repo is listed and read the same way, through fsspec
        fs.pipe(f"/repo-test/data/{os.path.basename(u)}", open(u, "rb").read())
    fs.pipe("/repo-test/README.md", b"card")
    try:
        remote = expand_urls("memory://repo-test")
        assert [u.rsplit("/", 1)[1] for u in remote] == [os.path.basename(u) for u in urls]
        assert [s.tokens.tolist() for s in read_all(remote)] == docs
        got = [b.input_ids.tolist() for b in PackedDataset("memory://repo-test/data/", capacity=64, epochs=1, seed=1)]
        want = [b.input_ids.tolist() for b in PackedDataset(urls, capacity=64, epochs=1, seed=1)]
        assert got == want and got
    finally:
        fs.rm("/repo-test", recursive=True)
