"""Hugging Face ``datasets`` ``.arrow`` files with an integer-list token column, read as
:class:`~streampack.io.token_block.TokenBlock` s.

One block per record batch: the list offsets and values of the token column are taken zero-copy, so a block is the
batch's value buffer with each row a ``(start, length)`` in it. A block holds only rows the per-sample reader
(:mod:`streampack.io.arrow_ipc`) turns into valid samples with nothing to report (the token column the only one it
reads, no null or empty row, within ``max_sample_bytes``, ids in range); at the first batch that is not, or that
cannot be read, the blocks end and that reader reads on from its first row. Reading costs what that reader's range
costs (the schema and one ranged read from the batch holding the range's first row, with the shard's index).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from streampack.errors import DataError
from streampack.io.arrow_ipc import ahead, batches
from streampack.io.decode import DecodeOptions
from streampack.io.formats import ShardRange
from streampack.io.limits import id_bound
from streampack.io.parquet import column_roles, int_lists
from streampack.io.parquet_block import rows_ok
from streampack.io.retry import IOStats
from streampack.io.storage import OpenOptions
from streampack.io.token_block import TokenBlock


def arrow_blocks(url: str, where: ShardRange, *, decode: DecodeOptions, opts: OpenOptions,
                 stats: IOStats | None = None, table: np.ndarray | None = None) -> Iterator[TokenBlock]:
    """One block per record batch holding rows ``[where.start, where.end)`` (see the module docstring), read from
    the batch holding ``where.start`` with the index's batch ``table``."""
    import pyarrow as pa

    start, end = where.start, where.end
    if end is not None and start >= end:
        yield TokenBlock.numbered(url, np.zeros(0, np.int64), np.zeros(1, np.int64), start, done=True)
        return
    limit, bound = decode.limits.max_sample_bytes, id_bound(decode.vocab_size)
    try:
        for row, batch, last, pending in ahead(batches(url, opts, limit, stats, table=table, start=start, end=end)):
            top = row + batch.num_rows
            if top > start:
                schema = batch.schema
                try:
                    if column_roles(schema.names, decode, url) != {"tokens": decode.tokens_key}:
                        return  # the per-sample reader reads more than the ids (or the text in a null row)
                except DataError:
                    return
                column = batch.column(schema.get_field_index(decode.tokens_key))
                if not int_lists(column.type, fixed=False) or column.null_count:
                    return
                try:
                    column.validate(full=True)
                except (pa.ArrowException, ValueError):
                    return
                if column.values.null_count:
                    return
                lo, hi = start - row if start > row else 0, batch.num_rows if end is None else min(batch.num_rows,
                                                                                                   end - row)
                offsets = column.offsets.to_numpy().astype(np.int64, copy=False)[lo:hi + 1]
                values = column.values.to_numpy()
                if not rows_ok(offsets, values, limit, bound):
                    return
                yield TokenBlock.numbered(url, values, offsets, row + lo, done=row + hi == end or (
                    end is None and last and hi == batch.num_rows))
            if (end is not None and top >= end) or pending is not None:
                return
    except DataError:
        return  # the per-sample reader meets the damage and reports it


__all__ = ["arrow_blocks"]
