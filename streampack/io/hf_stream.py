"""A streaming Hugging Face ``datasets.IterableDataset`` as a source: each of its ``num_shards`` shards is a shard.

:func:`shards_of` names shard ``i`` of ``n`` ``hf-stream://<name>/shard-<i>-of-<n>``: what
``ds.shard(num_shards=n, index=i)`` yields (``datasets``' own split of its data sources, one each), in the order it
yields it, with all of ``ds``'s ``map`` / ``filter`` / ``shuffle`` steps. A sample's position and key are its number
in its shard. ``<name>`` hashes the stream's description (data set and config name, split, shard count, the files its
source reads, or the fingerprints of the ``Dataset`` s ``to_iterable_dataset`` streams, and its steps' kinds):
``datasets`` gives a streaming pipeline no fingerprint, so two streams of one description (another ``map`` function
over the same files) are not told apart: a state saved on one resumes on the other, and in one process the readers of
either may read the other.

**Exact resume.** A streampack state refers to every document still in a buffer by (shard, position) and re-reads it
(:mod:`streampack.plan.replay`); one position of the whole pipeline (``IterableDataset.state_dict()``) cannot name
the W documents a packing window carries. Reading from position ``k`` reopens the shard and counts ``k`` rows off its
Arrow record batches without decoding them, which is what ``load_state_dict`` itself pays for an Arrow-backed shard
(it re-reads the shard up to the example); and it is exact where ``load_state_dict`` is not: a ``shuffle(buffer_size=)``
step replays the same order from the shard's start, where ``datasets`` drops the buffer.

**What it cannot do.** A stream has no row counts, so nothing is indexed: a finite epoch over several readers
(equal steps need every reader's counts) and a shard split between readers are refused (:func:`refusal`); one reader
reads it finitely or forever, and several readers of an infinite stream take whole shards. Save the data with
``save_to_disk`` (or read the Hub data set's parquet files by URL) for a planned multi-rank epoch.

**Cost per reader**: the bytes and decoding of its shards as ``datasets`` streams them (requests: those of its
source), in record batches of :data:`~streampack.io.hf_dataset.READ_ROWS` rows; a restore re-reads each shard it was
in, and each shard holding a carried document, from its start to the position (O(position) rows read, not decoded).
Memory: one record batch. A spawned DataLoader worker unpickles the stream (its ``map`` functions must pickle; forked
workers share it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

from streampack.errors import DataError
from streampack.io import storage
from streampack.io.decode import DecodeOptions
from streampack.io.hf_dataset import READ_ROWS, DatasetShards, Registry
from streampack.io.parquet import column_roles
from streampack.io.storage import ShardStat

SCHEME = "hf-stream://"
_REGISTRY = Registry()


def refusal(url: str) -> str:
    """Why a plan that needs the row counts of ``url`` is refused, and what to do instead."""
    return (f"{url!r} is a shard of a streaming datasets.IterableDataset, which has no row counts: a finite epoch "
            f"over several readers (ranks, or DataLoader workers) cannot be planned with equal steps, and a shard "
            f"cannot be split between readers. Read it with one reader (dp_size=1, num_workers<=1), or forever "
            f"(epochs=None) with at least as many shards as readers; for a planned multi-rank epoch save it with "
            f"Dataset.save_to_disk() (or load it without streaming=True) and pass that, or read the Hub data set's "
            f"parquet files by URL (hf://datasets/<repo>/...), which the manifest counts")


def stream_name(ds: Any) -> str:
    """16 hex of a hash of ``ds``'s description (see the module docstring)."""
    steps, source = [], ds._ex_iterable
    while getattr(source, "ex_iterable", None) is not None:
        steps.append(type(source).__name__)
        source = source.ex_iterable
    reads = {k: _named(v) for k, v in (getattr(source, "kwargs", None) or {}).items()}
    info = ds.info
    text = repr((info.dataset_name, info.config_name, str(ds.split), ds.num_shards, type(source).__name__,
                 sorted((k, v) for k, v in reads.items() if v is not None), steps))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _named(value: Any) -> Any:
    """What names a source's argument: a file name as itself, a ``Dataset`` (``to_iterable_dataset``'s shards) by its
    fingerprint, a list of them element by element; None for anything else (not part of the name)."""
    if isinstance(value, str):
        return value
    if isinstance(getattr(value, "_fingerprint", None), str):
        return f"fingerprint={value._fingerprint}"
    if isinstance(value, list):
        named = [_named(v) for v in value]
        return named if all(n is not None for n in named) else None
    return None


class Stream:
    """An ``IterableDataset`` registered in this process under its name, for the readers of its shard URLs; it
    pickles as the dataset and registers again when unpickled (a spawned DataLoader worker)."""

    def __init__(self, ds: Any) -> None:
        self.ds, self.name, self.num_shards = ds, stream_name(ds), ds.num_shards
        _REGISTRY.add(self.name, self)

    def __reduce__(self) -> tuple[Any, ...]:
        return Stream, (self.ds,)

    def tables(self, shard: int) -> Iterator[Any]:
        """Shard ``shard``'s rows as ``pyarrow.Table`` s of at most ``READ_ROWS`` rows."""
        one = self.ds.shard(num_shards=self.num_shards, index=shard, contiguous=True)
        return one.with_format("arrow").iter(batch_size=READ_ROWS)


def shards_of(ds: Any) -> DatasetShards:
    stream = Stream(ds)
    n = stream.num_shards
    return DatasetShards(urls=tuple(f"{SCHEME}{stream.name}/shard-{i}-of-{n}" for i in range(n)), held=stream)


def is_stream_url(url: str) -> bool:
    return url.startswith(SCHEME)


def source(url: str) -> tuple[Stream, int]:
    """The registered stream of ``url`` and the shard's number; ``DataError("missing_shard")`` when this process
    holds no stream of that name."""
    name, _, rest = url[len(SCHEME):].partition("/shard-")
    index, _, count = rest.partition("-of-")
    if not index.isdigit() or not count.isdigit() or int(index) >= int(count):
        raise ValueError(f"{url!r} is not a {SCHEME}<name>/shard-<i>-of-<n> shard")
    stream = _REGISTRY.get(name)
    if stream is None or stream.num_shards != int(count):
        raise DataError("missing_shard", f"no datasets.IterableDataset named {name} with {count} shards in this "
                        f"process: pass the IterableDataset object itself as the source", url=url, value=url)
    return stream, int(index)


def identity(url: str) -> ShardStat:
    """No size (a stream has none to give) and the stream's name."""
    stream, _ = source(url)
    return ShardStat(size=None, tag=f"stream={stream.name}")


storage.IN_PROCESS[SCHEME] = identity


def stream_batches(url: str, start: int, end: int | None, decode: DecodeOptions) -> Iterator[tuple[int, Any, bool]]:
    """``(first row, record batch, last of the range)`` of the shard's rows ``[start, end)``, only the columns
    ``decode`` reads; the rows before ``start`` are counted off the batches, never decoded."""
    stream, shard = source(url)
    row, held = 0, None
    for table in stream.tables(shard):
        for batch in table.to_batches():
            top = row + batch.num_rows
            if top > start:
                cut = batch.slice(max(start - row, 0), (top if end is None else min(top, end)) - max(start, row))
                if held is not None:
                    yield *held, False
                columns = sorted(set(column_roles(cut.schema.names, decode, url).values()))
                held = (max(start, row), cut.select(columns))
            row = top
            if end is not None and row >= end:
                break
        if end is not None and row >= end:
            break
    if held is not None:
        yield *held, True
    if end is not None and row < end:
        raise DataError("corrupt_shard", f"row {row}: the stream ends there, a position past it was asked for",
                        url=url, key=str(row), value=row)


__all__ = ["SCHEME", "Stream", "identity", "is_stream_url", "refusal", "shards_of", "source", "stream_batches",
           "stream_name"]
