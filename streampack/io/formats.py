"""One shard range -> decoded items, whatever the format: the only place that knows formats.

The reader node hands over *where* to read (:class:`ShardRange`: the position and number of the first sample, and where
to stop) and gets :class:`~streampack.io.decode.Item` s back, each with the position of the sample after it, so it can
resume anywhere without knowing how a format lays its samples out. A position is a byte offset (tar, jsonl; uncompressed
bytes for ``.gz`` / ``.zst``) or a row number (parquet, a datasets ``.arrow`` file) or document number (Megatron, a token array with an offsets
file) or the array index of a document's first id (a token array split at the EOS id).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

from streampack.errors import DataError
from streampack.io.arrow_ipc import iter_arrow_items
from streampack.io.compression import DECOMPRESS_ERRORS, text_stream
from streampack.io.decode import DecodeOptions, Item
from streampack.io.hf_rows import iter_dataset_items
from streampack.io.jsonl import iter_jsonl_items
from streampack.io.megatron import iter_megatron_items
from streampack.io.open import open_shard, skip_bytes
from streampack.io.parquet import iter_parquet_items
from streampack.io.retry import IOStats
from streampack.io.storage import OpenOptions
from streampack.io.tar import iter_tar_items
from streampack.io.tar_header import BLOCK as TAR_BLOCK
from streampack.io.token_array import iter_token_array_items
from streampack.io.urls import shard_format

if TYPE_CHECKING:
    from streampack.io.index import ShardIndex


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardRange:
    """Where to read in one shard."""

    start: int
    """Position of the first sample to read: a byte offset (uncompressed bytes for .gz/.zst)
    or, for parquet, a row number (Megatron: a document number; a token array: see :mod:`streampack.io.token_array`)."""
    first: int
    """Number of that sample in the shard (tar ordinal, jsonl line number, parquet row, Megatron / token array
    document)."""
    end: int | None = None
    """Position to stop at (exclusive), or None for the end of the shard."""


def seeks_by_index(url: str, where: ShardRange) -> bool:
    """Whether a range of ``url`` starting where ``where`` does is read from a place its shard index records
    (a ``.arrow`` stream file has no footer: the index knows where each record batch starts)."""
    return where.start > 0 and shard_format(url) == "arrow"


def open_range(url: str, where: ShardRange, *, decode: DecodeOptions, opts: OpenOptions,
               streams: list[BinaryIO], stats: IOStats | None = None, index: ShardIndex | None = None) -> Iterator[Item]:
    """Decoded items of ``where`` in ``url`` (streams opened are appended to ``streams``; ``index``: the shard's,
    when :func:`seeks_by_index`); a missing, unreachable (after retries) or corrupt shard raises ``DataError``."""
    start, end = where.start, where.end
    fmt = shard_format(url)
    if fmt == "megatron":  # ranged reads of its own, closed as they finish
        return iter_megatron_items(url, decode, opts=opts, start=start, end=end, stats=stats)
    if fmt in ("hf_dataset", "hf_stream"):
        return iter_dataset_items(url, decode, start=start, end=end)
    if fmt == "arrow":
        return iter_arrow_items(url, decode, opts=opts, start=start, end=end, stats=stats,
                                table=None if index is None else index.batch_table)
    if fmt == "token_array":
        return iter_token_array_items(url, decode, opts=opts, start=start, first=where.first, end=end, stats=stats)

    def opened(offset: int = 0, stop: int | None = None) -> BinaryIO:
        streams.append(open_shard(url, offset, stop, opts=opts, stats=stats))
        return streams[-1]

    if fmt == "parquet":
        return iter_parquet_items(opened(), decode, url=url, start=start, end=end)
    if fmt == "tar":
        # a split range is opened one header past its end: the tar reader looks there for a corrupt region (an
        # index-made end is followed at least by the end-of-archive blocks), and past it with `reopen`
        pipe = url.startswith("pipe:")
        return iter_tar_items(opened(start, None if end is None else end + TAR_BLOCK), decode, url=url, start=start,
                              first_index=where.first, end=end, seekable=not pipe, reopen=None if pipe else opened)
    compressed = fmt != "jsonl"
    raw = opened() if compressed else opened(start, end)
    streams.append(text_stream(_NotEmpty(raw, url) if compressed else raw, url))
    if compressed and start:  # neither can seek: decompress and drop (O(start) CPU, see io.compression)
        try:
            skip_bytes(streams[-1], start, url)
        except DECOMPRESS_ERRORS as e:
            raise DataError("corrupt_shard", f"cannot decompress: {e}", url=url, value=start) from None
    return iter_jsonl_items(streams[-1], decode, url=url, start=start, first_index=where.first, end=end)


class _NotEmpty:
    """The raw stream of a compressed shard, which must not be 0 bytes: gzip and zstd read one as an empty
    stream, but a 0-byte ``.gz`` / ``.zst`` is a failed write (``corrupt_shard``), as a 0-byte ``.tar`` is."""

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


__all__ = ["ShardRange", "open_range", "seeks_by_index"]
