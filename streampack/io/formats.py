"""One shard range -> decoded items, whatever the format: the only place that knows formats.

The reader node hands over *where* to read (:class:`ShardRange`: the byte offset and number of
the first sample, and where to stop) and gets :class:`~streampack.io.decode.Item` s back, each
with the position of the sample after it, so it can resume anywhere without knowing how a
format lays its samples out.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from streampack.errors import DataError
from streampack.io.decode import DecodeOptions, Item
from streampack.io.jsonl import DECOMPRESS_ERRORS, iter_jsonl_items, text_stream
from streampack.io.open import open_shard
from streampack.io.retry import OpenOptions
from streampack.io.tar import iter_tar_items
from streampack.io.urls import is_remote, shard_format


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardRange:
    """Where to read in one shard."""

    start: int
    """Offset of the first sample to read (a byte offset; uncompressed bytes for .gz)."""
    first: int
    """Number of that sample in the shard (tar ordinal, jsonl line number)."""
    end: int | None = None
    """Offset to stop at (exclusive), or None for the end of the shard."""


def open_range(url: str, where: ShardRange, *, decode: DecodeOptions, opts: OpenOptions,
               streams: list[BinaryIO]) -> Iterator[Item]:
    """Decoded items of ``where`` in ``url``; every stream opened is appended to ``streams``
    (the caller closes them). A missing, unreachable or corrupt shard raises ``DataError``;
    a dropped connection raises ``OSError`` (the caller reopens at its recorded position)."""
    start, end = where.start, where.end
    remote = is_remote(url) or url.startswith("pipe:")
    if shard_format(url) == "tar":
        streams.append(open_shard(url, start, end if remote else None, opts=opts))
        return iter_tar_items(streams[-1], decode, url=url, start=start, first_index=where.first, end=end,
                              seekable=not remote)
    gz = url.split("?", 1)[0].endswith(".gz")
    streams.append(open_shard(url, 0 if gz else start, end if remote and not gz else None, opts=opts))
    streams.append(text_stream(_NotEmpty(streams[-1], url) if gz else streams[-1], url))
    if gz and start:
        _skip_uncompressed(streams[-1], start, url)
    return iter_jsonl_items(streams[-1], decode, url=url, start=start, first_index=where.first, end=end)


class _NotEmpty:
    """The raw stream of a compressed shard, which must not be 0 bytes: gzip reads a 0-byte
    file as an empty stream, but a 0-byte ``.gz`` is a failed write (a gzip of nothing is 20
    bytes), as a 0-byte ``.tar`` is (an empty archive is 1024 bytes): both are errors."""

    def __init__(self, raw: BinaryIO, url: str) -> None:
        self._raw, self._url, self._checked = raw, url, False

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(n)
        if not self._checked and n != 0:
            if not data:
                raise DataError("corrupt_shard", "0-byte file is not a compressed stream", url=self._url, value=0)
            self._checked = True
        return data

    def __getattr__(self, name: str) -> object:
        return getattr(self._raw, name)


def _skip_uncompressed(f: BinaryIO, n: int, url: str) -> None:
    """gzip cannot seek: inflate and drop ``n`` bytes (O(n) CPU, documented in jsonl_source)."""
    while n > 0:
        try:
            chunk = f.read(min(n, 1 << 20))
        except DECOMPRESS_ERRORS as e:  # other OSErrors (a dropped connection) are retried
            raise DataError("corrupt_shard", f"cannot decompress: {e}", url=url, value=n) from None
        if not chunk:
            raise DataError("corrupt_shard", "stream ended before the resume offset", url=url, value=n)
        n -= len(chunk)
