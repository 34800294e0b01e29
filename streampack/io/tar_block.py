"""webdataset tar shards of ``.npy`` token members, read as :class:`~streampack.io.token_block.TokenBlock` s.

One read of a byte range (at most ``CHUNK_BYTES`` at a time), then whole-array work: every
512-byte block's header fields (ustar magic, octal size and checksum) are parsed at once; a
loop over integers follows the chain of headers (the only per-member Python: ~0.1 µs a
header); checksums, pax records, member names, ``.npy`` headers and token ranges are then
checked as columns. Documents stay where they are in the read buffer: the block's token array
is a view of it (``np.frombuffer``), each document a ``(start, length)`` in it.

What a block accepts is exactly what the per-sample reader (:mod:`streampack.io.tar`) turns
into valid samples with nothing to report, in the common shape: every sample is one regular
member ``<key>.npy`` or ``<key>.<tokens_key>.npy`` (one field name for the whole range),
optionally behind one pax header without ``path`` / ``size`` records (what webdataset's
``TarWriter`` writes: an ``mtime`` record); headers verify (checksum, strict octal fields, no
ustar name prefix, no newline in a name); keys are distinct; sizes are within the limits; the
``.npy`` header is numpy's 1-D form with a native-order integer dtype and agrees with the member
size; every id is in ``[0, vocab bound)``. Anything else — a corrupt or truncated region, an
extension header, a second member, another dtype, an id out of range — ends the blocks before
the sample it is in, and the per-sample reader reads from there (it raises, counts and skips as
always). A range that ends inside the shard is judged by the header after it, as the per-sample
reader judges it.

Measured 2026-11-26 (2-core box shared with other jobs; ``benchmarks/bench_loaders.py`` corpus,
1.8 MB shards of ~423 documents of ~590 int32 ids behind pax headers): ~1.5 ms a shard,
~3.5 µs a document, where the per-sample reader took ~85 µs a document (read 58 + decode 25).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from typing import BinaryIO

import numpy as np

from streampack.errors import DataError
from streampack.io.decode import DecodeOptions
from streampack.io.formats import ShardRange
from streampack.io.limits import MAX_EXTENSION_BYTES, Limits, id_bound
from streampack.io import open as shard_open
from streampack.io.retry import IOStats
from streampack.io.storage import OpenOptions, is_remote, local_path
from streampack.io.tar_header import BLOCK, Unreadable, is_plain_member, parse_pax
from streampack.io.token_block import TokenBlock

CHUNK_BYTES = 8 << 20
"""Bytes read at a time: a block holds the whole samples of one read, so memory stays bounded
for shards of any size (a sample larger than a chunk doubles the next read)."""
_USTAR = np.frombuffer(b"ustar", np.uint8)
_NUMPY = np.frombuffer(b"\x93NUMPY", np.uint8)
_SHAPE_END = np.frombuffer(b",), }", np.uint8)
_NPY_1D = re.compile(rb"\{'descr': '([<>|=][iuf][1248])', 'fortran_order': False, 'shape': \((\d+),\), \}")
_NATIVE = "<" if sys.byteorder == "little" else ">"
_REGULAR = (ord("0"), 0, ord("7"))
_PAX = ord("x")
_ZERO = bytes(BLOCK)
_POW8 = 8 ** np.arange(22, dtype=np.int64)
_POW10 = 10 ** np.arange(19, dtype=np.int64)
_MIX = np.random.default_rng(0x5EED).integers(1, 2**63, 13, dtype=np.uint64) | np.uint64(1)


def tar_blocks(url: str, where: ShardRange, *, decode: DecodeOptions, opts: OpenOptions, streams: list[BinaryIO],
               stats: IOStats | None = None, chunk_bytes: int | None = None) -> Iterator[TokenBlock]:
    """The blocks of ``where`` (see the module docstring); ends early, without a ``done`` block,
    where the per-sample reader must take over (a read failure included: it retries and
    reports it itself)."""
    size = chunk_bytes or CHUNK_BYTES
    end = where.end
    if end is not None and (end - where.start) % BLOCK:
        return
    # one block past a range's end, as the per-sample reader opens it: the header there
    # judges the range's last sample
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
            data = f.read(want)
        except (DataError, OSError):
            return
        pos += len(data)
        final = len(data) < want or pos == limit
        buf = tail + data if tail else data
        parsed = parse_tar(buf, base=base, first=number, end=end, final=final, url=url, tokens_key=decode.tokens_key,
                           limits=decode.limits, bound=id_bound(decode.vocab_size))
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


def _open(url: str, start: int, stop: int | None, opts: OpenOptions,
          stats: IOStats | None) -> tuple[BinaryIO, int | None]:
    """The shard from ``start`` and its size when known: a local file opened plainly (one
    ``read`` per chunk, no copy through the retrying stream: a read error ends the blocks and
    the per-sample reader retries); a remote object through
    :func:`~streampack.io.open.open_shard` (ranged requests, retries)."""
    if is_remote(url):
        return shard_open.open_shard(url, start, stop, opts=opts, stats=stats), None
    f = shard_open._open_local(local_path(url))  # through the module: tests count what it reads
    try:
        size: int | None = os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, ValueError):
        size = None
    f.seek(start)
    return f, size


def parse_tar(buf: bytes, *, base: int, first: int, end: int | None, final: bool, url: str,
              tokens_key: str = "input_ids", limits: Limits = Limits(),
              bound: int = 2**31) -> tuple[TokenBlock, int, np.ndarray] | None:
    """The whole plain samples at the start of ``buf`` (bytes of the shard from header offset
    ``base``, sample number ``first``; ``final``: nothing follows ``buf`` in the stream), the
    bytes they take and their member names; None where the per-sample reader must read."""
    n = len(buf) - len(buf) % BLOCK
    stop = None if end is None else end - base
    heads, sizes, p = _chain(buf, n if stop is None else min(n, stop))
    done = False
    if stop is not None and p > stop:
        return None  # a member crosses the range's end
    if stop is not None and p == stop and p <= n:
        if p < n:
            peek = buf[p:p + BLOCK]
            if peek != _ZERO and not is_plain_member(peek):
                return None  # the per-sample reader judges the last sample by what follows
            done = True
        elif final:
            done = True
    elif p < n:
        if buf[p:p + BLOCK] != _ZERO or stop is not None:
            return None  # not a header; or the archive ends before the range does
        done = True
    elif final:
        return None  # truncated: the per-sample reader reports it
    kinds = [buf[h + 156] for h in heads]
    if not done:  # drop the sample the buffer cuts
        keep = len(heads)
        if keep and (kinds[-1] == _PAX or p > n):
            keep -= 1
        if keep and kinds[keep - 1] == _PAX:
            keep -= 1
        heads, sizes, kinds = heads[:keep], sizes[:keep], kinds[:keep]
    used = p if done else (heads[-1] + BLOCK + ((sizes[-1] + BLOCK - 1) & -BLOCK) if heads else 0)
    if not heads:
        return (_empty(url, done), used, np.zeros((0, 100), np.uint8)) if done or not final else None
    return _samples(buf, np.asarray(heads, dtype=np.int64), np.asarray(sizes, dtype=np.int64),
                    np.asarray(kinds, dtype=np.uint8), base=base, first=first, done=done, url=url,
                    tokens_key=tokens_key, limits=limits, bound=bound, used=used)


def _chain(buf: bytes, limit: int) -> tuple[list[int], list[int], int]:
    """Header offsets from 0, following declared sizes, while below ``limit``; their sizes; and
    where the chain stopped (``limit``, or a block whose size field ``int`` cannot read). The
    loop only follows sizes (~0.6 µs a header on the loaded box): whether each header is a
    ustar header with a size field the per-sample reader accepts is checked after, as columns."""
    heads: list[int] = []
    sizes: list[int] = []
    p = 0
    try:
        while p < limit:
            size = int(buf[p + 124:p + 135], 8)
            heads.append(p)
            sizes.append(size)
            p += BLOCK + ((size + BLOCK - 1) & -BLOCK)
    except ValueError:
        pass
    return heads, sizes, p


def _fields(fields: np.ndarray, digits: int) -> tuple[np.ndarray, bool]:
    """``_octal`` of every row, and whether all are ok; rows written the usual way (``digits``
    octal digits, then NUL or space to the end: tarfile's and GNU tar's form) as one product."""
    low = fields[:, :digits].astype(np.int64) - 48
    rest = fields[:, digits:]
    if ((low >= 0) & (low <= 7)).all() and ((rest == 0) | (rest == 32)).all():
        return low @ _POW8[digits - 1::-1], True
    value, ok = _octal(fields)
    return value, bool(ok.all())


def _octal(fields: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Numeric tar fields (uint8 ``[k, w]``) as ``tar_header._number`` reads them: octal digits
    in one run between blanks (space or NUL), empty = 0; anything else is not ok (base-256,
    8 or 9, a sign, a blank between digits)."""
    digit = (fields >= 48) & (fields <= 55)
    ok = (digit | (fields == 32) | (fields == 0)).all(1)
    runs = digit.copy()
    runs[:, 1:] &= ~digit[:, :-1]
    ok &= runs.sum(1) <= 1
    # in one run, a digit's power of 8 is the number of digits to its right
    right = np.cumsum(digit[:, ::-1], axis=1, dtype=np.int64)[:, ::-1] - 1
    value = (np.where(digit, fields.astype(np.int64) - 48, 0) * _POW8[np.maximum(right, 0)]).sum(1)
    return value, ok


def _headers_ok(rows: np.ndarray, sizes: np.ndarray) -> bool:
    """Every header (``rows``: uint8 ``[k, 512]``) has the ustar magic, the size the chain
    followed written as ``tar_header._number`` reads it, and the checksum
    ``tar_header.parse_header`` checks (unsigned, or the signed sum old writers made)."""
    if not (rows[:, 257:262] == _USTAR).all():
        return False
    size, ok = _fields(rows[:, 124:136], 11)
    if not ok or not (size == sizes).all():
        return False
    stored, ok = _fields(rows[:, 148:156], 6)
    field = rows[:, 148:156].sum(1, dtype=np.int64)
    unsigned = rows.sum(1, dtype=np.uint32).astype(np.int64) - field + 256
    if not ok:
        return False
    if (stored == unsigned).all():
        return True
    high = (rows >= 128).sum(1) - (rows[:, 148:156] >= 128).sum(1)
    return bool(((stored == unsigned) | (stored == unsigned - 256 * high)).all())


def _pax_ok(blocks: np.ndarray, buf: bytes, pax: np.ndarray, sizes: np.ndarray) -> bool:
    """Every pax header well formed (as ``parse_pax`` reads it) with no ``path`` / ``size``
    record (those rename or resize the member: the per-sample reader applies them). Headers
    of one record are checked as columns, one group per size (webdataset writes one ``mtime``
    record, whose length varies with the digits of the time); any other shape record by record."""
    if not pax.size:
        return True
    if (sizes > MAX_EXTENSION_BYTES).any() or (sizes < 1).any():
        return False
    starts = pax + BLOCK
    for size in sorted(set(sizes.tolist())):
        at = starts[sizes == size]
        if size > BLOCK or not _one_record_each(blocks, buf, at, size):
            for a in at.tolist():
                if _records(buf[a:a + size]) is None:
                    return False
    return True


def _one_record_each(blocks: np.ndarray, buf: bytes, at: np.ndarray, size: int) -> bool:
    """Whether the ``size``-byte pax data at each of ``at`` is one record with the key of the
    first (a well-formed one): the same ``"<size> key="`` prefix, one newline, at the end."""
    first = _records(buf[int(at[0]):int(at[0]) + size])
    if first is None or len(first) != 1:
        return False
    rows = blocks[at // BLOCK, :size]
    prefix = buf.index(b"=", int(at[0])) - int(at[0]) + 1
    return bool((rows[:, :prefix] == rows[0, :prefix]).all() and (rows[:, size - 1] == 10).all()
                and not (rows[:, prefix:size - 1] == 10).any())


def _records(data: bytes) -> dict[str, str] | None:
    try:
        records = parse_pax(data, first=0, at=0)
    except (Unreadable, ValueError):
        return None
    return None if "path" in records or "size" in records else records


def _samples(buf: bytes, heads: np.ndarray, sizes: np.ndarray, kinds: np.ndarray, *, base: int, first: int,
             done: bool, url: str, tokens_key: str, limits: Limits, bound: int,
             used: int) -> tuple[TokenBlock, int, np.ndarray] | None:
    blocks = np.frombuffer(buf, np.uint8, count=len(buf) - len(buf) % BLOCK).reshape(-1, BLOCK)
    pax = kinds == _PAX
    regular = (kinds == _REGULAR[0]) | (kinds == _REGULAR[1]) | (kinds == _REGULAR[2])
    rows = blocks[heads // BLOCK]  # one gather of whole rows (a 2-D index array was 20x slower)
    if not (pax | regular).all() or pax[-1] or (pax[:-1] & pax[1:]).any() or not _headers_ok(rows, sizes):
        return None
    if not _pax_ok(blocks, buf, heads[pax], sizes[pax]):
        return None
    at = np.nonzero(regular)[0]
    members = heads[at]
    before = np.maximum(at - 1, 0)
    firsts = np.where((at > 0) & pax[before], heads[before], members)
    names = _names(rows[at], tokens_key)
    if names is None:
        return None
    key_len, name_rows = names
    msize = sizes[at]
    if (msize > min(limits.max_member_bytes, limits.max_sample_bytes)).any():
        return None
    npy = _npy(blocks[members // BLOCK + 1], members + BLOCK, msize)
    if npy is None:
        return None
    dtype, starts, lengths = npy
    tokens = np.frombuffer(buf, dtype=dtype, count=len(buf) // dtype.itemsize)
    if not _ids_ok(tokens, starts, lengths, bound):
        return None
    numbers = np.arange(first, first + len(members), dtype=np.int64)
    offsets = base + firsts
    next_offsets = np.append(offsets[1:], base + used)
    block = TokenBlock(url=url, tokens=tokens, starts=starts, lengths=lengths, offsets=offsets,
                       next_offsets=next_offsets, numbers=numbers, next_numbers=numbers + 1, done=done,
                       key_bytes=buf, key_at=members, key_len=key_len)
    return block, used, name_rows


def _names(headers: np.ndarray, tokens_key: str) -> tuple[np.ndarray, np.ndarray] | None:
    """From the members' header rows (uint8 ``[n, 512]``): each member's key length, and the names (uint8 ``[n, 100]``, NUL-padded), when every name is ``<key>.<field>``
    with one token field for all (webdataset's split: the key ends at the first dot of the
    basename), the keys are distinct and no name has a ustar prefix or a newline."""
    rows = headers[:, :100]
    if (headers[:, 345] != 0).any():
        return None
    count = len(headers)
    same = _same_length(rows, tokens_key)
    if same is not None:
        return same
    nul = rows == 0
    length = np.where(nul.any(1), nul.argmax(1), 100)
    first = bytes(rows[0, :int(length[0])])
    base_name = first.rsplit(b"/", 1)[-1]
    if b"." not in base_name:
        return None
    field = base_name.split(b".", 1)[1]
    if field.decode("utf-8", "surrogateescape") not in ("npy", f"{tokens_key}.npy"):
        return None
    suffix = np.frombuffer(b"." + field, np.uint8)
    key_len = length - suffix.size
    if (key_len < 1).any():
        return None
    cols = np.arange(100)
    tail = rows[np.arange(count)[:, None], np.minimum(key_len[:, None] + np.arange(suffix.size), 99)]
    if not (tail == suffix).all():
        return None
    in_key = cols < key_len[:, None]
    slash = (rows == ord("/")) & in_key
    last_slash = np.where(slash.any(1), 99 - np.argmax(slash[:, ::-1], 1), -1)
    dots = (rows == ord(".")) & in_key & (cols > last_slash[:, None])
    if dots.any() or (last_slash >= key_len - 1).any() or ((rows == 10) & (cols < length[:, None])).any():
        return None
    clean = np.where(cols < length[:, None], rows, 0).astype(np.uint8)
    if not _distinct(clean):
        return None
    return key_len.astype(np.int64), clean


def _same_length(rows: np.ndarray, tokens_key: str) -> tuple[np.ndarray, np.ndarray] | None:
    """``_names`` for the usual shard — every name ``<key>.<field>`` of one length, no ``/`` and
    no ``.`` in the key (webdataset's fixed-width keys) — on the key columns alone; None
    when the names are not all of that shape (then ``_names`` reads them in full)."""
    first = bytes(rows[0])
    n = first.find(b"\0")
    n = 100 if n < 0 else n
    dot = first.find(b".", 0, n)
    if dot < 1 or first[dot + 1:n].decode("utf-8", "surrogateescape") not in ("npy", f"{tokens_key}.npy"):
        return None
    keys = rows[:, :dot]
    if n < 100 and not (rows[:, n] == 0).all():
        return None
    if not (rows[:, dot:n] == rows[0, dot:n]).all() or (keys == 0).any() or (keys == 46).any() or (keys == 47).any():
        return None  # another length, field or a dot / slash in a key: the full reading
    if (keys == 10).any() or not _distinct(keys):
        return None
    clean = np.zeros((rows.shape[0], 100), dtype=np.uint8)
    clean[:, :n] = rows[:, :n]
    return np.full(rows.shape[0], dot, dtype=np.int64), clean


def _distinct(names: np.ndarray) -> bool:
    """Whether the rows of ``names`` (uint8 ``[n, 100]``) differ pairwise: a 64-bit hash of each
    row, sorted; two equal hashes count as a repeat (the per-sample reader then decides; a
    false alarm costs speed, never a wrong verdict). ``np.unique`` on 100-byte rows cost ~1 ms
    a shard."""
    words = np.zeros((names.shape[0], 13), dtype=np.uint64)
    words.view(np.uint8)[:, :names.shape[1]] = names
    mixed = (words * _MIX).sum(1) if names.shape[0] else words[:, 0]
    ordered = np.sort(mixed ^ (mixed >> np.uint64(29)))
    return not (ordered[1:] == ordered[:-1]).any()


def _npy(first: np.ndarray, data: np.ndarray, msize: np.ndarray) -> tuple[np.dtype, np.ndarray, np.ndarray] | None:
    """The token dtype and each document's element start and length, when every member (its
    first data block ``first``, uint8 ``[n, 512]``, at byte ``data``) is a 1-D native-order
    integer ``.npy`` in numpy's own header form (what ``npy._fast_npy`` reads), with the header
    in that block, of exactly its member's size."""
    if (msize < 16).any():
        return None
    head = first[:, :12]
    if not (head[:, :6] == _NUMPY).all() or not (head[:, 6] == head[0, 6]).all():
        return None
    start = 10 if head[0, 6] == 1 else 12
    hlen = head[:, 8].astype(np.int64) + 256 * head[:, 9].astype(np.int64)
    if start == 12:
        hlen += (head[:, 10].astype(np.int64) << 16) + (head[:, 11].astype(np.int64) << 24)
    h = int(hlen[0])
    if not (hlen == h).all() or (msize < start + h).any() or start + h > BLOCK:
        return None
    text = first[:, start:start + h]
    m = _NPY_1D.match(bytes(text[0]))
    if m is None:
        return None
    descr = m.group(1).decode()
    if descr[0] not in (_NATIVE, "|", "=") or descr[1] not in "iu":
        return None
    dtype = np.dtype(descr)
    at = m.start(2)
    width = min(20, h - at)
    if not (text[:, :at] == text[0, :at]).all() or width < 6:
        return None
    digits = text[:, at:at + width]
    is_digit = (digits >= 48) & (digits <= 57)
    run = np.where(is_digit.all(1), width, is_digit.argmin(1))
    if (run < 1).any() or (run > width - _SHAPE_END.size).any():
        return None
    close = digits[np.arange(len(data))[:, None], run[:, None] + np.arange(_SHAPE_END.size)]
    if not (close == _SHAPE_END).all():
        return None
    if (run > 18).any():
        return None
    place = run[:, None] - 1 - np.arange(width)
    count = (np.where(place >= 0, digits.astype(np.int64) - 48, 0) * _POW10[np.maximum(place, 0)]).sum(1)
    first_id = data + start + h
    if (count < 1).any() or (msize != start + h + count * dtype.itemsize).any() or (first_id % dtype.itemsize).any():
        return None
    return dtype, first_id // dtype.itemsize, count


def _ids_ok(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, bound: int) -> bool:
    """Every id of every document in ``[0, bound)``: one reduction per document segment, in one
    call (``reduceat`` over the interleaved starts and ends; the gaps between are headers)."""
    ends = starts + lengths
    cut = np.empty(2 * starts.size, dtype=np.int64)
    cut[0::2], cut[1::2] = starts, ends
    if cut[-1] >= tokens.size:
        cut = cut[:-1]
    high = np.maximum.reduceat(tokens, cut)[0::2]
    if tokens.dtype.kind == "u":
        return bool((high < bound).all())
    low = np.minimum.reduceat(tokens, cut)[0::2]
    return bool((high < bound).all() and (low >= 0).all())


def _empty(url: str, done: bool) -> TokenBlock:
    none = np.zeros(0, dtype=np.int64)
    return TokenBlock(url=url, tokens=none, starts=none, lengths=none, offsets=none, next_offsets=none,
                      numbers=none, next_numbers=none, done=done)


__all__ = ["CHUNK_BYTES", "parse_tar", "tar_blocks"]
