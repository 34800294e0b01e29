"""Hugging Face ``datasets`` saved with ``save_to_disk``, read with files ``datasets`` itself writes: every row as
``load_from_disk`` gives it, the directory in ``state.json``'s order, a range from any row without decoding the
batches before it, and a truncated, corrupt or oversized file a ``DataError`` naming the file and the row."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from streampack.errors import DataError
from streampack.io.decode import DecodeOptions
from streampack.io.formats import ShardRange, open_range
from streampack.io.index import build_index
from streampack.io.limits import Limits
from streampack.io.storage import OpenOptions
from streampack.io.urls import expand_urls, shard_format

datasets = pytest.importorskip("datasets")
BATCH = 16
"""Rows per record batch the fixtures write (``datasets`` writes 1,000 by default)."""
SECRET = "TOPSECRET"


def save(path, columns: dict, shards: int, monkeypatch=None) -> str:
    """``columns`` saved by ``Dataset.save_to_disk`` in ``shards`` files of ``BATCH``-row record batches."""
    datasets.disable_progress_bars()
    old = datasets.config.DEFAULT_MAX_BATCH_SIZE
    datasets.config.DEFAULT_MAX_BATCH_SIZE = BATCH
    try:
        datasets.Dataset.from_dict(columns).save_to_disk(str(path), num_shards=shards)
    finally:
        datasets.config.DEFAULT_MAX_BATCH_SIZE = old
    return str(path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """150 rows of long-tail token lists and their text, in 3 files of 16-row record batches."""
    rng = np.random.default_rng(3)
    ids = [rng.integers(0, 30_000, int(n)).tolist() for n in np.clip(rng.lognormal(3, 1, 150), 1, 400)]
    return save(tmp_path_factory.mktemp("hf") / "ds", {"input_ids": ids, "text": [f"row {i}" for i in range(150)]},
                3)


def read(url: str, start: int = 0, end: int | None = None, decode: DecodeOptions = DecodeOptions(
        tokens_key="input_ids")) -> list:
    return list(open_range(url, ShardRange(start=start, first=start, end=end), decode=decode, opts=OpenOptions(),
                           streams=[]))


def test_every_row_equals_load_from_disk_in_state_json_order(saved):
    urls = expand_urls(saved)
    with open(os.path.join(saved, "state.json")) as f:
        assert [os.path.basename(u) for u in urls] == [d["filename"] for d in json.load(f)["_data_files"]]
    assert {shard_format(u) for u in urls} == {"arrow"} and len(urls) == 3
    items = [item for u in urls for item in read(u)]
    assert all(item.error is None for item in items)
    want = datasets.load_from_disk(saved)
    assert [item.sample.tokens.tolist() for item in items] == want["input_ids"]
    texts = [item.sample.text for u in urls for item in read(u, decode=DecodeOptions(tokens_key="absent"))]
    assert texts == want["text"]
    for u in urls:
        got = read(u)
        assert [i.next_offset for i in got] == list(range(1, len(got) + 1))
        assert [i.at_end for i in got] == [False] * (len(got) - 1) + [True]
        index = build_index(u, decode=DecodeOptions(tokens_key="input_ids"))
        assert index.lengths.tolist() == [len(i.sample.tokens) for i in got] and not index.damage


def test_the_directory_expands_in_state_json_order_not_by_name(saved, tmp_path):
    import shutil

    copy = str(tmp_path / "ds")
    shutil.copytree(saved, copy)
    with open(os.path.join(copy, "state.json")) as f:
        state = json.load(f)
    state["_data_files"].reverse()
    with open(os.path.join(copy, "state.json"), "w") as f:
        json.dump(state, f)
    assert [os.path.basename(u) for u in expand_urls(copy)] == [d["filename"] for d in state["_data_files"]]
    state["_data_files"] = [{"filename": "../elsewhere.arrow"}]
    with open(os.path.join(copy, "state.json"), "w") as f:
        json.dump(state, f)
    with pytest.raises(ValueError, match="elsewhere"):
        expand_urls(copy)


def test_a_range_starts_at_its_row(saved):
    url = expand_urls(saved)[1]
    whole = [i.sample.tokens.tolist() for i in read(url)]
    for start, end in ((0, 5), (BATCH - 1, BATCH + 1), (BATCH * 2 + 3, None), (len(whole) - 1, None), (7, 7)):
        got = read(url, start, end)
        assert [i.sample.tokens.tolist() for i in got] == whole[start:end]
        assert [i.sample.key for i in got] == [str(r) for r in range(start, len(whole) if end is None else end)]


def _corrupt_text(path: str, row: int) -> None:
    """Row ``row``'s text (``SECRET`` + row) made invalid UTF-8 in place: the file still reads as a stream."""
    with open(path, "r+b") as f:
        data = f.read()
        at = data.index(f"{SECRET}{row:03d}".encode())
        f.seek(at)
        f.write(b"\xff\xfe")


def test_resuming_at_a_row_does_not_decode_the_batches_before_it(tmp_path):
    """Row 3 is broken (invalid UTF-8): a read from it or from 0 names it, a read from the next batch on never
    decodes it, so it succeeds."""
    url = expand_urls(save(tmp_path / "ds", {"input_ids": [[r + 1] * 3 for r in range(64)],
                                             "text": [f"{SECRET}{r:03d}" for r in range(64)]}, 1))[0]
    _corrupt_text(url, 3)
    got = read(url, BATCH)
    assert [i.sample.tokens.tolist() for i in got] == [[r + 1] * 3 for r in range(BATCH, 64)]
    with pytest.raises(DataError, match="row 3: fails validation") as e:
        for item in open_range(url, ShardRange(start=0, first=0), decode=DecodeOptions(tokens_key="input_ids"),
                               opts=OpenOptions(), streams=[]):
            assert int(item.sample.key) < 3, "a row at or after the broken one was delivered"
    assert e.value.url == url and e.value.key == "3" and SECRET not in str(e.value)


def test_a_truncated_file_names_the_first_row_it_cannot_read(saved, tmp_path):
    """Cut inside its third record batch: the two whole batches are delivered, then the error names row 32; its
    index stops there with the damage named."""
    import shutil

    url = str(tmp_path / "cut.arrow")
    shutil.copy(expand_urls(saved)[0], url)
    whole = [i.sample.tokens.tolist() for i in read(url)]
    os.truncate(url, os.path.getsize(url) * 2 // 5)
    got = []
    with pytest.raises(DataError, match=r"row (\d+): cannot read the record batch") as e:
        for item in open_range(url, ShardRange(start=0, first=0), decode=DecodeOptions(tokens_key="input_ids"),
                               opts=OpenOptions(), streams=[]):
            got.append(item.sample.tokens.tolist())
    row = int(e.value.key)
    assert e.value.url == url and e.value.reason == "corrupt_shard" and 0 < row < len(whole) and row % BATCH == 0
    assert got == whole[:row]
    index = build_index(url, decode=DecodeOptions(tokens_key="input_ids"))
    assert len(index) == row and "corrupt_shard" in index.damage
    with pytest.raises(DataError, match=f"row {row}"):
        read(url, row)


def test_a_file_cut_at_a_batch_boundary_is_short_of_its_planned_range(saved, tmp_path):
    """A stream cut exactly between two record batches reads as a shorter stream: a range planned past the cut
    names the row where the file ends."""
    import pyarrow as pa

    src = expand_urls(saved)[0]
    with open(src, "rb") as f:
        batches = list(pa.ipc.open_stream(f))
    url = str(tmp_path / "short.arrow")
    with pa.OSFile(url, "wb") as sink, pa.ipc.new_stream(sink, batches[0].schema) as writer:
        writer.write_batch(batches[0])
    with pytest.raises(DataError, match=f"row {BATCH}: the file ends there"):
        read(url, 0, BATCH * 2)


def test_garbage_is_a_data_error_at_row_0(tmp_path):
    url = str(tmp_path / "data-00000-of-00001.arrow")
    with open(url, "wb") as f:
        f.write(b"\xff\xff\xff\xff\x40\x00\x00\x00" + SECRET.encode() * 30)
    with pytest.raises(DataError, match="row 0") as e:
        read(url)
    assert e.value.key == "0" and SECRET not in str(e.value)


def test_a_record_batch_over_max_sample_bytes_is_refused_before_it_is_read(saved):
    url = expand_urls(saved)[0]
    decode = DecodeOptions(tokens_key="input_ids", limits=Limits(max_sample_bytes=2048))
    with pytest.raises(DataError, match="over max_sample_bytes=2048") as e:
        read(url, decode=decode)
    assert e.value.reason == "sample_too_large" and e.value.url == url


def test_a_row_of_the_wrong_type_or_out_of_vocabulary_is_an_item_error(tmp_path):
    url = expand_urls(save(tmp_path / "ds", {"input_ids": [[1, 2], [5, 99_999], [3]]}, 1))[0]
    got = read(url, decode=DecodeOptions(tokens_key="input_ids", vocab_size=1000))
    assert [i.error is None for i in got] == [True, False, True]
    assert got[1].error.key == "1"


def test_token_blocks_give_the_rows_and_stop_where_a_row_is_not_plain(tmp_path):
    """The block reader hands over the rows of a range as the per-sample reader does, and ends before the batch
    holding a row that reader reports (an id out of the vocabulary), so that reader reads on from there."""
    from streampack.io.blocks import read_blocks

    rows = [[r % 50 + 1] * (1 + r % 9) for r in range(70)]
    rows[40] = [1, 5000]
    url = expand_urls(save(tmp_path / "ds", {"input_ids": rows}, 1))[0]
    decode = DecodeOptions(tokens_key="input_ids", vocab_size=1000)
    got = []
    for block in read_blocks(url, ShardRange(start=5, first=5, end=60), decode=decode, opts=OpenOptions(),
                             streams=[]):
        got += [block.tokens[s:s + n].tolist() for s, n in zip(block.starts.tolist(), block.lengths.tolist())]
        assert block.offsets.tolist() == list(range(5 + len(got) - len(block), 5 + len(got)))
    assert got == rows[5:BATCH * 2], "the blocks did not stop at the batch holding row 40"
    whole = list(read_blocks(url, ShardRange(start=41, first=41, end=None), decode=decode, opts=OpenOptions(),
                             streams=[]))
    assert sum(len(b) for b in whole) == 70 - 41 and whole[-1].done
