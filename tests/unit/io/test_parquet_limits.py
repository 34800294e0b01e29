"""Issue 18, item 16: parquet honours ``Limits.max_sample_bytes`` before decoding, as jsonl and
tar do: a row group that must hold an oversize row is refused from the footer, unread; a big row
among small ones is refused after its (limit-sized) batch is decoded; good rows are kept."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers_hostile import read, skip

from streampack.errors import DataError
from streampack.io.limits import Limits
from streampack.options import ReadOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from rss_child import read_in_child  # noqa: E402

MiB = 1 << 20


def _ids(rows: list[np.ndarray], path: Path, row_group_size: int) -> str:
    table = pa.table({"input_ids": pa.array(rows, pa.list_(pa.int64()))})
    pq.write_table(table, path, row_group_size=row_group_size, compression="zstd")
    return str(path)


def test_one_row_group_over_the_limit_is_refused_from_the_footer(tmp_path):
    small = [np.array([i + 1, 7]) for i in range(4)]
    url = _ids([*small[:2], np.zeros(1 << 20, np.int64), *small[2:]], tmp_path / "bomb.parquet", 1)
    assert os.path.getsize(url) < 16 << 10  # 1 Mi ids (8 MiB decoded) in a few KiB
    kept, counts = skip(url, read=ReadOptions(limits=Limits(max_sample_bytes=MiB)))
    assert kept == [1, 2, 3, 4] and counts == {"sample_too_large": 1}
    with pytest.raises(DataError, match=r"sample_too_large: row group 2 .* not read") as info:
        read(url, read=ReadOptions(limits=Limits(max_sample_bytes=MiB)))
    assert info.value.key == "2"
    assert skip(url, read=ReadOptions(limits=Limits(max_sample_bytes=16 * MiB))) == ([1, 2, 0, 3, 4], {})


def test_a_big_row_among_small_ones_is_refused_alone(tmp_path):
    rows = [np.array([i + 1, 7]) for i in range(200)]
    rows[50] = np.full(200_000, 9, np.int64)  # 1.6 MB decoded; the group averages ~8 KB a row
    url = _ids(rows, tmp_path / "mixed.parquet", 200)
    kept, counts = skip(url, read=ReadOptions(limits=Limits(max_sample_bytes=MiB)))
    assert kept == [i + 1 for i in range(200) if i != 50] and counts == {"sample_too_large": 1}


@pytest.mark.slow
@pytest.mark.parametrize("bomb", ["ids", "string"])
def test_parquet_bombs_cost_nothing_over_the_limit(tmp_path, bomb):
    # finding: a 1 KiB file with one row of 64M ids cost +1,090 MiB; an 8 KiB file with one
    # 256 MiB string +1,061 MiB (jsonl and tar: +57 MiB for the same bombs)
    path = tmp_path / f"{bomb}.parquet"
    if bomb == "ids":
        column = pa.array([np.zeros(64 << 20, np.int64)], pa.list_(pa.int64()))
        table = pa.table({"input_ids": pa.concat_arrays([pa.array([[1, 2]], pa.list_(pa.int64())), column])})
    else:
        table = pa.table({"text": ["good", "a" * (256 * MiB)]})
    pq.write_table(table, path, row_group_size=1, compression="zstd")
    del table
    got = read_in_child(str(path), cwd=str(tmp_path), timeout=300)
    assert got.keys == ["0"] and got.errors == {"sample_too_large": 1}
    # the first parquet read of a process costs ~80 MiB (pyarrow.parquet imported, its pools)
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2], [3, 4]], pa.list_(pa.int64()))}), plain, row_group_size=1)
    base = read_in_child(str(plain), cwd=str(tmp_path), timeout=300).growth_mib
    assert got.growth_mib < base + 32, f"peak RSS grew {got.growth_mib} MiB (a 2-row file: {base} MiB)"
