"""A remote tar's headers by ranged requests, for indexing: only the bytes the scan looks at.

Indexing a tar reads each member's 512-byte header, the first 512 bytes of a token ``.npy`` and
whole ``.json`` members, and seeks over everything else. Locally a seek is free; remotely the
block reader (:mod:`streampack.io.open`) fetches 8 MiB blocks from wherever the scan stands, so
``streampack index`` over http downloaded every byte of every shard (20,000 shards: 9.8 GB,
10 min 45 s). :class:`SparseStream` instead fetches :data:`BLOCK` bytes where the scan reads,
and skips the bytes it seeks over — unless the shard turns out dense.

**The rule.** A shard of at most ``OpenOptions.block_size`` (8 MiB) is one request read whole:
ranged reads cannot beat that. Above it, after :data:`PROBE` ranged fetches the stream compares the mean bytes skipped
per fetch with :data:`MIN_GAP`; below it (small members: the scan would touch nearly every
block anyway) it streams the rest of the shard with the ordinary block reader, from where it
stands. A ranged fetch costs one request (``t_req``), a skipped byte saves ``1/bw``, so ranged
is cheaper while ``gap > t_req × bw``. Measured on loopback HTTP (Python threading server,
2-core machine under load 7-10; ``benchmarks/bench_index.py``): ``t_req`` 2.8–5.5
ms for 16 KiB, streaming 70–570 MB/s, break-even 0.4–2.1 MB. On 200-sample shards whole reads win up to 256 KiB members (451 against 967 ms) and
ranged reads from 1 MiB (663 against 1,252 ms; 4 MiB members 2.2 against 4.9 s; the table is in
``benchmarks/README.md``, "Sparse tar reads").

So :data:`MIN_GAP` = 512 KiB: token shards (KB-sized samples) stream whole (above 8 MiB at the
cost of a 2-request probe, ~2 × t_req); shards whose samples carry images or audio of
≥ 512 KiB are read sparsely (1 MiB members: 3.3 MB fetched instead of 211 MB). On S3 / GCS
(``t_req`` 10–30 ms, ~100 MB/s per stream) break-even is 1–3 MB: between 512 KiB and that, ranged
costs requests but saves egress. ``streampack index --ranged always|never`` overrides the rule.
"""

from __future__ import annotations

import io
from typing import Any, BinaryIO

from streampack.io.open import open_shard
from streampack.io.retry import IOStats
from streampack.io.storage import OpenOptions

BLOCK = 16 << 10
"""Bytes per ranged fetch: a header and a ``.npy`` prefix with room to spare."""
PROBE = 2
"""Ranged fetches before the stream judges the shard's density."""
MIN_GAP = 512 << 10
"""Mean bytes skipped per ranged fetch below which the rest is streamed whole."""
RANGED_MODES = ("auto", "always", "never")


class SparseStream(io.RawIOBase):
    """Bytes ``[0, size)`` of a remote object, seekable: :data:`BLOCK`-byte ranged reads where
    it is read (``mode="always"``), switched to one streaming read of the rest when the reads
    skip little (``"auto"``, see the module docstring)."""

    def __init__(self, url: str, size: int, opts: OpenOptions, stats: IOStats | None, *, mode: str = "auto") -> None:
        super().__init__()
        if mode not in RANGED_MODES:
            raise ValueError(f"ranged={mode!r} must be one of {RANGED_MODES}")
        self.url, self.size, self._opts, self._stats, self._mode = url, size, opts, stats, mode
        self._pos, self._buf, self._buf_at = 0, b"", 0
        self.fetches, self.skipped = 0, 0
        self._dense: BinaryIO | None = None
        self._dense_at, self._switched = -1, 0

    @property
    def streamed_from(self) -> int | None:
        """Where the stream switched to reading whole (None: it stayed ranged)."""
        return None if self._dense is None else self._switched

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + pos < 0:
            raise ValueError(f"negative seek position {base + pos}")
        self._pos = base + pos
        return self._pos

    def readinto(self, b: Any) -> int:
        want = min(len(b), self.size - self._pos)
        if want <= 0:
            return 0
        if self._dense is not None:
            if self._dense_at != self._pos:
                self._dense.seek(self._pos)
            n = self._dense.readinto(b)
            self._pos += n
            self._dense_at = self._pos
            return n
        if not self._buf_at <= self._pos < self._buf_at + len(self._buf):
            self._fetch()
            if self._dense is not None:
                return self.readinto(b)
        i = self._pos - self._buf_at
        n = min(want, len(self._buf) - i)
        memoryview(b).cast("B")[:n] = self._buf[i:i + n]
        self._pos += n
        return n

    def close(self) -> None:
        if self._dense is not None:
            self._dense.close()
        super().close()

    def _fetch(self) -> None:
        if self.fetches:
            self.skipped += max(0, self._pos - (self._buf_at + len(self._buf)))
        if (self._mode == "never" or (self._mode == "auto" and self.fetches >= PROBE
                                      and self.skipped < MIN_GAP * self.fetches)):
            self._switched = self._pos
            self._dense = open_shard(self.url, self._pos, self.size, opts=self._opts, stats=self._stats)
            self._dense_at = self._pos
            return
        end = min(self._pos + BLOCK, self.size)
        with open_shard(self.url, self._pos, end, opts=self._opts, stats=self._stats) as f:
            self._buf, self._buf_at = f.read(), self._pos
        self.fetches += 1


def open_sparse(url: str, size: int, opts: OpenOptions, stats: IOStats | None, mode: str = "auto") -> BinaryIO:
    return SparseStream(url, size, opts, stats, mode=mode)  # type: ignore[return-value]


__all__ = ["BLOCK", "MIN_GAP", "PROBE", "RANGED_MODES", "SparseStream", "open_sparse"]
