"""webdataset tar shards of ``.npy`` token members, read as :class:`~streampack.io.token_block.TokenBlock` s.

One read of a byte range (at most ``CHUNK_BYTES`` at a time, into a buffer of an earlier read that nothing views any
more); a walk follows the header chain by declared sizes (every block's size field read as one column first, then a
list lookup a header) and every header, pax record, name, ``.npy`` header and id is checked as columns
(:mod:`streampack.io.tar_columns`). The block's token array is a view of the read buffer. A block accepts exactly what
the per-sample reader (:mod:`streampack.io.tar`) turns into valid samples with nothing to report, in the shape
webdataset's ``TarWriter`` writes (one ``<key>.npy`` member per sample behind an optional ``mtime`` pax header);
anything else ends the blocks before its sample and the per-sample reader reads from there. ~2.5 µs a document with
every check (``benchmarks/bench_compact.py --constants``), where the per-sample reader takes 60-100 µs
(``benchmarks/bench_loaders.py``). A bad sample hands the rest of its chunk to the per-sample reader: exact, but slow for
such shards.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import BinaryIO

import numpy as np

from streampack.errors import DataError
from streampack.io import open as shard_open
from streampack.io.decode import DecodeOptions
from streampack.io.formats import ShardRange
from streampack.io.limits import id_bound
from streampack.io.retry import IOStats
from streampack.io.storage import OpenOptions, is_remote, local_path
from streampack.io.tar_columns import headers_ok, ids_in_range, member_names, npy_members, pax_ok
from streampack.io.tar_header import BLOCK, PAX, REGULAR, ZERO_BLOCK, opens_region, padded
from streampack.io.token_block import TokenBlock

CHUNK_BYTES = 8 << 20
"""Bytes read at a time: a block holds the whole samples of one read, so memory stays bounded
for shards of any size (a sample larger than a chunk doubles the next read)."""
_REGULAR, _PAX = b"".join(REGULAR), ord(PAX)  # as the ints a header's type flag byte reads
_POW8_11 = 8.0 ** np.arange(10, -1, -1)
_HIGH4, _HIGH4_ZEROS = np.uint64(0xF8F8F8F8_00000000), np.uint64(0x30303030_00000000)
_LOW7, _LOW7_ZEROS = np.uint64(0x00F8F8F8_F8F8F8F8), np.uint64(0x00303030_30303030)


def tar_blocks(url: str, where: ShardRange, *, decode: DecodeOptions, opts: OpenOptions, streams: list[BinaryIO],
               stats: IOStats | None = None, chunk_bytes: int | None = None) -> Iterator[TokenBlock]:
    """The blocks of ``where`` (see the module docstring); ends early, without a ``done`` block, where the per-sample
    reader must take over (a read failure included: it retries and reports it itself)."""
    size = chunk_bytes or CHUNK_BYTES
    end = where.end
    if end is not None and (end - where.start) % BLOCK:
        return
    # one block past a range's end, as the per-sample reader opens it: the header there judges the range's last sample
    stop = None if end is None else end + BLOCK
    try:
        f, known = _open(url, where.start, stop, opts, stats)
    except (DataError, OSError):
        return
    streams.append(f)
    limit = known if stop is None else (stop if known is None else min(stop, known))
    tail, base, number, pos = b"", where.start, where.first, where.start
    seen: set[bytes] = set()
    while True:
        # ask for what is there: read(8 MiB) of a 1.8 MB file cost 5x reading its size
        want = size if limit is None else min(size, max(limit - pos, 0))
        try:
            data = shard_open.read_reusing(f, want)
        except (DataError, OSError):
            return
        pos += len(data)
        final = len(data) < want or pos == limit
        buf = tail + data if tail else data
        parsed = parse_tar(buf, base=base, first=number, end=end, final=final, url=url, decode=decode,
                           after=lambda field: _intact_after(url, end, field, decode, opts, stats))
        if parsed is None:
            return
        block, used, names = parsed
        if len(block):
            if not (block.done and not seen):  # keys must be distinct over the whole range
                named = {r.tobytes() for r in names}
                if not seen.isdisjoint(named):
                    return
                seen.update(named)
            yield block
        if block.done or final:
            return
        tail, base, number = buf[used:], base + used, number + len(block)
        size = size if used else size * 2


def _intact_after(url: str, at: int | None, field: bytes, decode: DecodeOptions, opts: OpenOptions,
                  stats: IOStats | None) -> bool:
    """Whether the sample at ``at`` (past a range's end, behind an extension header: webdataset's
    pax headers) is one the per-sample reader's look-ahead finds intact, with the member field
    ``field``: then that reader keeps the range's last sample, and so may the blocks. It is
    judged by reading on (64 KiB, then more) until two whole samples past ``at`` pass every block
    check (the second shows nothing corrupt follows the first), or the archive ends after one."""
    if at is None:
        return False
    size = 64 << 10
    try:
        f, _ = _open(url, at, None, opts, stats)
    except (DataError, OSError):
        return False
    try:
        while size <= CHUNK_BYTES:
            f.seek(at)
            data = f.read(size)
            final = len(data) < size
            parsed = parse_tar(data, base=at, first=0, end=None, final=final, url=url, decode=decode)
            if parsed is None:
                return False
            block, _, names = parsed
            if len(block) >= 2 or (block.done and len(block)):
                first = names[0].tobytes().rstrip(b"\0")
                return first[int(block.key_len[0]):] == field  # type: ignore[index]
            if final:
                return False
            size *= 8
        return False
    except (DataError, OSError):
        return False
    finally:
        f.close()


def _open(url: str, start: int, stop: int | None, opts: OpenOptions,
          stats: IOStats | None) -> tuple[BinaryIO, int | None]:
    """The shard from ``start`` and its size when known: a local file opened plainly (a read error ends
    the blocks), a remote object through :func:`~streampack.io.open.open_shard`."""
    if is_remote(url):
        return shard_open.open_shard(url, start, stop, opts=opts, stats=stats), None
    f = shard_open._open_local(local_path(url))  # through the module: tests count what it reads
    try:
        size: int | None = os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, ValueError):
        size = None
    f.seek(start)
    return f, size


def parse_tar(buf: bytes, *, base: int, first: int, end: int | None, final: bool, url: str, decode: DecodeOptions,
              after: Callable[[bytes], bool] | None = None) -> tuple[TokenBlock, int, np.ndarray] | None:
    """The whole plain samples at the start of ``buf`` (bytes of the shard from header offset ``base``, sample number
    ``first``; ``final``: nothing follows ``buf`` in the stream), the bytes they take and their member names (uint8
    ``[n, 100]``); None where the per-sample reader must read. ``after(field)`` judges a range's last sample when the
    header past ``end`` is an extension header (see :func:`_intact_after`); without it such a range is not taken."""
    n = len(buf) - len(buf) % BLOCK
    stop = None if end is None else end - base
    heads, sizes, p = _chain(buf, n if stop is None else min(n, stop))
    done = look = False
    if stop is not None and p > stop:
        return None  # a member crosses the range's end
    if stop is not None and p == stop and p <= n:
        if p < n and opens_region(buf[p:p + BLOCK]):
            if after is None:
                return None  # the per-sample reader judges the last sample by what follows
            look = True
        done = p < n or final
    elif p < n:
        if buf[p:p + BLOCK] != ZERO_BLOCK or stop is not None:
            return None  # not a header; or the archive ends before the range does
        done = True
    elif final:
        return None  # truncated: the per-sample reader reports it
    kinds = np.frombuffer(buf, np.uint8, count=n)[heads + 156]
    if not done:  # drop the sample the buffer cuts
        keep = len(heads)
        if keep and (kinds[-1] == _PAX or p > n):
            keep -= 1
        if keep and kinds[keep - 1] == _PAX:
            keep -= 1
        heads, sizes, kinds = heads[:keep], sizes[:keep], kinds[:keep]
    used = p if done else (int(heads[-1]) + BLOCK + padded(int(sizes[-1])) if heads.size else 0)
    if not heads.size:
        return (TokenBlock.of_samples([], done=done), used, np.zeros((0, 100), np.uint8)) if done or not final else None
    parsed = _samples(buf, heads, sizes, kinds, base=base, first=first, done=done, url=url, decode=decode, used=used)
    if look and parsed is not None:
        block, _, names = parsed
        name = names[-1].tobytes().rstrip(b"\0")
        if not after(name[int(block.key_len[-1]):]):  # type: ignore[index, misc]
            return None
    return parsed


def _chain(buf: bytes, limit: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Header offsets from 0, following declared sizes, while below ``limit``; their sizes; and where
    the chain stopped. Whether each is a header the per-sample reader accepts is checked after, as columns.

    The size field of every block below ``limit`` is read as one column first (a block of 11 octal digits: what
    tar writers put there), so a step from header to header is a list lookup rather than an ``int`` parse of the
    field; a field of another form is parsed with ``int`` as it is reached."""
    count = -(-limit // BLOCK)  # the blocks that may open a header
    # bytes 124..134 are the high half of a block's 16th 8-byte word and the low 7 bytes of its 17th: all octal
    # digits when each byte is 0x30 | (0..7); two word columns, where a [count, 11] byte test cost twice as much
    words = np.frombuffer(buf, "<u8", count=count * BLOCK // 8).reshape(count, BLOCK // 8)
    octal = np.flatnonzero(((words[:, 15] & _HIGH4) == _HIGH4_ZEROS) & ((words[:, 16] & _LOW7) == _LOW7_ZEROS))
    digits = np.frombuffer(buf, np.uint8, count=count * BLOCK).reshape(count, BLOCK)[octal, 124:135] - 48
    size = np.zeros(count, dtype=np.int64)
    size[octal] = digits @ _POW8_11  # exact: 8**11 < 2**53
    step = np.zeros(count, dtype=np.int64)
    step[octal] = 1 + (size[octal] + BLOCK - 1) // BLOCK
    steps = step.tolist()
    heads: list[int] = []
    p = 0
    while p < count:
        s = steps[p]
        if not s:
            try:
                size[p] = odd = int(buf[p * BLOCK + 124:p * BLOCK + 135], 8)
            except ValueError:
                break
            s = 1 + (odd + BLOCK - 1) // BLOCK
            if s < 1:
                break  # a negative size would hold the walk in place
        heads.append(p)
        p += s
    at = np.asarray(heads, dtype=np.int64)
    return at * BLOCK, size[at], p * BLOCK


def _samples(buf: bytes, heads: np.ndarray, sizes: np.ndarray, kinds: np.ndarray, *, base: int, first: int,
             done: bool, url: str, decode: DecodeOptions, used: int) -> tuple[TokenBlock, int, np.ndarray] | None:
    blocks = np.frombuffer(buf, np.uint8, count=len(buf) - len(buf) % BLOCK).reshape(-1, BLOCK)
    pax = kinds == _PAX
    regular = (kinds == _REGULAR[0]) | (kinds == _REGULAR[1]) | (kinds == _REGULAR[2])
    rows = blocks[heads // BLOCK]  # one gather of whole rows (a 2-D index array was 20x slower)
    if not (pax | regular).all() or pax[-1] or (pax[:-1] & pax[1:]).any() or not headers_ok(rows, sizes):
        return None
    if not pax_ok(blocks, buf, heads[pax], sizes[pax]):
        return None
    at = np.nonzero(regular)[0]
    members = heads[at]
    before = np.maximum(at - 1, 0)
    firsts = np.where((at > 0) & pax[before], heads[before], members)
    names = member_names(rows[at], decode.tokens_key)
    if names is None:
        return None
    key_len, name_rows = names
    msize = sizes[at]
    if (msize > min(decode.limits.max_member_bytes, decode.limits.max_sample_bytes)).any():
        return None
    npy = npy_members(blocks[members // BLOCK + 1], members + BLOCK, msize)
    if npy is None:
        return None
    dtype, starts, lengths = npy
    tokens = np.frombuffer(buf, dtype=dtype, count=len(buf) // dtype.itemsize)
    if not ids_in_range(tokens, starts, lengths, id_bound(decode.vocab_size)):
        return None
    numbers = np.arange(first, first + len(members), dtype=np.int64)
    offsets = base + firsts
    next_offsets = np.append(offsets[1:], base + used)
    block = TokenBlock(url=url, tokens=tokens, starts=starts, lengths=lengths, offsets=offsets,
                       next_offsets=next_offsets, numbers=numbers, next_numbers=numbers + 1, done=done,
                       key_bytes=buf, key_at=members, key_len=key_len)
    return block, used, name_rows


__all__ = ["CHUNK_BYTES", "parse_tar", "tar_blocks"]
