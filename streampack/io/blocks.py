"""Which shard ranges are read as token blocks, and by which reader: the one entry of the block readers.

:func:`read_blocks` gives the :class:`~streampack.io.token_block.TokenBlock` s of a shard range
when its format has a block reader (tar with ``.npy`` token members, parquet with an integer-list
token column, Megatron-core ``.idx`` + ``.bin``, flat token arrays, a ``datasets`` ``.arrow`` file with an
integer-list token column), else None. A block reader delivers only what the
per-sample reader would deliver as valid samples with nothing to report, and stops at the first byte
it does not judge plain; the caller reads on with the per-sample reader, so the error contract is
that reader's by construction.
:func:`read_samples_at` (tar samples by offset) and :func:`read_groups_at` (the parquet row groups
holding given rows) serve a restore's re-read of its carried documents the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, BinaryIO

from streampack.io.arrow_block import arrow_blocks
from streampack.io.decode import DecodeOptions
from streampack.io.formats import ShardRange
from streampack.io.hf_dataset_block import dataset_blocks
from streampack.io.megatron import megatron_blocks
from streampack.io.parquet_block import parquet_blocks, parquet_groups_at
from streampack.io.retry import IOStats
from streampack.io.storage import OpenOptions
from streampack.io.tar_block import tar_blocks
from streampack.io.tar_pick import Clusters, tar_samples_at
from streampack.io.token_array import token_array_blocks
from streampack.io.token_block import TokenBlock
from streampack.io.urls import shard_format

if TYPE_CHECKING:
    from streampack.io.index import ShardIndex

BLOCK_FORMATS = ("tar", "parquet", "megatron", "token_array", "arrow", "hf_dataset", "hf_stream")
"""Formats with a block reader."""


def block_format(url: str) -> bool:
    """Whether ``url``'s format has a block reader."""
    try:
        return shard_format(url) in BLOCK_FORMATS and not url.startswith("pipe:")
    except ValueError:
        return False


def read_blocks(url: str, where: ShardRange, *, decode: DecodeOptions, opts: OpenOptions, streams: list[BinaryIO],
                stats: IOStats | None = None, chunk_bytes: int | None = None,
                index: ShardIndex | None = None) -> Iterator[TokenBlock] | None:
    """The blocks of ``where`` in ``url``, or None when the format has no block reader or the decode
    options ask for more than token ids; streams opened are appended to ``streams`` (the caller closes them)."""
    if not block_format(url) or decode.media is not None or decode.labels_key or decode.loss_mask_key:
        return None
    if shard_format(url) == "tar":
        return tar_blocks(url, where, decode=decode, opts=opts, streams=streams, stats=stats, chunk_bytes=chunk_bytes)
    if shard_format(url) == "megatron":
        return megatron_blocks(url, where.start, where.end, decode=decode, opts=opts, stats=stats)
    if shard_format(url) == "token_array":
        return token_array_blocks(url, where.start, where.first, where.end, decode=decode, opts=opts, stats=stats)
    if shard_format(url) in ("hf_dataset", "hf_stream"):
        return dataset_blocks(url, where.start, where.end, decode=decode)
    if shard_format(url) == "arrow":
        return arrow_blocks(url, where, decode=decode, opts=opts, stats=stats,
                            table=None if index is None else index.batch_table)
    return parquet_blocks(url, where, decode=decode, opts=opts, streams=streams, stats=stats)


def read_samples_at(shards: list[tuple[str, Clusters]], *, decode: DecodeOptions, opts: OpenOptions,
                    streams: list[BinaryIO], stats: IOStats | None = None) -> list[TokenBlock] | None:
    """Only the wanted samples of tar ``shards`` (URL and :data:`~streampack.io.tar_pick.Clusters`), a
    block per shard (:mod:`streampack.io.tar_pick`); None where :func:`read_blocks` would be, or when a
    shard is not tar or a sample not a plain token sample."""
    if decode.media is not None or decode.labels_key or decode.loss_mask_key or not all(
            shard_format(url) == "tar" and block_format(url) for url, _ in shards):
        return None
    return tar_samples_at(shards, decode=decode, opts=opts, streams=streams, stats=stats)


def read_groups_at(url: str, rows: list[int], *, decode: DecodeOptions, opts: OpenOptions,
                   streams: list[BinaryIO], stats: IOStats | None = None) -> list[TokenBlock] | None:
    """The row groups of a parquet shard that hold ``rows``, a block each; None where not parquet, the
    decode options ask for more than ids, or a group is not a plain block."""
    if shard_format(url) != "parquet" or decode.media is not None or decode.labels_key or decode.loss_mask_key:
        return None
    return parquet_groups_at(url, rows, decode=decode, opts=opts, streams=streams, stats=stats)


__all__ = ["BLOCK_FORMATS", "block_format", "read_blocks", "read_groups_at", "read_samples_at"]
