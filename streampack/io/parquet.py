"""Parquet shards (FineWeb, DCLM, The Stack, every Hugging Face dataset's parquet export) via pyarrow.

A row is a sample: a token-id list column named ``tokens_key`` (any integer list type), or else
a text column named ``text_key`` (string or UTF-8 binary), plus optional ``labels_key`` /
``loss_mask_key`` list columns; each row goes through :func:`~streampack.io.decode.make_sample`
like a jsonl line. The sample key is the row number, and so is the position: a shard range
is a row range, so resuming at row ``r`` opens row group ``g`` (from the footer's row counts)
and skips ``r - first_row(g)`` rows of that group only; earlier row groups are never read.
The index of a parquet file is its footer's row counts (no scan).

Only the needed columns are read; pyarrow decodes one row group's column chunks at a time, so
memory follows the file's row group size (typically 64-256 MB uncompressed), read in batches of
:data:`BATCH_ROWS` rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np

from streampack.errors import DataError
from streampack.io.decode import DecodeOptions, Item, make_sample

BATCH_ROWS = 256


def _parquet_file(f: BinaryIO, url: str) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as e:
        raise DataError("corrupt_shard", f"not a readable parquet file: {e}", url=url, value=0) from None


def row_counts(f: BinaryIO, url: str) -> np.ndarray:
    """int64 ``[num_row_groups]``: rows per row group, from the footer only."""
    md = _parquet_file(f, url).metadata
    return np.array([md.row_group(i).num_rows for i in range(md.num_row_groups)], dtype=np.int64)


def _columns(schema_names: list[str], opts: DecodeOptions, url: str) -> dict[str, str]:
    """Which column holds what: ``{"tokens", "text", "labels", "loss_mask"} -> column`` (those
    present; token ids win over text in a row that has both, as in jsonl)."""
    wanted = {"tokens": opts.tokens_key, "text": opts.text_key, "labels": opts.labels_key,
              "loss_mask": opts.loss_mask_key}
    out = {field: key for field, key in wanted.items() if key and key in schema_names}
    if "tokens" not in out and "text" not in out:
        raise DataError("missing_field", f"no column {opts.tokens_key!r} or {opts.text_key!r} "
                        f"(columns: {schema_names[:20]})", url=url, value=schema_names[:20])
    return out


def check_schema(f: BinaryIO, opts: DecodeOptions, url: str) -> None:
    """Refuse a shard whose footer already says no row can decode: no tokens/text column, a
    token column that is not a list of integers, or (without one) a text column that is not
    string/binary. Reads the footer only (one ranged request remotely, ~1 ms locally)."""
    import pyarrow as pa

    schema = _parquet_file(f, url).schema_arrow
    columns = _columns(schema.names, opts, url)
    if "tokens" in columns:
        kind = schema.field(columns["tokens"]).type
        lists = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
        if not (lists and pa.types.is_integer(kind.value_type)):
            raise DataError("bad_dtype", f"token column {columns['tokens']!r} has type {kind}, want a list of "
                            f"integers", url=url, value=str(kind))
    else:
        kind = schema.field(columns["text"]).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
                or pa.types.is_large_binary(kind)):
            raise DataError("bad_dtype", f"text column {columns['text']!r} has type {kind}, want string (or "
                            f"UTF-8 binary); set text_key= / tokens_key= to the right column", url=url, value=str(kind))


def _rows(column: Any) -> list[Any]:
    """A column's values per row: numpy slices of the flat values for integer lists (no Python
    object per token), Python values otherwise; None for null rows."""
    import pyarrow as pa

    kind = column.type
    if (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_integer(kind.value_type):
        flat = column.flatten()
        if flat.null_count == 0:
            values = flat.to_numpy()
            lengths = column.value_lengths().fill_null(0).to_numpy(zero_copy_only=False)
            ends = np.cumsum(lengths)
            starts = ends - lengths
            valid = column.is_valid().to_numpy(zero_copy_only=False)
            return [values[s:e] if ok else None for s, e, ok in zip(starts.tolist(), ends.tolist(), valid.tolist())]
    return column.to_pylist()


def iter_parquet_items(f: BinaryIO, opts: DecodeOptions, *, url: str, start: int, end: int | None) -> Iterator[Item]:
    """Decoded samples of rows ``[start, end)`` (to the last row when ``end`` is None); a bad
    row becomes an ``Item`` with ``error`` set; an unreadable file or page raises
    ``DataError("corrupt_shard")``."""
    import pyarrow as pa

    pf = _parquet_file(f, url)
    counts = np.array([pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups)], np.int64)
    firsts = np.concatenate([[0], np.cumsum(counts)])
    stop = int(firsts[-1]) if end is None else min(end, int(firsts[-1]))
    if start >= stop:
        return
    columns = _columns(pf.schema_arrow.names, opts, url)
    group = int(np.searchsorted(firsts, start, side="right") - 1)
    last = int(np.searchsorted(firsts, stop, side="left"))  # first group not needed
    row = int(firsts[group])
    try:
        batches = pf.iter_batches(batch_size=BATCH_ROWS, row_groups=list(range(group, last)),
                                  columns=sorted(set(columns.values())), use_threads=False)
        for batch in batches:
            if row + batch.num_rows <= start:
                row += batch.num_rows
                continue
            values = {field: _rows(batch.column(name)) for field, name in columns.items()}
            for i in range(batch.num_rows):
                if row >= stop:
                    return
                if row >= start:
                    yield _item(values, i, row, url=url, at_end=row + 1 == stop, vocab_size=opts.vocab_size)
                row += 1
    except (pa.ArrowException, OSError) as e:
        raise DataError("corrupt_shard", f"cannot read row {row}: {e}", url=url, key=str(row), value=row) from None


def _item(values: dict[str, list[Any]], i: int, row: int, *, url: str, at_end: bool,
          vocab_size: int | None) -> Item:
    key = str(row)
    field = {name: column[i] for name, column in values.items()}
    try:
        tokens = field.get("tokens")
        sample = make_sample(url=url, key=key, tokens=tokens, text=None if tokens is not None else field.get("text"),
                             labels=field.get("labels"), loss_mask=field.get("loss_mask"), vocab_size=vocab_size)
        return Item(sample, None, row + 1, row + 1, at_end)
    except DataError as e:
        return Item(None, e, row + 1, row + 1, at_end)


__all__ = ["BATCH_ROWS", "check_schema", "iter_parquet_items", "row_counts"]
