"""A ``save_to_disk`` ``.arrow`` shard resumed at row ``r`` reads the schema and the record batches from the one
holding ``r``, never the bytes before it: the shard index records where each batch's message starts (an Arrow IPC
stream has no footer to seek by). Measured on a loopback HTTP server counting the bytes it serves; the rows are
``datasets.load_from_disk``'s."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from helpers_faults import serve_faulty

from streampack.cli.main import main
from streampack.io.arrow_ipc import BATCH_DTYPE
from streampack.io.blocks import read_blocks
from streampack.io.decode import DecodeOptions
from streampack.io.formats import ShardRange, open_range
from streampack.io.index import build_index, decode_index, encode_index, index_decode
from streampack.io.manifest import load_manifest
from streampack.io.storage import OpenOptions
from streampack.io.urls import expand_urls
from streampack.nodes.reader import ShardReader
from streampack.options import ReadOptions
from tests.unit.io.test_hf_datasets import BATCH, save

datasets = pytest.importorskip("datasets")
ROWS = 64 * BATCH
DECODE = DecodeOptions(tokens_key="input_ids")


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """1,024 rows of 200 ids (64 record batches, ~800 KiB) in one file, and the rows as ``load_from_disk`` gives."""
    rng = np.random.default_rng(5)
    path = tmp_path_factory.mktemp("arrow_seek") / "ds"
    save(path, {"input_ids": [rng.integers(0, 30_000, 200).tolist() for _ in range(ROWS)]}, 1)
    url = expand_urls(str(path))[0]
    return str(path), url, datasets.load_from_disk(str(path))["input_ids"]


def _served(server, name: str, size: int) -> int:
    """Bytes the server sent for GETs of ``name``."""
    total = 0
    for r in server.gets(name):
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", r.range or "")
        start, stop = (0, size) if m is None else (int(m.group(1)), min(int(m.group(2)) + 1 if m.group(2) else size,
                                                                        size))
        total += max(stop - start, 0)
    return total


def test_the_index_records_where_each_record_batch_starts(big):
    _, url, _ = big
    index = build_index(url, decode=index_decode(DECODE))
    table = index.batch_table
    assert table is not None and table.dtype == BATCH_DTYPE and len(table) == ROWS // BATCH
    assert table["row"].tolist() == list(range(0, ROWS, BATCH))
    with open(url, "rb") as f:
        data = f.read()
    # every offset is a message's start: the continuation marker, then a record batch's metadata
    assert all(data[o:o + 4] == b"\xff\xff\xff\xff" for o in table["offset"].tolist())
    back = decode_index(dict(np.load(_saved(index, url)))).batch_table
    assert back is not None and (back == table).all(), "the table survives the index file"


def _saved(index, url) -> str:
    path = url + ".test.npz"
    np.savez(path, **encode_index(index))
    return path


def _rows(remote: str, start: int, end: int | None, index, how: str) -> list[list[int]]:
    where = ShardRange(start=start, first=start, end=end)
    if how == "samples":
        return [i.sample.tokens.tolist() for i in open_range(remote, where, decode=DECODE, opts=OpenOptions(),
                                                             streams=[], index=index)]
    blocks = read_blocks(remote, where, decode=DECODE, opts=OpenOptions(), streams=[], index=index)
    assert blocks is not None
    out = []
    for block in blocks:
        out += [block.tokens[a:a + n].tolist() for a, n in zip(block.starts.tolist(), block.lengths.tolist())]
        assert block.numbers.tolist() == list(range(start + len(out) - len(block.starts), start + len(out)))
    return out


@pytest.mark.parametrize("how", ["samples", "blocks"])
@pytest.mark.parametrize("at", ["last_batch", "middle"])
def test_a_range_from_row_r_reads_one_batch_not_the_rows_before_it(big, at, how):
    path, url, rows = big
    name = os.path.basename(url)
    size = os.path.getsize(url)
    index = build_index(url, decode=index_decode(DECODE))
    table = index.batch_table
    start, end = (ROWS - 5, None) if at == "last_batch" else (ROWS // 2 + 3, ROWS // 2 + 9)
    holding = int(np.searchsorted(table["row"], start, side="right")) - 1
    batch_bytes = (int(table["offset"][holding + 1]) if holding + 1 < len(table) else size) - int(
        table["offset"][holding])
    with serve_faulty(path) as server:
        remote = f"{server.url}/{name}"
        got = _rows(remote, start, end, index, how)
        served = _served(server, name, size)
    assert got == rows[start:end]
    schema = int(table["offset"][0])
    assert served <= schema + batch_bytes + 16, (served, schema, batch_bytes, size)
    assert served < size // 20, f"the range read {served} of the shard's {size} bytes"


def test_a_reader_resumed_deep_in_a_remote_shard_reads_from_its_batch(big, tmp_path):
    """The whole path: the manifest's index, a saved reader position at row 1,000 of 1,024, a fresh reader."""
    path, url, rows = big
    name = os.path.basename(url)
    size = os.path.getsize(url)
    with serve_faulty(path) as server:
        remote = f"{server.url}/{name}"
        assert main(["index", remote, "--out", str(tmp_path / "m"), "--quiet", "--pool", "threads"]) == 0
        manifest = load_manifest(str(tmp_path / "m"))
        read = ReadOptions(tokens_key="input_ids")
        reader = ShardReader([remote], seed=0, shuffle=False, epochs=1, read=read, manifest=manifest)
        head = [next(reader) for _ in range(1_000)]
        state = reader.state_dict()
        server.requests.clear()
        again = ShardReader([remote], seed=0, shuffle=False, epochs=1, read=read, manifest=manifest)
        again.reset(state)
        rest = list(again)
        served = _served(server, name, size)
    assert [s.tokens.tolist() for s in head + rest] == rows
    assert served < size // 20, f"the resume read {served} of the shard's {size} bytes"
