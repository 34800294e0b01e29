"""Hand-made hostile shards: tar headers with any declared size, pax records, GNU long names.

Example::

    good = [sample("00000000", [1, 2]), sample("00000001", [3])]
    data = archive(*good[:1], member("x.npy", b"", declared=1 << 40), *good[1:])
    path = write_bytes(tmp_path / "bad.tar", data)
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import tarfile
from collections.abc import Iterator
from typing import Any

import numpy as np

from streampack.errors import ErrorPolicy
from streampack.options import ReadOptions

BLOCK = 512


def fix_checksum(hdr: bytearray) -> bytes:
    hdr[148:156] = b" " * 8
    hdr[148:156] = b"%06o\0 " % sum(hdr)
    return bytes(hdr)


def header(name: str, size: int, *, kind: bytes = b"0", size_field: bytes | None = None) -> bytes:
    """One 512-byte ustar header for ``name``; ``size_field`` overrides the 12 size bytes."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.type = 0, 0, 0o644, kind
    hdr = bytearray(info.tobuf(tarfile.USTAR_FORMAT))
    assert len(hdr) == BLOCK, "keep test names short (<= 100 bytes)"
    if size_field is None:
        size_field = b"%011o\0" % size if size < 8**11 else b"\x80" + size.to_bytes(11, "big")
    hdr[124:136] = size_field
    return fix_checksum(hdr)


def pad(data: bytes) -> bytes:
    return data + bytes(-len(data) % BLOCK)


def member(name: str, data: bytes, *, declared: int | None = None, kind: bytes = b"0") -> bytes:
    """Header + padded data; ``declared`` is the size the header claims (default: the truth)."""
    return header(name, len(data) if declared is None else declared, kind=kind) + pad(data)


def npy_bytes(arr) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asarray(arr), allow_pickle=False)
    return buf.getvalue()


def sample(key: str, tokens, **extra: bytes) -> bytes:
    """The members of one webdataset sample: ``key.npy`` (tokens) plus ``key.<field>`` extras."""
    out = member(f"{key}.npy", npy_bytes(np.asarray(tokens, dtype=np.int64)))
    return out + b"".join(member(f"{key}.{field}", data) for field, data in extra.items())


def json_sample(key: str, record: dict) -> bytes:
    return member(f"{key}.json", json.dumps(record).encode())


def archive(*parts: bytes) -> bytes:
    return b"".join(parts) + bytes(2 * BLOCK)


def write_bytes(path: str | os.PathLike[str], data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return os.fspath(path)


def samples(n: int, *, start: int = 0, **extra: bytes) -> list[bytes]:
    """``n`` good samples, key ``f"{i:08d}"`` with tokens ``[i + 1, 7]``."""
    return [sample(f"{i:08d}", [i + 1, 7], **extra) for i in range(start, start + n)]


def ids(out) -> list[int]:
    """The first token of each sample read (which good sample it was, plus one)."""
    return [int(s.tokens[0]) for s in out]


def read(url: str, **kw: Any) -> list:
    """Every sample one reader yields from ``url``, in order (one epoch, unshuffled)."""
    from streampack.nodes.reader import ShardReader

    return list(ShardReader(url, shuffle=False, epochs=1, **kw))


def skip(url: str, **kw: Any) -> tuple[list[int], dict[str, int]]:
    """The sample ids ``on_error="skip"`` keeps, and what it counts."""
    from streampack.errors import ErrorCounter

    errors = ErrorCounter()
    return ids(read(url, error_policy=ErrorPolicy("skip", errors), **kw)), errors.counts


@contextlib.contextmanager
def closing_workers(it: Any) -> Iterator[Any]:
    """A DataLoader iterator whose worker processes are shut down on exit, also when a
    DataError escapes: an abandoned one lives on and slows every later test (its ``__del__``
    may even run in a later test's forked worker). An exception other than a DataError escapes in
    a reference cycle with its frames, so the garbage collector frees it, in some later test, after
    finalizing the queue its stop message goes through: torch's shutdown then waits out its 5 s join
    timeout (a DataError does not: ``DataError.message``)."""
    try:
        yield it
    finally:
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def through_loader(urls: list[str], *, num_workers: int, capacity: int = 64,
                   **kw) -> tuple[list[str], dict[str, int]]:
    """Read ``urls`` end to end (PackedDataset under a StatefulDataLoader with ``num_workers``):
    the sorted doc keys of every batch, and the error counts summed over the workers (a worker
    that yields no batch is never snapshotted: give every worker some good samples)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from streampack.dataset import PackedDataset
    from streampack.options import PackOptions
    from streampack.plan.state import dataset_states

    ds = PackedDataset(urls, capacity=capacity, epochs=1, shuffle=False, packing=PackOptions(window=8), **kw)
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=num_workers)
    with closing_workers(iter(loader)) as batches:
        keys = sorted(k for batch in batches for k in batch.doc_keys)
    metrics = [s["metrics"] for s in dataset_states(loader.state_dict())] if num_workers else [ds.metrics()]
    counts: dict[str, int] = {}
    for m in metrics:
        for reason, n in m["errors"]["counts"].items():
            counts[reason] = counts.get(reason, 0) + n
    return keys, counts


def check_both_modes(urls: list[str], *, num_workers: int, raises: set[tuple[str, str]], kept: list[str],
                     counts: dict[str, int], read: ReadOptions = ReadOptions(), **kw) -> None:
    """raise mode: a DataError whose ``(reason, url)`` is one of ``raises`` reaches the loop
    (with workers, which bad sample surfaces first is a race); skip mode keeps exactly the doc
    keys ``kept`` and counts ``counts``."""
    import pytest

    from streampack.errors import DataError

    with pytest.raises(DataError) as info:
        through_loader(urls, num_workers=num_workers, read=read, **kw)
    assert (info.value.reason, info.value.url) in raises, str(info.value)
    skipping = dataclasses.replace(read, on_error="skip")
    assert through_loader(urls, num_workers=num_workers, read=skipping, **kw) == (sorted(kept), counts)


def assert_resume_exact(url: str, *, every: int = 1, **kw) -> list[int]:
    """Read ``url`` under ``on_error="skip"``, then again stopping after each ``every``-th
    sample and resuming from a saved (torch round-tripped) state: the streams must be equal. A
    wrong recorded offset (the next sample's position) shows up here; returns the ids read."""
    import torch

    from streampack.nodes.reader import ShardReader

    def reader():
        return ShardReader(url, shuffle=False, epochs=1, error_policy=ErrorPolicy("skip"), **kw)

    full = ids(reader())
    for k in range(0, len(full) + 1, every):
        head = reader()
        got = [next(head) for _ in range(k)]
        buf = io.BytesIO()
        torch.save(head.state_dict(), buf)
        buf.seek(0)
        resumed = reader()
        resumed.reset(torch.load(buf, weights_only=True))
        assert ids(got) + ids(resumed) == full, f"resumed after {k} samples"
    return full
