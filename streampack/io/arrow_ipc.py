"""Hugging Face ``datasets`` saved with ``save_to_disk``: each ``.arrow`` file of the directory is a shard, read with
pyarrow's IPC stream reader.

``Dataset.save_to_disk(path, num_shards=n)`` writes ``data-00000-of-0000n.arrow`` ... (Arrow IPC *stream* format:
a schema message, then record batches of ``writer_batch_size`` rows, 1,000 by default, then an end-of-stream marker),
``dataset_info.json`` and ``state.json``, whose ``_data_files`` list the ``.arrow`` files in the data set's order; a
directory given as a source expands to them in that order (:func:`data_files`). A row is a sample, its columns read as
a parquet row is (:mod:`streampack.io.parquet`: an integer-list ``tokens_key`` column, or else a ``text_key`` column,
plus optional ``labels_key`` / ``loss_mask_key`` lists); its key and its position are the row number.

**What one range costs a reader**: with the shard index (:func:`index_scan` records each record batch's byte offset
and first row, :data:`BATCH_DTYPE`), a range from row ``r > 0`` is two ranged reads, the schema message and the file
from the batch holding ``r`` to the batch after the one holding its last row: ``schema + bytes(those batches)``, under two
batches more than the rows delivered (under one for a range to the end), whatever ``r`` is. Without it (a whole file read alone, a schema with
dictionary fields) the file is read from byte 0 as one sequential stream (a stream file has no footer to seek by): the
batches before the range are read but not decoded (pyarrow builds their arrays over the bytes read, zero-copy:
O(columns) CPU a batch), about ``r x bytes per row``. The batches holding the range are validated
(``RecordBatch.validate(full=True)``) and decoded. One read holds at most ``max_sample_bytes``: a record batch whose body
is larger is refused before it is allocated (``sample_too_large``). The per-shard index is one pass over the whole
file, reading only each row's token count from the list offsets; memory 4 bytes a row and 16 a batch. A truncated or
corrupt file is a ``DataError`` naming the file and the first row it could not read, never the content.

A ``datasets.Dataset`` object backed by whole cache files is read as those files; any other ``Dataset`` by
:mod:`streampack.io.hf_dataset`, a streaming ``IterableDataset`` by :mod:`streampack.io.hf_stream` (docs/hf_datasets.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from streampack.errors import DataError
from streampack.io.decode import BAD_LENGTH, DecodeOptions, Item
from streampack.io.open import open_shard, read_range
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


BATCH_DTYPE = np.dtype([("offset", "<i8"), ("row", "<i8")])
"""One record batch of a stream file, as the shard index keeps it: the byte offset of its message and its first row
(a batch's message holds no reference to an earlier one but a dictionary: a file with dictionary fields gets none)."""


class _Bounded:
    """A shard stream for pyarrow that refuses one read over ``limit`` bytes before it is made: pyarrow reads a
    message body in one read of its declared length, so a hostile length is never allocated. ``pos`` counts the
    bytes read: pyarrow reads a message exactly (prefix, metadata, body), so between batches it is where the next
    message starts."""

    def __init__(self, raw: BinaryIO, url: str, limit: int, *, row: int = 0, pos: int = 0) -> None:
        self.raw, self.url, self.limit, self.row, self.pos = raw, url, limit, row, pos
        self.closed = False

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0 or n > self.limit:
            raise DataError("sample_too_large", f"record batch from row {self.row}: a read of {n} bytes, over "
                            f"max_sample_bytes={self.limit}", url=self.url, key=str(self.row), value=n)
        data = self.raw.read(n)
        self.pos += len(data)
        return data

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True
        self.raw.close()


class _Spliced:
    """The schema's bytes, then the file from a record batch on: a stream pyarrow reads as the file without the
    batches before that one."""

    def __init__(self, head: bytes, tail: BinaryIO) -> None:
        self.head, self.at, self.tail = head, 0, tail

    def read(self, n: int) -> bytes:
        out = self.head[self.at:self.at + n]
        self.at += len(out)
        while len(out) < n:
            more = self.tail.read(n - len(out))
            if not more:
                break
            out += more
        return out

    def close(self) -> None:
        self.tail.close()


def _opened(url: str, opts: OpenOptions, limit: int, stats: IOStats | None, table: np.ndarray | None, start: int,
            end: int | None) -> _Bounded:
    """The file for rows ``[start, end)``: from byte 0, or with ``table`` (the index's :data:`BATCH_DTYPE` rows) the
    schema's bytes and one ranged read from the batch holding row ``start`` to the batch after the one holding row
    ``end - 1`` (the file's end when ``end`` is None or in the last batch)."""
    if table is None or not len(table) or start <= int(table["row"][0]):
        return _Bounded(open_shard(url, 0, opts=opts, stats=stats), url, limit)
    at = int(np.searchsorted(table["row"], start, side="right")) - 1
    after = len(table) if end is None else int(np.searchsorted(table["row"], end, side="left"))
    stop = int(table["offset"][after]) if after < len(table) else None
    head = read_range(url, 0, int(table["offset"][0]), opts, stats)
    tail = open_shard(url, int(table["offset"][at]), stop, opts=opts, stats=stats)
    return _Bounded(_Spliced(head, tail), url, limit, row=int(table["row"][at]),  # type: ignore[arg-type]
                    pos=int(table["offset"][at]) - len(head))


def batches(url: str, opts: OpenOptions, limit: int, stats: IOStats | None, *, table: np.ndarray | None = None,
            start: int = 0, end: int | None = None, offsets: list[int] | None = None) -> Iterator[tuple[int, Any]]:
    """``(first row, record batch)`` of every batch of the file, not yet validated (with the index's ``table``,
    from the batch holding row ``start`` up to the one holding row ``end - 1``: :func:`_opened`); an unreadable
    message raises ``DataError("corrupt_shard")`` naming the first row it would hold. ``offsets`` gets the byte
    offset of each batch's message (what the index records)."""
    import pyarrow as pa

    stream = _opened(url, opts, limit, stats, table, start, end)
    row = stream.row
    try:
        try:
            reader = pa.ipc.open_stream(stream)
        except (pa.ArrowException, OSError) as e:
            raise DataError("corrupt_shard", f"row 0: no readable Arrow IPC stream schema before it ({type(e).__name__})", url=url, key="0",
                            value=0) from None
        while True:
            at = stream.pos
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                return
            except (pa.ArrowException, OSError) as e:
                # pyarrow's message may quote the bytes it met: name the failure only
                raise DataError("corrupt_shard", f"row {row}: cannot read the record batch from it "
                                f"({type(e).__name__}): truncated or corrupt file", url=url, key=str(row),
                                value=row) from None
            if offsets is not None:
                offsets.append(at)
            yield row, batch
            row += batch.num_rows
            stream.row = row
    finally:
        stream.close()


def checked_batch(batch: Any, row: int, url: str) -> tuple[Any, DataError | None]:
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


@dataclass(frozen=True, slots=True, kw_only=True)
class ArrowScan:
    """What indexing one ``.arrow`` file finds."""

    lengths: np.ndarray
    """int32 ``[rows]``: each readable row's token count as the reader sees it (-1 where only a tokenizer knows,
    :data:`~streampack.io.decode.BAD_LENGTH` where the reader refuses the row)."""
    damage: str
    """Why the file ends early ("" when whole)."""
    batches: np.ndarray | None
    """:data:`BATCH_DTYPE` ``[batches]``: where each readable record batch starts (None for a file whose schema has
    dictionary fields: read from byte 0)."""


def index_scan(url: str, decode: DecodeOptions, opts: OpenOptions, stats: IOStats | None = None) -> ArrowScan:
    """One pass over the file reading only the token column's list offsets, and each batch's byte offset."""
    import pyarrow as pa
    import pyarrow.compute as pc

    key, limit = decode.tokens_key, decode.limits.max_sample_bytes
    out: list[np.ndarray] = []
    rows: list[int] = []
    offsets: list[int] = []
    damage, dictionaries = "", False
    try:
        for row, batch in batches(url, opts, limit, stats, offsets=offsets):
            rows.append(row)
            schema = batch.schema
            dictionaries = dictionaries or any(pa.types.is_dictionary(f.type) for f in schema)
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
    table = np.zeros(len(out), BATCH_DTYPE)
    table["offset"], table["row"] = offsets[:len(out)], rows[:len(out)]
    return ArrowScan(lengths=np.concatenate(out) if out else np.zeros(0, np.int32), damage=damage,
                     batches=None if dictionaries else table)


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
                     stats: IOStats | None = None, table: np.ndarray | None = None) -> Iterator[Item]:
    """Decoded samples of rows ``[start, end)`` (read from the batch holding ``start`` with the index's ``table``);
    a bad row (no usable column, an id out of range, over ``max_sample_bytes``) is an ``Item`` with its error; a
    truncated or corrupt file raises ``DataError`` naming the first row it cannot read."""
    if end is not None and start >= end:
        return
    total = 0
    read = batches(url, opts, decode.limits.max_sample_bytes, stats, table=table, start=start, end=end)
    for row, batch, last, pending in ahead(read):
        total = row + batch.num_rows
        if total > start:
            batch, error = checked_batch(batch, row, url)
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


__all__ = ["BATCH_DTYPE", "STATE_FILE", "ArrowScan", "ahead", "batches", "data_files", "index_scan", "iter_arrow_items"]
