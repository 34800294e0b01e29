"""A Hugging Face ``datasets.Dataset`` object as a source: its rows read where the object holds them.

:func:`shards_of` turns the object into shard URLs once, in the process that builds the ``PackedDataset``:

- **backed by whole cache files** (``load_from_disk``, ``load_dataset`` from the Hub cache, ``map`` with a cache file),
  no indices mapping: its ``.arrow`` files themselves, in the table's order, read by :mod:`streampack.io.arrow_ipc` as
  a ``save_to_disk`` directory is (nothing registered: a spawned worker needs only the paths);
- **anything else** (``from_dict`` / ``from_list``, ``map`` without a cache, a slice of a file, and every dataset with
  an indices mapping after ``shuffle`` / ``select`` / ``filter`` / ``train_test_split``): shards of
  :data:`ROWS_PER_SHARD` consecutive *dataset* rows, ``hf-dataset://<_fingerprint>/rows-<lo>-<hi>``, whose row ``k``
  is ``ds[lo + k]`` (through the indices mapping when there is one). The object is kept in a per-process registry
  by its fingerprint (:class:`Held`); the URL names the fingerprint, so a state saved on another dataset does not
  match these sources and is refused.

A dataset with a transform applied on read (``set_transform``) is refused: ``ds[i]`` is not the table's row.

A row is decoded as a parquet row is (:func:`streampack.io.parquet.row_item`: an integer-list ``tokens_key`` column,
or else a ``text_key`` column to tokenize, plus optional ``labels_key`` / ``loss_mask_key`` lists); its key and
position are its row number in its shard. Only the columns read are touched, a record batch of at most
:data:`READ_ROWS` rows at a time.

**What one reader costs** (no request, nothing written but the shard indexes of a finite plan): a range of ``n`` rows
is ``n / READ_ROWS`` zero-copy slices of the table (through a mapping: ``take`` copies the ``n`` rows' columns read,
O(their bytes)) and the validation of what is delivered, O(its bytes); rows are never turned into Python lists beyond
those delivered. The index of a shard (its token counts) is the token column's list offsets, computed once per process
over the whole table (4 bytes a row) and indexed through the mapping. Memory: the mapping as int64 (8 bytes a row of
``ds``) and the object itself (an in-memory table is held once per process; forked DataLoader workers share its pages, spawned ones unpickle a copy of it: the table's
bytes, while a memory-mapped one pickles as its file paths).
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from streampack.errors import DataError
from streampack.io import storage
from streampack.io.decode import BAD_LENGTH, DecodeOptions
from streampack.io.parquet import int_lists
from streampack.io.storage import ShardStat

SCHEME = "hf-dataset://"
ROWS_PER_SHARD = 1 << 16
"""Rows of a shard: the unit of the epoch's shard order and of an index. 65,536 rows keep a 10^9-row table at 15,259
shards (within the 10^5 a manifest plans); a smaller data set is one shard, split between readers by row."""
READ_ROWS = 1024
"""Rows taken from the table at once: what a reader holds beyond the table (a ``take`` through a mapping copies it)."""


class Registry:
    """The ``datasets`` objects of this process by name, held weakly (an object lives as long as a ``PackedDataset`` or
    reader keeps it). Several live objects may share a name (the same data, e.g. the dataset given twice); any of
    them serves, so one going away never orphans the others' URLs."""

    def __init__(self) -> None:
        self._held: dict[str, weakref.WeakSet[Any]] = {}
        self._lock = threading.Lock()

    def add(self, name: str, obj: Any) -> None:
        with self._lock:
            self._held.setdefault(name, weakref.WeakSet()).add(obj)

    def get(self, name: str) -> Any:
        with self._lock:
            return next(iter(self._held.get(name, ())), None)


_REGISTRY = Registry()


def is_dataset(obj: Any) -> bool:
    """Whether ``obj`` is a ``datasets.Dataset`` (without importing ``datasets`` when nothing did)."""
    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(obj, datasets.Dataset)


def is_source_object(obj: Any) -> bool:
    """Whether ``obj`` is a ``datasets.Dataset`` or ``IterableDataset`` (read by :func:`shards_of` or
    :func:`streampack.io.hf_stream.shards_of`)."""
    return is_dataset(obj) or is_streaming(obj)


def is_streaming(obj: Any) -> bool:
    """Whether ``obj`` is a streaming ``datasets.IterableDataset``."""
    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(obj, datasets.IterableDataset)


class Held:
    """A ``datasets.Dataset`` registered in this process under its fingerprint, for the readers of its shard URLs.
    It pickles as the dataset (``datasets`` pickles a memory-mapped table as its paths, an in-memory one as its
    bytes), and unpickling registers it again: a spawned DataLoader worker reads the copy it received."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds
        self.fingerprint: str = ds._fingerprint
        self.table = ds._data.table
        self.indices: np.ndarray | None = (None if ds._indices is None else
                                           ds._indices.column(0).to_numpy().astype(np.int64, copy=False))
        self.rows = len(ds)
        self._lengths: dict[tuple[str, str, int], np.ndarray] = {}
        _REGISTRY.add(self.fingerprint, self)

    def __reduce__(self) -> tuple[Any, ...]:
        return Held, (self.ds,)

    def record_batches(self, lo: int, hi: int, columns: list[str]) -> Iterator[tuple[int, Any]]:
        """``(first dataset row, record batch)`` of dataset rows ``[lo, hi)``, only ``columns``."""
        table = self.table.select(columns)  # zero-copy: only the columns read are touched
        for a in range(lo, hi, READ_ROWS):
            b = min(a + READ_ROWS, hi)
            part = table.slice(a, b - a) if self.indices is None else table.take(self.indices[a:b])
            for batch in part.to_batches():
                yield a, batch
                a += batch.num_rows

    def lengths(self, decode: DecodeOptions) -> np.ndarray:
        """int32 ``[rows]`` of the dataset (through the mapping): each row's token count as the reader sees it, -1
        where only a tokenizer knows, :data:`~streampack.io.decode.BAD_LENGTH` where the reader refuses the row.
        Made once per process and setting from the token column's list offsets."""
        import pyarrow.compute as pc

        key, limit = decode.tokens_key, decode.limits.max_sample_bytes
        memo = (key, decode.text_key, limit)
        if memo in self._lengths:
            return self._lengths[memo]
        schema = self.table.schema
        kind = schema.field(key).type if key in schema.names else None
        if kind is None or not int_lists(kind):
            out = np.full(self.rows, -1, np.int32)
        else:
            null = -1 if decode.text_key and decode.text_key in schema.names else BAD_LENGTH
            column = self.table.column(key)
            lengths = pc.list_value_length(column).fill_null(-1).to_numpy().astype(np.int64)
            lengths[lengths < 0] = null
            lengths[lengths * (kind.value_type.bit_width // 8) > limit] = BAD_LENGTH
            out = (lengths if self.indices is None else lengths[self.indices]).astype(np.int32)
        self._lengths[memo] = out
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class DatasetShards:
    """What a ``datasets.Dataset`` is read as."""

    urls: tuple[str, ...]
    """Its cache files, or its ``hf-dataset://`` row ranges."""
    held: Held | None
    """The registered object the row ranges name (None for cache files)."""


def shards_of(ds: Any) -> DatasetShards:
    """The shards of ``ds`` (see the module docstring); an empty dataset is a ``ValueError``."""
    if len(ds) == 0:
        raise ValueError(f"the datasets.Dataset {ds._fingerprint} has no rows")
    if ds.format["type"] == "custom":  # ds[i] is the transform's output, which the table does not hold
        raise ValueError(f"the datasets.Dataset {ds._fingerprint} has a transform (set_transform / with_transform) "
                         f"applied when a row is read: streampack reads the table's rows, so apply it with "
                         f"ds.map(...) instead (or ds.reset_format() to read the rows as stored)")
    files = _whole_files(ds)
    if files is not None:
        return DatasetShards(urls=tuple(files), held=None)
    held = Held(ds)
    urls = tuple(f"{SCHEME}{held.fingerprint}/rows-{lo}-{min(lo + ROWS_PER_SHARD, held.rows)}"
                 for lo in range(0, held.rows, ROWS_PER_SHARD))
    return DatasetShards(urls=urls, held=held)


_METADATA_ONLY = ("replace_schema_metadata",)
"""Operations ``datasets`` replays on a memory-mapped file that leave its rows and column names as the file has them
(``load_dataset`` records its features in the schema's metadata)."""


def _whole_files(ds: Any) -> list[str] | None:
    """The ``.arrow`` files whose rows, back to back, are ``ds``'s rows (no mapping, each a whole memory-mapped file
    with no operation replayed on it but :data:`_METADATA_ONLY`); None when it is anything else."""
    from datasets.table import ConcatenationTable, MemoryMappedTable

    if ds._indices is not None:
        return None
    table = ds._data
    blocks = [[table]] if isinstance(table, MemoryMappedTable) else (
        table.blocks if isinstance(table, ConcatenationTable) else None)
    if not blocks or any(len(row) != 1 for row in blocks):
        return None
    files = [row[0] for row in blocks]
    if not all(isinstance(f, MemoryMappedTable) and f.path.endswith(".arrow")
               and all(op[0] in _METADATA_ONLY for op in f.replays) for f in files):
        return None
    return [f.path for f in files]


def is_object_url(url: str) -> bool:
    return url.startswith(SCHEME)


def _parse(url: str) -> tuple[str, int, int]:
    fingerprint, _, rows = url[len(SCHEME):].partition("/rows-")
    lo, _, hi = rows.partition("-")
    if not fingerprint or not lo.isdigit() or not hi.isdigit() or int(lo) >= int(hi):
        raise ValueError(f"{url!r} is not a {SCHEME}<fingerprint>/rows-<lo>-<hi> shard")
    return fingerprint, int(lo), int(hi)


def source(url: str) -> tuple[Held, int, int]:
    """The registered dataset of ``url`` and its rows ``[lo, hi)``; ``DataError("missing_shard")`` when no dataset of
    that fingerprint is held by this process (a URL copied alone, or a dataset garbage-collected)."""
    fingerprint, lo, hi = _parse(url)
    held = _REGISTRY.get(fingerprint)
    if held is None:
        raise DataError("missing_shard", f"no datasets.Dataset with fingerprint {fingerprint} in this process: pass "
                        f"the Dataset object itself as the source (its URLs alone cannot be read)", url=url, value=url)
    if hi > held.rows:
        raise DataError("missing_shard", f"rows {lo}-{hi} past the dataset's {held.rows} rows", url=url, value=hi)
    return held, lo, hi


def identity(url: str) -> ShardStat:
    """A shard's identity: its row count and the dataset's fingerprint (the URL names both, so it never changes while
    the dataset is held)."""
    held, lo, hi = source(url)
    return ShardStat(size=hi - lo, tag=f"fingerprint={held.fingerprint}")


storage.IN_PROCESS[SCHEME] = identity


def token_lengths(url: str, decode: DecodeOptions) -> np.ndarray:
    """int32 ``[rows of the shard]``: see :meth:`Held.lengths`."""
    held, lo, hi = source(url)
    return held.lengths(decode)[lo:hi]


__all__ = ["READ_ROWS", "ROWS_PER_SHARD", "SCHEME", "DatasetShards", "Held", "Registry", "identity",
           "is_dataset", "is_object_url", "is_source_object", "is_streaming", "shards_of", "source",
           "token_lengths"]
