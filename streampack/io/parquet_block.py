"""Parquet shards with an integer-list token column, read as :class:`~streampack.io.token_block.TokenBlock` s.

One read per row group of the token column alone; the list offsets and values are taken zero-copy, so a block is the row
group's value buffer with each row a ``(start, length)`` in it. A block holds only rows the per-sample reader
(:mod:`streampack.io.parquet`) turns into valid samples with nothing to report (only the token column, within
``max_sample_bytes``, no null or empty row, ids in range); at the first row group that is not, the blocks end and that
reader reads on from that row.
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
from streampack.io.parquet import _decoded_bytes, group_firsts, int_lists, parquet_file
from streampack.io.retry import IOStats
from streampack.io.storage import OpenOptions
from streampack.io.token_block import TokenBlock


def parquet_blocks(url: str, where: ShardRange, *, decode: DecodeOptions, opts: OpenOptions,
                   streams: list[BinaryIO], stats: IOStats | None = None) -> Iterator[TokenBlock]:
    """One block per row group of rows ``[where.start, where.end)`` (see the module docstring)."""
    opened = _token_file(url, decode=decode, opts=opts, streams=streams, stats=stats)
    if opened is None:
        return
    pf, firsts = opened
    stop = firsts[-1] if where.end is None else min(where.end, firsts[-1])
    if where.start >= stop:
        yield TokenBlock.numbered(url, np.zeros(0, np.int64), np.zeros(1, np.int64), where.start, done=True)
        return
    group = int(np.searchsorted(firsts, where.start, side="right") - 1)
    while firsts[group] < stop:
        lo, hi = max(where.start, firsts[group]), min(stop, firsts[group + 1])
        column = _group(pf, group, firsts, decode)
        if column is None:
            return
        offsets, values = column
        offsets = offsets[lo - firsts[group]:hi - firsts[group] + 1]
        if not rows_ok(offsets, values, decode.limits.max_sample_bytes, id_bound(decode.vocab_size)):
            return
        yield TokenBlock.numbered(url, values, offsets, lo, done=hi == stop)
        group += 1


def parquet_groups_at(url: str, rows: list[int], *, decode: DecodeOptions, opts: OpenOptions,
                      streams: list[BinaryIO], stats: IOStats | None = None) -> list[TokenBlock] | None:
    """The whole row groups holding ``rows``, one block each, checked as :func:`parquet_blocks` checks
    a block; None where one is not such a block (or a row is past the end)."""
    opened = _token_file(url, decode=decode, opts=opts, streams=streams, stats=stats)
    if opened is None:
        return None
    pf, firsts = opened
    out = []
    for group in np.unique(np.searchsorted(firsts, rows, side="right") - 1).tolist():
        if group >= len(firsts) - 1:
            return None
        column = _group(pf, group, firsts, decode)
        if column is None or not rows_ok(*column, decode.limits.max_sample_bytes, id_bound(decode.vocab_size)):
            return None
        out.append(TokenBlock.numbered(url, column[1], column[0], firsts[group], done=False))
    return out


def _token_file(url: str, *, decode: DecodeOptions, opts: OpenOptions, streams: list[BinaryIO],
                stats: IOStats | None) -> tuple[Any, list[int]] | None:
    """The shard opened (its stream appended to ``streams``) and each row group's first row
    (and the row count after the last), when its token column is one a block holds."""
    try:
        streams.append(open_shard(url, opts=opts, stats=stats))
        pf = parquet_file(streams[-1], url)
    except (DataError, OSError):
        return None
    schema, key = pf.schema_arrow, decode.tokens_key
    if key not in schema.names or (decode.text_key and decode.text_key in schema.names):
        return None
    if not int_lists(schema.field(key).type, fixed=False):
        return None
    return pf, group_firsts(pf.metadata)


def _group(pf: Any, group: int, firsts: list[int], decode: DecodeOptions) -> tuple[np.ndarray, np.ndarray] | None:
    """Row group ``group``'s token column as (int64 list offsets ``[rows + 1]``, flat values), zero-copy; None
    when it cannot be read or holds a null, or when the per-sample reader refuses the group unread (over
    ``max_sample_bytes`` a row by the footer)."""
    import pyarrow as pa

    key = decode.tokens_key
    if _decoded_bytes(pf.metadata.row_group(group), [key]) // max(1, firsts[group + 1] - firsts[group]) \
            > decode.limits.max_sample_bytes:
        return None
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


def rows_ok(offsets: np.ndarray, values: np.ndarray, limit: int, bound: int) -> bool:
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


__all__ = ["parquet_blocks", "parquet_groups_at", "rows_ok"]
