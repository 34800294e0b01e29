"""Parquet shards (FineWeb, DCLM, every Hugging Face dataset's parquet export) via pyarrow.

A row is a sample: an integer-list column ``tokens_key``, or else a text column ``text_key``, plus
optional ``labels_key`` / ``loss_mask_key`` lists, each row validated like a jsonl line. The key
and the position are the row number: resuming at row ``r`` opens its row group and skips rows of
that group only. The index is the footer's rows and each row's token count (:func:`token_lengths`).

Only the needed columns are read, a row group at a time, in batches of at most :data:`BATCH_ROWS`.
``Limits.max_sample_bytes`` is checked from the footer before decoding (a row group whose rows average more is refused
unread; measured in docs/reliability.md), then row by row. A batch that fails is re-read one row at a time, so damage is
located to the row.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np

from streampack.errors import DataError
from streampack.io.decode import BAD_LENGTH, CHAT_FIELDS, DecodeOptions, Item, chat_fields, make_sample

BATCH_ROWS = 256


def parquet_file(f: BinaryIO, url: str) -> Any:
    """``pyarrow.parquet.ParquetFile`` of ``f`` (its footer read); ``DataError("corrupt_shard")`` when unreadable."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as e:
        raise DataError("corrupt_shard", f"not a readable parquet file: {e}", url=url, value=0) from None


def group_firsts(md: Any) -> list[int]:
    """The first row of each row group of the footer ``md``, then the row count."""
    counts = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()


def int_lists(kind: Any, *, fixed: bool = True) -> bool:
    """Whether the arrow type ``kind`` is a list of integers (``fixed``: fixed-size lists count)."""
    import pyarrow as pa

    lists = pa.types.is_list(kind) or pa.types.is_large_list(kind) or (fixed and pa.types.is_fixed_size_list(kind))
    return lists and pa.types.is_integer(kind.value_type)


def token_lengths(f: BinaryIO, opts: DecodeOptions, url: str) -> np.ndarray:
    """int32 ``[rows]``: each row's token count as the reader will see it, for an index; -1 where not
    known before tokenizing, :data:`~streampack.io.decode.BAD_LENGTH` where the reader refuses the row.
    pyarrow has no levels-only read, so the token column is decoded, a row group at a time (20,000
    rows x ~600 ids: 1.7 s, the footer alone 1 ms, ``benchmarks/bench_index.py parquet``): paid once
    per shard by ``streampack index``; a reader that only splits a shard keeps the footer-only index."""
    import pyarrow.compute as pc

    pf = parquet_file(f, url)
    md, schema = pf.metadata, pf.schema_arrow
    key = opts.tokens_key
    kind = schema.field(key).type if key in schema.names else None
    if kind is None or not int_lists(kind):
        return np.full(md.num_rows, -1, np.int32)  # text to tokenize (or no usable column: the reader says why)
    null = -1 if opts.text_key and opts.text_key in schema.names else BAD_LENGTH
    width, limit = kind.value_type.bit_width // 8, opts.limits.max_sample_bytes
    out = []
    for g in range(md.num_row_groups):
        rows = md.row_group(g).num_rows
        per_row = _decoded_bytes(md.row_group(g), [key]) // max(1, rows)
        if per_row > limit:  # the reader refuses the whole group unread: so does the plan
            out.append(np.full(rows, BAD_LENGTH, np.int32))
            continue
        for batch in pf.iter_batches(batch_size=max(1, min(65_536, limit // max(1, per_row))), row_groups=[g],
                                     columns=[key], use_threads=False):
            lengths = pc.list_value_length(batch.column(0)).fill_null(-1).to_numpy(zero_copy_only=False)
            lengths = lengths.astype(np.int64)
            lengths[lengths < 0] = null
            lengths[lengths * width > limit] = BAD_LENGTH  # a row over the limit is refused (sample_too_large)
            out.append(lengths.astype(np.int32))
    return np.concatenate(out) if out else np.zeros(0, np.int32)


def column_roles(schema_names: list[str], opts: DecodeOptions, url: str) -> dict[str, str]:
    """Which column holds what: ``{"tokens", "text", "labels", "loss_mask"} -> column`` (those
    present; token ids win over text in a row that has both, as in jsonl)."""
    wanted = {"tokens": opts.tokens_key, "text": opts.text_key, "labels": opts.labels_key,
              "loss_mask": opts.loss_mask_key}
    if opts.media is not None:
        wanted.update(opts.media.columns())  # images, and videos when read
    wanted.update({name: name for name in CHAT_FIELDS})  # a chat record's own columns
    out = {field: key for field, key in wanted.items() if key and key in schema_names}
    if "tokens" not in out and "text" not in out and chat_fields(out) is None:
        raise DataError("missing_field", f"no column {opts.tokens_key!r} or {opts.text_key!r} "
                        f"(columns: {schema_names[:20]})", url=url, value=schema_names[:20])
    return out


def check_schema(f: BinaryIO, opts: DecodeOptions, url: str) -> None:
    """Refuse a shard whose footer already says no row can decode (no tokens / text column, or one of
    the wrong type); reads the footer only."""
    import pyarrow as pa

    schema = parquet_file(f, url).schema_arrow
    columns = column_roles(schema.names, opts, url)
    if "tokens" in columns:
        kind = schema.field(columns["tokens"]).type
        if not int_lists(kind):
            raise DataError("bad_dtype", f"token column {columns['tokens']!r} has type {kind}, want a list of "
                            f"integers", url=url, value=str(kind))
    elif "text" in columns:
        kind = schema.field(columns["text"]).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
                or pa.types.is_large_binary(kind)):
            raise DataError("bad_dtype", f"text column {columns['text']!r} has type {kind}, want string (or "
                            f"UTF-8 binary); set text_key= / tokens_key= to the right column", url=url, value=str(kind))


def row_values(column: Any) -> list[Any]:
    """A column's values per row: numpy slices of the flat values for integer lists (no Python
    object per token), Python values otherwise; None for null rows."""
    if int_lists(column.type, fixed=False):
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
    """Decoded samples of rows ``[start, end)``; a bad row (or row group over the limits) becomes an
    ``Item`` with ``error`` set; an unreadable page raises ``DataError("corrupt_shard")`` naming its first row."""
    pf = parquet_file(f, url)
    md = pf.metadata
    firsts = group_firsts(md)
    stop = firsts[-1] if end is None else min(end, firsts[-1])
    if start >= stop:
        return
    columns = column_roles(pf.schema_arrow.names, opts, url)
    names = sorted(set(columns.values()))
    limit = opts.limits.max_sample_bytes
    first_group = int(np.searchsorted(firsts, start, side="right") - 1)
    # consecutive row groups with the same plan are read by one iter_batches: one call per group
    # cost ~1 ms a group (20k rows in groups of 16: 2.0 s vs 0.9 s); a run reads at parity
    run: list[int] = []
    plan: tuple[int, bool] = (BATCH_ROWS, False)
    for g in range(first_group, int(np.searchsorted(firsts, stop, side="left"))):
        total = _decoded_bytes(md.row_group(g), names)
        per_row = total // max(1, firsts[g + 1] - firsts[g])
        if per_row > limit:
            if run:
                yield from _run_items(pf, run, firsts, start, stop, *plan, columns, opts, url=url)
                run, plan = [], None
            lo, hi = max(start, firsts[g]), min(stop, firsts[g + 1])
            err = DataError("sample_too_large", f"row group {g} (rows {firsts[g]}..{firsts[g + 1] - 1}) decodes to "
                            f"~{per_row} bytes per row, over max_sample_bytes={limit}; not read",
                            url=url, key=str(lo), value=per_row)
            yield Item(None, err, hi, hi, hi == stop)
            continue
        # a batch holds ~max_sample_bytes; rows are checked one by one only where one could be over
        this = (max(1, min(BATCH_ROWS, limit // max(1, per_row))), total > limit)
        if run and this != plan:
            yield from _run_items(pf, run, firsts, start, stop, *plan, columns, opts, url=url)
            run = []
        run.append(g)
        plan = this
    if run:
        yield from _run_items(pf, run, firsts, start, stop, *plan, columns, opts, url=url)


def _decoded_bytes(group: Any, names: list[str]) -> int:
    """What the columns ``names`` of a row group decode to, at least (footer only)."""
    total = 0
    for i in range(group.num_columns):
        col = group.column(i)
        if col.path_in_schema.split(".", 1)[0] in names:
            width = 4 if col.physical_type == "BYTE_ARRAY" else 8  # an offset per string; ids become int64
            total += max(col.num_values * width, col.total_uncompressed_size)
    return total


def _run_items(pf: Any, groups: list[int], firsts: list[int], start: int, stop: int, rows: int, check: bool,
               columns: dict[str, str], opts: DecodeOptions, *, url: str) -> Iterator[Item]:
    """Rows ``[start, stop)`` that lie in the consecutive row ``groups``, in batches of ``rows``;
    ``check``: measure each row against ``max_sample_bytes``."""
    import pyarrow as pa

    row = firsts[groups[0]]
    lo, hi = max(start, row), min(stop, firsts[groups[-1] + 1])
    try:
        for batch in pf.iter_batches(batch_size=rows, row_groups=groups, columns=sorted(set(columns.values())),
                                     use_threads=False):
            if row + batch.num_rows <= lo:
                row += batch.num_rows
                continue
            values = {field: row_values(batch.column(name)) for field, name in columns.items()}
            for i in range(batch.num_rows):
                if row >= hi:
                    return
                if row >= lo:
                    yield row_item(values, i, row, url=url, at_end=row + 1 == stop, opts=opts, check=check)
                row += 1
    except (pa.ArrowException, OSError) as e:
        group = int(np.searchsorted(firsts, row, side="right") - 1)
        if rows > 1:  # find the bad row (from its batch's row group on): every good row before it is delivered
            rest = groups[groups.index(group):]
            yield from _run_items(pf, rest, firsts, max(lo, row), stop, 1, check, columns, opts, url=url)
            raise AssertionError(f"row groups {rest} of {url!r} failed in a batch but not row by row") from e
        raise DataError("corrupt_shard", f"cannot read row {row} (row group {group}): {e}", url=url, key=str(row),
                        value=row) from None


def row_item(values: dict[str, list[Any]], i: int, row: int, *, url: str, at_end: bool, opts: DecodeOptions,
          check: bool) -> Item:
    key = str(row)
    field = {name: column[i] for name, column in values.items()}
    try:
        size = sum(_nbytes(v) for v in field.values()) if check else 0
        if size > opts.limits.max_sample_bytes:
            raise DataError("sample_too_large", f"row of {size} bytes, over max_sample_bytes="
                            f"{opts.limits.max_sample_bytes}", url=url, key=key, value=size)
        tokens = field.get("tokens")
        images = () if opts.media is None else opts.media.column_media(field, opts.limits, url=url, key=key)
        sample = make_sample(url=url, key=key, tokens=tokens, text=None if tokens is not None else field.get("text"),
                             labels=field.get("labels"), loss_mask=field.get("loss_mask"), vocab_size=opts.vocab_size,
                             images=images, chat=chat_fields(field))
        return Item(sample, None, row + 1, row + 1, at_end)
    except DataError as e:
        return Item(None, e, row + 1, row + 1, at_end)


def _nbytes(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, list):
        return 8 * len(value)
    return len(value) if isinstance(value, (str, bytes)) else 0


__all__ = ["BATCH_ROWS", "check_schema", "column_roles", "group_firsts", "int_lists", "iter_parquet_items",
           "parquet_file", "row_item", "row_values", "token_lengths"]
