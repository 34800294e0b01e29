"""Parquet shards with an integer-list token column, read as :class:`~streampack.io.token_block.TokenBlock` s.

One read per row group of the token column alone, as arrow: the list offsets and the flat
values are taken zero-copy (``to_numpy``), so a block is the row group's value buffer with each
row a ``(start, length)`` in it — no Python object per row (the per-sample reader made a numpy
slice, an int64 copy and a Sample per row).

A block holds only what the per-sample reader (:mod:`streampack.io.parquet`) turns into valid
samples with nothing to report: the token column is a ``list`` / ``large_list`` of integers and
the only column that reader reads (no ``text_key`` column: it reads that one too, and counts its
bytes against ``max_sample_bytes``); the row group is within ``max_sample_bytes`` per row from the
footer, as that reader judges it before decoding; no row is null, empty or over
``max_sample_bytes``, and every id is in ``[0, vocab bound)``. At the first row group that is not,
or one that cannot be read, the blocks end and the per-sample reader reads on from that row
(it locates a bad page to the row, and raises, counts and skips as always).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np

from streampack.errors import DataError
from streampack.io.decode import DecodeOptions
from streampack.io.formats import ShardRange
from streampack.io.limits import id_bound
from streampack.io.open import open_shard
from streampack.io.parquet import _decoded_bytes
from streampack.io.retry import IOStats
from streampack.io.storage import OpenOptions
from streampack.io.token_block import TokenBlock


def parquet_blocks(url: str, where: ShardRange, *, decode: DecodeOptions, opts: OpenOptions,
                   streams: list[BinaryIO], stats: IOStats | None = None) -> Iterator[TokenBlock]:
    """One block per row group of rows ``[where.start, where.end)`` (see the module docstring)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        streams.append(open_shard(url, opts=opts, stats=stats))
        pf = pq.ParquetFile(streams[-1])
    except (DataError, OSError, pa.ArrowException):
        return
    md, schema = pf.metadata, pf.schema_arrow
    key = decode.tokens_key
    if key not in schema.names or (decode.text_key and decode.text_key in schema.names):
        return
    kind = schema.field(key).type
    if not ((pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_integer(kind.value_type)):
        return
    counts = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
    firsts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()
    stop = firsts[-1] if where.end is None else min(where.end, firsts[-1])
    if where.start >= stop:
        yield _block(url, np.zeros(0, np.int64), np.zeros(1, np.int64), where.start, done=True)
        return
    limit, bound = decode.limits.max_sample_bytes, id_bound(decode.vocab_size)
    group = int(np.searchsorted(firsts, where.start, side="right") - 1)
    while firsts[group] < stop:
        lo, hi = max(where.start, firsts[group]), min(stop, firsts[group + 1])
        if _decoded_bytes(md.row_group(group), [key]) // max(1, counts[group]) > limit:
            return  # the per-sample reader refuses the group unread
        column = _read(pf, group, key)
        if column is None:
            return
        offsets, values = column
        offsets = offsets[lo - firsts[group]:hi - firsts[group] + 1]
        if not _rows_ok(offsets, values, limit, bound):
            return
        yield _block(url, values, offsets, lo, done=hi == stop)
        group += 1


def _read(pf: Any, group: int, key: str) -> tuple[np.ndarray, np.ndarray] | None:
    """The token column of one row group as (int64 list offsets ``[rows + 1]``, flat values),
    zero-copy; None when it cannot be read or holds a null."""
    import pyarrow as pa

    try:
        table = pf.read_row_group(group, columns=[key], use_threads=False)
    except (pa.ArrowException, OSError):
        return None
    column = table.column(0)
    if column.num_chunks != 1:
        column = column.combine_chunks()
    else:
        column = column.chunk(0)
    if column.null_count or column.values.null_count:
        return None
    offsets = column.offsets.to_numpy().astype(np.int64, copy=False)
    values = column.values.to_numpy()
    return offsets, values


def _rows_ok(offsets: np.ndarray, values: np.ndarray, limit: int, bound: int) -> bool:
    """No row empty or over ``limit`` bytes, every id in ``[0, bound)``."""
    lengths = np.diff(offsets)
    if not lengths.size:
        return True
    if (lengths < 1).any() or (lengths * values.itemsize > limit).any():
        return False
    used = values[offsets[0]:offsets[-1]]
    if values.dtype.kind == "u":
        return bool(used.max() < bound)
    return bool(used.max() < bound and used.min() >= 0)


def _block(url: str, values: np.ndarray, offsets: np.ndarray, first_row: int, *, done: bool) -> TokenBlock:
    rows = np.arange(first_row, first_row + offsets.size - 1, dtype=np.int64)
    return TokenBlock(url=url, tokens=values, starts=offsets[:-1], lengths=np.diff(offsets), offsets=rows,
                      next_offsets=rows + 1, numbers=rows, next_numbers=rows + 1, done=done)


__all__ = ["parquet_blocks"]
