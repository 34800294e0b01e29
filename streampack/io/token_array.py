"""Flat token arrays (OLMo / Dolma layout) read in place: one ``.npy`` or raw ``.bin`` of ids, a sample per document.

A shard is one flat array of token ids: a ``.npy`` with numpy's header (1-D, an integer dtype), a ``.npy`` without
one (a raw memmap, as OLMo's and Dolma's tokenizers write them) or a raw ``.bin``; the last two need
``token_dtype``. Its documents are found one of two ways:

- **at the EOS id** (``eos_id`` given): a document runs up to and including the next ``eos_id``; ids after the last
  one are a last document. The position of a document (what an index, a range and a resume state hold) is the
  array index of its first id, so a range is read from anywhere with no index.
- **by an offsets file** (``eos_id`` None): beside ``name.npy`` / ``name.bin`` lies ``name.offsets.npy``, a ``.npy``
  of ``n + 1`` non-decreasing integers from 0 to the array's length; document ``d`` is ids
  ``[offsets[d], offsets[d + 1])``. A position is the document number, as a Megatron document's is. A name ending
  ``.offsets.npy`` is never a shard, so listing a directory does not take it for one.

**What one range costs a reader**: a stat of the array and one read of its first 16 KiB (the header), then its ids
in reads of at most :data:`CHUNK_BYTES`, never the array outside the range; with an offsets file also a stat, a
header read and a read of the last offset of that file and, per :data:`DOCS_PER_SLICE` documents, one read of their
offsets (8 bytes a document). The per-shard index
(:func:`document_index`) is one block-wise scan of the whole array (EOS) or one read of the offsets file; memory
12 bytes a document. Hostile input (a header that lies about its size, a truncated array, offsets out of order or
past the end) is a ``DataError`` naming the file and the document, never the content.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from streampack.errors import DataError
from streampack.io import storage
from streampack.io.decode import BAD_LENGTH, DecodeOptions, Item, make_sample
from streampack.io.limits import documents_in_bound, id_bound
from streampack.io.npy import HEADER_ERRORS, read_header
from streampack.io.open import read_range
from streampack.io.retry import IOStats
from streampack.io.storage import OpenOptions
from streampack.io.token_block import TokenBlock, byte_runs

TOKEN_DTYPES: tuple[str, ...] = ("uint8", "int8", "int16", "uint16", "int32", "uint32", "int64")
"""``token_dtype`` values (little-endian): the integer types token ids are stored in."""
OFFSETS_SUFFIX = ".offsets.npy"
"""``name.npy`` / ``name.bin`` -> ``name.offsets.npy``: where the offsets file of an array lies."""
NPY_MAGIC = b"\x93NUMPY"
HEADER_BYTES = 16 << 10
"""Bytes read to parse a ``.npy`` header (numpy writes them under 4 KiB; its safe reader caps them at 10 KB)."""
CHUNK_BYTES = 4 << 20
"""Bytes of ids per read: a block holds the documents of one read (4 MiB: 2M uint16 ids)."""
DOCS_PER_SLICE = 65_536
"""Documents whose offsets are read at once (512 KiB of offsets)."""


def offsets_url(url: str) -> str:
    """The offsets file beside the array ``url`` (a remote URL's query string kept)."""
    path, sep, query = url.partition("?")
    stem = path[:-4] if path.endswith((".npy", ".bin")) else path
    return stem + OFFSETS_SUFFIX + sep + query


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """Where the ids of one array file lie."""

    dtype: np.dtype
    data_at: int
    """Byte offset of the first id (the header's size; 0 for a raw file)."""
    declared: int
    """Ids the header declares (a raw file: its bytes over the item size, rounded up)."""
    ids: int
    """Whole ids the file holds (fewer than ``declared``: truncated)."""


def parse_layout(raw: bytes, size: int, url: str, token_dtype: str | None, *, what: str = "token array") -> Layout:
    """The layout of a file of ``size`` bytes starting ``raw``: a ``.npy`` header is parsed without evaluating it
    (1-D, an integer dtype of at most 8 bytes, agreeing with ``token_dtype`` when given); a file without one is raw
    ``token_dtype`` ids. More bytes than a header declares is ``corrupt_shard`` (fewer: truncated, read up to the
    cut)."""
    if not raw.startswith(NPY_MAGIC):
        if token_dtype is None:
            raise DataError("bad_dtype", f"{what} has no numpy header (a raw array): set ReadOptions(token_dtype=...) "
                            f"to one of {TOKEN_DTYPES}", url=url, value=size)
        dtype = np.dtype(token_dtype).newbyteorder("<")
        return Layout(dtype=dtype, data_at=0, declared=-(-size // dtype.itemsize), ids=size // dtype.itemsize)
    buf = io.BytesIO(raw)
    try:
        shape, _, dtype = read_header(buf)
    except HEADER_ERRORS as e:
        # numpy's message quotes the header: name the failure only, never the file's bytes
        raise DataError("corrupt_shard", f"{what}: unreadable numpy header ({type(e).__name__})", url=url,
                        value=size) from None
    if dtype.kind not in "iu" or dtype.itemsize > 8 or len(shape) != 1:
        raise DataError("bad_dtype", f"{what} holds {dtype}{list(shape)}: want a 1-D integer array", url=url,
                        value=str(dtype))
    if token_dtype is not None and dtype.newbyteorder("=") != np.dtype(token_dtype):
        raise DataError("bad_dtype", f"{what}'s header says {dtype}, token_dtype={token_dtype}", url=url,
                        value=str(dtype))
    data_at, declared = buf.tell(), int(shape[0])
    if size > data_at + declared * dtype.itemsize:
        raise DataError("corrupt_shard", f"{what} holds {size} bytes, its header declares {declared} ids of "
                        f"{dtype} after {data_at} header bytes ({data_at + declared * dtype.itemsize}): not what the "
                        f"header says", url=url, value=size)
    return Layout(dtype=dtype, data_at=data_at, declared=declared, ids=(size - data_at) // dtype.itemsize)


def _opened(url: str, token_dtype: str | None, opts: OpenOptions, stats: IOStats | None, what: str) -> Layout:
    size = storage.identity(url, opts, stats).size
    if size is None:
        raise DataError("corrupt_shard", f"the store does not say the size of this {what}", url=url, value=None)
    return parse_layout(read_range(url, 0, min(size, HEADER_BYTES), opts, stats), size, url, token_dtype, what=what)


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """Consecutive documents read together, or one refused document (``error`` set, ``ids`` empty)."""

    ids: np.ndarray
    """The documents' ids back to back (native byte order)."""
    lengths: np.ndarray
    """int64 ``[n]``: ids of each document."""
    positions: np.ndarray
    """int64 ``[n]``: position of each document (EOS: array index of its first id; offsets: its number)."""
    next_positions: np.ndarray
    """int64 ``[n]``: position of the document after each."""
    first: int
    """Number of the first document."""
    error: DataError | None = None


class TokenArray:
    """One array opened for ranged reads (its header, and its offsets file's, read once)."""

    def __init__(self, url: str, decode: DecodeOptions, opts: OpenOptions, stats: IOStats | None = None) -> None:
        self.url, self.opts, self.stats, self.eos = url, opts, stats, decode.eos_id
        self.limit = decode.limits.max_sample_bytes
        self.layout = _opened(url, decode.token_dtype, opts, stats, "token array")
        self.width = self.layout.dtype.itemsize
        self.offsets_url: str | None = None
        if self.eos is None:
            self.offsets_url = offsets_url(url)
            try:
                off = _opened(self.offsets_url, None, opts, stats, "offsets file")
            except DataError as e:
                if e.reason != "missing_shard":
                    raise
                raise DataError("missing_shard", f"no eos_id is set and there is no offsets file {self.offsets_url} "
                                f"beside the array: set ReadOptions(eos_id=...) or write that file", url=url,
                                value=self.offsets_url) from None
            if off.ids != off.declared or off.declared < 1:
                raise DataError("corrupt_shard", f"offsets file {self.offsets_url} holds {off.ids} of its "
                                f"{off.declared} declared offsets (want at least 1: the array's start)", url=url,
                                value=off.ids)
            self.offsets_layout = off
            self.documents = off.declared - 1
            last = int(self._offsets(self.documents, self.documents + 1)[0])
            if last < self.layout.declared:
                raise DataError("corrupt_shard", f"the offsets file ends at id {last}, the array holds "
                                f"{self.layout.declared}: not the offsets of this array", url=url, value=last)

    @property
    def stop(self) -> int:
        """The position past the last document."""
        return self.layout.declared if self.eos is not None else self.documents

    def ids_at(self, lo: int, hi: int) -> np.ndarray:
        """Ids ``[lo, hi)`` in one ranged read."""
        w, at = self.width, self.layout.data_at
        raw = read_range(self.url, at + lo * w, at + hi * w, self.opts, self.stats)
        return np.frombuffer(raw, self.layout.dtype).astype(self.layout.dtype.newbyteorder("="), copy=False)

    def _offsets(self, lo: int, hi: int) -> np.ndarray:
        off = self.offsets_layout
        assert self.offsets_url is not None
        raw = read_range(self.offsets_url, off.data_at + lo * off.dtype.itemsize, off.data_at + hi * off.dtype.itemsize,
                    self.opts, self.stats)
        values = np.frombuffer(raw, off.dtype)
        if off.dtype.kind == "u" and values.size and int(values.max()) > 2**62:
            values = np.minimum(values, 2**62)  # past any array: refused below as past the end
        return values.astype(np.int64)

    def bad(self, doc: int, reason: str, why: str, value: int) -> DataError:
        return DataError(reason, f"document {doc}: {why}", url=self.url, key=str(doc), value=value)

    def offsets(self, lo: int, hi: int) -> np.ndarray:
        """int64 ``[hi - lo + 1]``: where documents ``[lo, hi)`` start, and where the last ends, checked (in order,
        from 0, within the declared array)."""
        got = self._offsets(lo, hi + 1)
        steps = np.flatnonzero(got[1:] < got[:-1])
        if lo == 0 and got[0] != 0:
            raise self.bad(0, "corrupt_shard", f"the offsets file starts at {int(got[0])}, not 0", int(got[0]))
        if steps.size:
            d = lo + int(steps[0])
            raise self.bad(d, "corrupt_shard", f"offsets {got[d - lo:d - lo + 2].tolist()} are out of order",
                           int(got[d - lo + 1]))
        past = np.flatnonzero(got > self.layout.declared)
        if past.size:
            d = lo + max(int(past[0]) - 1, 0)
            raise self.bad(d, "corrupt_shard", f"ends at id {int(got[past[0]])}, past the end of the array "
                           f"({self.layout.declared} ids)", int(got[past[0]]))
        return got

    def refused(self, doc: int, start: int, length: int) -> DataError | None:
        """Why document ``doc`` of ``length`` ids from array index ``start`` is not read: past the end of a truncated
        array, or over ``max_sample_bytes`` (its ids are not held)."""
        if start + length > self.layout.ids:
            return self.bad(doc, "corrupt_shard", f"ids [{start}, {start + length}) lie past the end of the file "
                            f"({self.layout.ids} whole ids of the {self.layout.declared} declared): truncated array",
                            start + length)
        if length * self.width > self.limit:
            return self.bad(doc, "sample_too_large", f"{length * self.width} bytes, over max_sample_bytes="
                            f"{self.limit}", length * self.width)
        return None

    def readable(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Where :meth:`refused` finds nothing, for many documents at once (one comparison each, not a call)."""
        return (starts + lengths <= self.layout.ids) & (lengths * self.width <= self.limit)

    def runs(self, start: int, first: int, end: int | None) -> Iterator[Run]:
        """The documents from position ``start`` (number ``first``) up to position ``end`` (None: the last)."""
        stop = self.stop if end is None else min(end, self.stop)
        if self.eos is None:
            yield from self._numbered_runs(start, stop)
        else:
            yield from self._eos_runs(start, first, stop)

    def _numbered_runs(self, start: int, stop: int) -> Iterator[Run]:
        at = start
        while at < stop:
            hi = min(stop, at + DOCS_PER_SLICE)
            off = self.offsets(at, hi)
            lengths = np.diff(off)
            readable = self.readable(off[:-1], lengths)
            for i, j in byte_runs(lengths * self.width, readable, CHUNK_BYTES):
                if not readable[i]:
                    err = self.refused(at + i, int(off[i]), int(lengths[i]))
                    assert err is not None  # readable() is refused()'s rule
                    yield _refused(err, at + i, at + i, at + i + 1)
                    continue
                docs = np.arange(at + i, at + j, dtype=np.int64)
                yield Run(ids=self.ids_at(int(off[i]), int(off[j])), lengths=lengths[i:j].astype(np.int64),
                          positions=docs, next_positions=docs + 1, first=at + i)
            at = hi

    def _eos_runs(self, start: int, first: int, stop: int) -> Iterator[Run]:
        """Documents split at the EOS id, read ``CHUNK_BYTES`` at a time; a document's head carried from one read
        to the next is held only while it is within ``max_sample_bytes``."""
        eos, per_read = self.eos, max(CHUNK_BYTES // self.width, 1)
        pos, number, doc_start = start, first, start
        head: list[np.ndarray] = []
        head_len = 0
        while pos < stop:
            hi = min(stop, pos + per_read, self.layout.ids)
            if hi <= pos:
                break  # the rest of the range lies past the cut of a truncated array
            chunk = self.ids_at(pos, hi)
            cuts = np.flatnonzero(chunk == eos) + 1
            if hi == stop and (not cuts.size or cuts[-1] != chunk.size):
                cuts = np.append(cuts, chunk.size)  # the range (or the array) ends a document
            if not cuts.size:
                head_len += chunk.size
                head = head + [chunk] if head_len * self.width <= self.limit else []
                pos = hi
                continue
            lengths = np.diff(cuts, prepend=0).astype(np.int64)
            lengths[0] += head_len
            positions = np.concatenate([[doc_start], pos + cuts[:-1]]).astype(np.int64)
            body = chunk[:cuts[-1]]
            ids = np.concatenate([*head, body]) if head else body
            if head_len and not head:  # the first document outgrew the limit: its ids were not kept
                err = self.refused(number, doc_start, int(lengths[0]))
                assert err is not None
                yield _refused(err, number, doc_start, pos + int(cuts[0]))
                ids, lengths, positions, number = body[int(cuts[0]):], lengths[1:], positions[1:], number + 1
            yield from self._split(ids, lengths, positions, number)
            number += lengths.size
            tail = chunk[cuts[-1]:]
            doc_start, head, head_len = pos + int(cuts[-1]), [tail] if tail.size else [], int(tail.size)
            pos = hi
        if pos < stop:  # truncated inside the range: the document that reaches the cut is refused
            err = self.refused(number, doc_start, self.layout.declared - doc_start)
            yield _refused(err or self.bad(number, "corrupt_shard", "truncated array", doc_start), number, doc_start,
                           stop)

    def _split(self, ids: np.ndarray, lengths: np.ndarray, positions: np.ndarray, number: int) -> Iterator[Run]:
        """Runs of the whole documents of one read, a document over ``max_sample_bytes`` alone and refused."""
        if not lengths.size:
            return
        nexts = np.append(positions[1:], positions[-1] + lengths[-1])
        over = np.flatnonzero(lengths * self.width > self.limit)
        cum = np.concatenate([[0], np.cumsum(lengths)])
        i = 0
        for k in [*over.tolist(), lengths.size]:
            if k > i:
                yield Run(ids=ids[cum[i]:cum[k]], lengths=lengths[i:k], positions=positions[i:k],
                          next_positions=nexts[i:k], first=number + i)
            if k < lengths.size:
                err = self.refused(number + k, int(positions[k]), int(lengths[k]))
                assert err is not None
                yield _refused(err, number + k, int(positions[k]), int(nexts[k]))
            i = k + 1


def _refused(err: DataError, number: int, position: int, next_position: int) -> Run:
    return Run(ids=np.zeros(0, np.int64), lengths=np.zeros(1, np.int64), positions=np.array([position], np.int64),
               next_positions=np.array([next_position], np.int64), first=number, error=err)


def document_index(url: str, decode: DecodeOptions, opts: OpenOptions,
                   stats: IOStats | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """``(positions, lengths, end)`` of every document for a shard index: int64 positions, int32 token counts
    (:data:`BAD_LENGTH` where the reader refuses the document: over ``max_sample_bytes``, past the end of a truncated
    array) and the position past the last. At the EOS id one block-wise scan of the array; with an offsets file the
    offsets read whole and checked (a broken one raises naming the first document it breaks)."""
    array = TokenArray(url, decode, opts, stats)
    positions, lengths = [], []
    for run in array.runs(0, 0, None):
        positions.append(run.positions)
        lengths.append(np.full(1, BAD_LENGTH, np.int64) if run.error is not None else run.lengths)
    pos = np.concatenate(positions) if positions else np.zeros(0, np.int64)
    lens = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    return pos.astype(np.int64), np.minimum(lens, 2**31 - 1).astype(np.int32), array.stop


def iter_token_array_items(url: str, decode: DecodeOptions, *, opts: OpenOptions, start: int, first: int,
                           end: int | None, stats: IOStats | None = None) -> Iterator[Item]:
    """Decoded samples of the documents from position ``start`` (number ``first``) to ``end``: one empty, over
    ``max_sample_bytes``, with an id out of range or past the end of a truncated array is an ``Item`` with its error;
    a broken header or offsets file raises."""
    array = TokenArray(url, decode, opts, stats)
    stop = array.stop if end is None else min(end, array.stop)
    for run in array.runs(start, first, end):
        if run.error is not None:
            nxt = int(run.next_positions[0])
            yield Item(None, run.error, nxt, run.first + 1, nxt >= stop)
            continue
        cut = np.concatenate([[0], np.cumsum(run.lengths)])
        for k in range(run.lengths.size):
            doc, nxt = run.first + k, int(run.next_positions[k])
            try:
                sample = make_sample(url=url, key=str(doc), tokens=run.ids[cut[k]:cut[k + 1]],
                                     vocab_size=decode.vocab_size)
                yield Item(sample, None, nxt, doc + 1, nxt >= stop)
            except DataError as e:
                yield Item(None, e, nxt, doc + 1, nxt >= stop)


def token_array_blocks(url: str, start: int, first: int, end: int | None, *, decode: DecodeOptions,
                       opts: OpenOptions, stats: IOStats | None = None) -> Iterator[TokenBlock]:
    """The documents from ``start`` as blocks, one per read; at the first document the per-sample reader would not
    deliver as a plain sample (empty, over the limits, an id out of range, past the end) the blocks end, and that
    reader reads on from it."""
    array = TokenArray(url, decode, opts, stats)
    stop = array.stop if end is None else min(end, array.stop)
    bound = id_bound(decode.vocab_size)
    if start >= stop:
        empty = np.zeros(0, np.int64)
        yield _block(url, empty, Run(ids=empty, lengths=empty, positions=empty, next_positions=empty, first=first), 0,
                     done=True)
        return
    for run in array.runs(start, first, end):
        if run.error is not None:
            return
        good = run.lengths.size if (run.lengths >= 1).all() else int(np.argmin(run.lengths >= 1))
        ids = run.ids[:int(run.lengths[:good].sum())]
        plain = documents_in_bound(ids, run.lengths[:good], bound)
        if plain < good:  # the documents before the one holding the first bad id are plain
            good, ids = plain, ids[:int(run.lengths[:plain].sum())]
        if good:
            yield _block(url, ids, run, good, done=int(run.next_positions[good - 1]) >= stop)
        if good < run.lengths.size:
            return


def _block(url: str, ids: np.ndarray, run: Run, n: int, *, done: bool) -> TokenBlock:
    lengths = run.lengths[:n].astype(np.int64)
    starts = np.zeros(n, np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    numbers = np.arange(run.first, run.first + n, dtype=np.int64)
    return TokenBlock(url=url, tokens=ids, starts=starts, lengths=lengths, offsets=run.positions[:n],
                      next_offsets=run.next_positions[:n], numbers=numbers, next_numbers=numbers + 1, done=done)


__all__ = ["CHUNK_BYTES", "DOCS_PER_SLICE", "OFFSETS_SUFFIX", "TOKEN_DTYPES", "Layout", "Run", "TokenArray",
           "document_index", "iter_token_array_items", "offsets_url", "parse_layout", "token_array_blocks"]
