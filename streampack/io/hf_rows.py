"""The rows of a ``datasets`` object's shard decoded as samples, one reader for both kinds: a ``hf-dataset://`` row range
of a ``Dataset`` (:mod:`streampack.io.hf_dataset`) and a ``hf-stream://`` shard of an ``IterableDataset``
(:mod:`streampack.io.hf_stream`) both hand out record batches of the columns read; a row is decoded as a parquet row
is (:func:`streampack.io.parquet.row_item`), each batch validated in full (``RecordBatch.validate(full=True)``) before
a value of it is decoded, so a damaged memory-mapped file is a ``DataError`` naming the shard and the row.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from streampack.io import hf_stream
from streampack.io.arrow_ipc import checked_batch
from streampack.io.decode import DecodeOptions, Item
from streampack.io.hf_dataset import source
from streampack.io.parquet import column_roles, row_item, row_values


def shard_batches(url: str, start: int, end: int | None,
                  decode: DecodeOptions) -> tuple[Iterator[tuple[int, Any, bool]], int | None]:
    """``((first row, record batch, last of the range), ...)`` of the shard's rows from ``start`` (to ``end``), only
    the columns ``decode`` reads (:func:`~streampack.io.parquet.column_roles`, whose ``missing_field`` it raises), and
    the row the range stops at when known: a ``hf-dataset://`` row range of a ``Dataset``, or a ``hf-stream://``
    shard of an ``IterableDataset`` (:mod:`streampack.io.hf_stream`)."""
    if hf_stream.is_stream_url(url):
        return hf_stream.stream_batches(url, start, end, decode), end
    held, lo, hi = source(url)
    stop = hi - lo if end is None else min(end, hi - lo)
    columns = sorted(set(column_roles(held.table.schema.names, decode, url).values()))
    return ((first - lo, batch, first - lo + batch.num_rows == stop)
            for first, batch in held.record_batches(lo + start, lo + stop, columns)), stop


def iter_dataset_items(url: str, decode: DecodeOptions, *, start: int, end: int | None) -> Iterator[Item]:
    """Decoded samples of the shard's rows ``[start, end)``; a bad row is an ``Item`` with its error."""
    batches, stop = shard_batches(url, start, end, decode)
    if stop is not None and start >= stop:
        return
    for row, batch, last in batches:
        columns = column_roles(batch.schema.names, decode, url)
        batch, error = checked_batch(batch, row, url)
        values = {field: row_values(batch.column(batch.schema.get_field_index(name)))
                  for field, name in columns.items()}
        for i in range(batch.num_rows):
            at_end = last and error is None and i + 1 == batch.num_rows
            yield row_item(values, i, row + i, url=url, at_end=at_end, opts=decode, check=True)
        if error is not None:
            raise error


__all__ = ["iter_dataset_items", "shard_batches"]
