"""Hugging Face ``datasets`` saved with ``save_to_disk``: each ``.arrow`` file of the directory is a shard, read with
pyarrow's IPC stream reader.

``Dataset.save_to_disk(path, num_shards=n)`` writes ``data-00000-of-0000n.arrow`` ... (Arrow IPC *stream* format:
a schema message, then record batches of ``writer_batch_size`` rows, 1,000 by default, then an end-of-stream marker),
``dataset_info.json`` and ``state.json``, whose ``_data_files`` list the ``.arrow`` files in the data set's order; a
directory given as a source expands to them in that order (:func:`data_files`). A row is a sample, its columns read as
a parquet row is (:mod:`streampack.io.parquet`: an integer-list ``tokens_key`` column, or else a ``text_key`` column,
plus optional ``labels_key`` / ``loss_mask_key`` lists); its key and its position are the row number.

**What one range costs a reader**: the file is read from byte 0 as one sequential stream (a stream file has no footer
to seek by). The record batches before row ``start`` are read but not decoded (pyarrow builds their arrays over the
bytes read, zero-copy: O(columns) CPU a batch), so resuming at row ``r`` costs reading ``bytes(rows < b)`` where ``b``
is the first row of ``r``'s batch, about ``r x bytes per row``, and O(``r / rows per batch``) CPU; the batches holding
the range are validated (``RecordBatch.validate(full=True)``) and decoded. One read holds at most
``max_sample_bytes``: a record batch whose body is larger is refused before it is allocated (``sample_too_large``).
The per-shard index (:func:`token_lengths`) is one such pass over the whole file, reading only each row's token count
from the list offsets; memory 4 bytes a row. A truncated or corrupt file is a ``DataError`` naming the file and the
first row it could not read, never the content.

A ``datasets.Dataset`` object backed by whole cache files is read as those files; any other ``Dataset`` by
:mod:`streampack.io.hf_dataset`, a streaming ``IterableDataset`` by :mod:`streampack.io.hf_stream` (docs/hf_datasets.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np

from streampack.errors import DataError
from streampack.io.decode import BAD_LENGTH, DecodeOptions, Item
from streampack.io.open import open_shard
from streampack.io.parquet import column_roles, int_lists, row_item, row_values
from streampack.io.retry import IOStats
from streampack.io.storage import OpenOptions

STATE_FILE = "state.json"
"""The file ``save_to_disk`` writes beside its ``.arrow`` files, listing them in order under ``_data_files``."""


def data_files(directory: str) -> list[str] | None:
    """The ``.arrow`` files of a ``save_to_disk`` directory in ``state.json``'s order; None when ``directory`` holds no
    ``state.json``. A ``state.json`` that does not list ``.arrow`` files inside the directory is a ``ValueError``."""
    path = os.path.join(directory, STATE_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            files = [entry["filename"] for entry in json.load(f)["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path!r} is not a datasets state.json with _data_files ({type(e).__name__})") from None
    bad = [name for name in files if not isinstance(name, str) or not name.endswith(".arrow") or os.sep in name
           or name.startswith(".")]
    if bad or not files:
        raise ValueError(f"{path!r} lists {bad[:3] if bad else 'no'} data files: want .arrow file names in "
                         f"{directory!r}")
    return [os.path.join(directory, name) for name in files]


class _Bounded:
    """A shard stream for pyarrow that refuses one read over ``limit`` bytes before it is made: pyarrow reads a
    message body in one read of its declared length, so a hostile length is never allocated."""

    def __init__(self, raw: BinaryIO, url: str, limit: int) -> None:
        self.raw, self.url, self.limit, self.row = raw, url, limit, 0
        self.closed = False

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0 or n > self.limit:
            raise DataError("sample_too_large", f"record batch from row {self.row}: a read of {n} bytes, over "
                            f"max_sample_bytes={self.limit}", url=self.url, key=str(self.row), value=n)
        return self.raw.read(n)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True
        self.raw.close()


def batches(url: str, opts: OpenOptions, limit: int, stats: IOStats | None) -> Iterator[tuple[int, Any]]:
    """``(first row, record batch)`` of every batch of the file, not yet validated; an unreadable message raises
    ``DataError("corrupt_shard")`` naming the first row it would hold."""
    import pyarrow as pa

    stream = _Bounded(open_shard(url, 0, opts=opts, stats=stats), url, limit)
    row = 0
    try:
        try:
            reader = pa.ipc.open_stream(stream)
        except (pa.ArrowException, OSError) as e:
            raise DataError("corrupt_shard", f"row 0: no readable Arrow IPC stream schema before it ({type(e).__name__})", url=url, key="0",
                            value=0) from None
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                return
            except (pa.ArrowException, OSError) as e:
                # pyarrow's message may quote the bytes it met: name the failure only
                raise DataError("corrupt_shard", f"row {row}: cannot read the record batch from it "
                                f"({type(e).__name__}): truncated or corrupt file", url=url, key=str(row),
                                value=row) from None
            yield row, batch
            row += batch.num_rows
            stream.row = row
    finally:
        stream.close()


def _checked(batch: Any, row: int, url: str) -> tuple[Any, DataError | None]:
    """``batch`` cut before its first row that fails pyarrow's full validation, and that row's error (or None)."""
    import pyarrow as pa

    try:
        batch.validate(full=True)
        return batch, None
    except (pa.ArrowException, ValueError):
        pass
    for i in range(batch.num_rows):
        try:
            batch.slice(i, 1).validate(full=True)
        except (pa.ArrowException, ValueError) as e:
            return batch.slice(0, i), DataError("corrupt_shard", f"row {row + i}: fails validation "
                                                f"({type(e).__name__})", url=url, key=str(row + i), value=row + i)
    return batch, DataError("corrupt_shard", f"record batch from row {row}: fails validation", url=url, key=str(row),
                            value=row)


def token_lengths(url: str, decode: DecodeOptions, opts: OpenOptions,
                  stats: IOStats | None = None) -> tuple[np.ndarray, str]:
    """``(lengths, damage)``: int32 ``[rows]`` each readable row's token count as the reader sees it (-1 where only a
    tokenizer knows, :data:`~streampack.io.decode.BAD_LENGTH` where the reader refuses the row), and why the file
    ends early ("" when whole). One pass over the file reading only the token column's list offsets."""
    import pyarrow as pa
    import pyarrow.compute as pc

    key, limit = decode.tokens_key, decode.limits.max_sample_bytes
    out: list[np.ndarray] = []
    damage = ""
    try:
        for _, batch in batches(url, opts, limit, stats):
            schema = batch.schema
            kind = schema.field(key).type if key in schema.names else None
            if kind is None or not int_lists(kind):
                out.append(np.full(batch.num_rows, -1, np.int32))
                continue
            null = -1 if decode.text_key and decode.text_key in schema.names else BAD_LENGTH
            column = batch.column(schema.get_field_index(key))
            column.validate(full=True)
            lengths = pc.list_value_length(column).fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
            lengths[lengths < 0] = null
            lengths[lengths * (kind.value_type.bit_width // 8) > limit] = BAD_LENGTH
            out.append(lengths.astype(np.int32))
    except DataError as e:
        damage = str(e)
    except (pa.ArrowException, ValueError) as e:  # a token column that fails validation: the reader names the row
        damage = f"corrupt_shard: a record batch fails validation ({type(e).__name__})"
    return (np.concatenate(out) if out else np.zeros(0, np.int32)), damage


def ahead(batches: Iterator[tuple[int, Any]]) -> Iterator[tuple[int, Any, bool, DataError | None]]:
    """``(first row, batch, last, error)``: each batch with whether it is the file's last, read one batch ahead; the
    error of the batch after it (truncated, corrupt) comes with it, so every good row before the damage is
    delivered first."""
    held = next(batches, None)
    while held is not None:
        try:
            after, error = next(batches, None), None
        except DataError as e:
            after, error = None, e
        yield held[0], held[1], after is None and error is None, error
        held = after


def iter_arrow_items(url: str, decode: DecodeOptions, *, opts: OpenOptions, start: int, end: int | None,
                     stats: IOStats | None = None) -> Iterator[Item]:
    """Decoded samples of rows ``[start, end)``; a bad row (no usable column, an id out of range, over
    ``max_sample_bytes``) is an ``Item`` with its error; a truncated or corrupt file raises ``DataError`` naming the
    first row it cannot read."""
    if end is not None and start >= end:
        return
    total = 0
    for row, batch, last, pending in ahead(batches(url, opts, decode.limits.max_sample_bytes, stats)):
        total = row + batch.num_rows
        if total > start:
            batch, error = _checked(batch, row, url)
            columns = column_roles(batch.schema.names, decode, url)
            values = {field: row_values(batch.column(batch.schema.get_field_index(name)))
                      for field, name in columns.items()}
            stop = batch.num_rows if end is None else min(batch.num_rows, end - row)
            for i in range(max(start - row, 0), stop):
                at_end = row + i + 1 == end or (end is None and last and error is None and i + 1 == batch.num_rows)
                yield row_item(values, i, row + i, url=url, at_end=at_end, opts=decode, check=True)
            if error is not None:
                raise error
        if end is not None and total >= end:
            return
        if pending is not None:
            raise pending
    if end is not None and total < end:
        raise DataError("corrupt_shard", f"row {total}: the file ends there, its index says it holds {end} rows: "
                        f"truncated file", url=url, key=str(total), value=total)


__all__ = ["STATE_FILE", "ahead", "batches", "data_files", "iter_arrow_items", "token_lengths"]
