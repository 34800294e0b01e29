"""A ``datasets.Dataset`` object's integer-list token column read as :class:`~streampack.io.token_block.TokenBlock` s.

One block per record batch of the table (at most :data:`~streampack.io.hf_dataset.READ_ROWS` rows): the list offsets
and values of the token column taken zero-copy from the table (through an indices mapping, from the rows ``take``
copied), so a block is that buffer with each row a ``(start, length)`` in it. A block holds only rows the per-sample
reader (:mod:`streampack.io.hf_dataset`) turns into valid samples with nothing to report; at the first batch that is
not, the blocks end and that reader reads on from its first row.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from streampack.errors import DataError
from streampack.io.decode import DecodeOptions
from streampack.io.hf_rows import shard_batches
from streampack.io.limits import id_bound
from streampack.io.parquet import column_roles, int_lists
from streampack.io.parquet_block import rows_ok
from streampack.io.token_block import TokenBlock


def dataset_blocks(url: str, start: int, end: int | None, *, decode: DecodeOptions) -> Iterator[TokenBlock]:
    """One block per record batch of the shard's rows ``[start, end)`` while they hold only plain token rows (the
    token column the only one read, no null or empty row, within ``max_sample_bytes``, ids in range); at the first
    that does not the blocks end and the per-sample reader reads on from there."""
    import pyarrow as pa

    try:
        batches, stop = shard_batches(url, start, end, decode)
    except DataError:
        return  # no column to read: the per-sample reader says so
    if stop is not None and start >= stop:
        yield TokenBlock.numbered(url, np.zeros(0, np.int64), np.zeros(1, np.int64), start, done=True)
        return
    limit, bound = decode.limits.max_sample_bytes, id_bound(decode.vocab_size)
    for row, batch, last in batches:
        try:
            if column_roles(batch.schema.names, decode, url) != {"tokens": decode.tokens_key}:
                return  # the per-sample reader reads more than the ids
        except DataError:
            return
        column = batch.column(batch.schema.get_field_index(decode.tokens_key))
        if not int_lists(column.type, fixed=False) or column.null_count or column.values.null_count:
            return
        try:
            column.validate(full=True)
        except (pa.ArrowException, ValueError):
            return
        offsets = column.offsets.to_numpy().astype(np.int64, copy=False)
        values = column.values.to_numpy()
        if not rows_ok(offsets, values, limit, bound):
            return
        yield TokenBlock.numbered(url, values, offsets, row, done=last)


__all__ = ["dataset_blocks"]
