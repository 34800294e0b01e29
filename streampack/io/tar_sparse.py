"""A remote tar's headers by ranged requests, for indexing: only the bytes the scan looks at.

A shard of at most ``OpenOptions.block_size`` is one request read whole. Above it,
:class:`SparseStream` fetches :data:`BLOCK` bytes where the scan reads and skips what it seeks
over; after :data:`PROBE` fetches, if the mean gap skipped is under :data:`MIN_GAP` it streams the
rest whole. Ranged wins while ``gap > t_req × bandwidth``: 0.4–2.1 MB on loopback HTTP, 1–3 MB on
S3 / GCS (``benchmarks/bench_index.py``), so :data:`MIN_GAP` = 512 KiB: token shards stream whole
and shards of images or audio are read sparsely. ``streampack index --ranged`` overrides the rule.
"""

from __future__ import annotations

from typing import Any, BinaryIO

from streampack.io.open import SeekableRaw, open_shard
from streampack.io.retry import IOStats
from streampack.io.storage import OpenOptions

BLOCK = 16 << 10
"""Bytes per ranged fetch: a header and a ``.npy`` prefix with room to spare."""
PROBE = 2
"""Ranged fetches before the stream judges the shard's density."""
MIN_GAP = 512 << 10
"""Mean bytes skipped per ranged fetch below which the rest is streamed whole."""
RANGED_MODES = ("auto", "always", "never")


class SparseStream(SeekableRaw):
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
        self._dense_at = -1

    def _size(self) -> int:
        return self.size

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
        if not self._loaded():
            self._fetch()
            if self._dense is not None:
                return self.readinto(b)
        return self._deliver(b, want)

    def close(self) -> None:
        if self._dense is not None:
            self._dense.close()
        super().close()

    def _fetch(self) -> None:
        if self.fetches:
            self.skipped += max(0, self._pos - (self._buf_at + len(self._buf)))
        if (self._mode == "never" or (self._mode == "auto" and self.fetches >= PROBE
                                      and self.skipped < MIN_GAP * self.fetches)):
            self._dense = open_shard(self.url, self._pos, self.size, opts=self._opts, stats=self._stats)
            self._dense_at = self._pos
            return
        end = min(self._pos + BLOCK, self.size)
        with open_shard(self.url, self._pos, end, opts=self._opts, stats=self._stats) as f:
            self._buf, self._buf_at = f.read(), self._pos
        self.fetches += 1


__all__ = ["BLOCK", "MIN_GAP", "PROBE", "RANGED_MODES", "SparseStream"]
