"""Megatron-core indexed datasets (``prefix.bin`` + ``prefix.idx``) read in place, a sample per Megatron document
(or per sequence: ``megatron_sample="sequence"``, a sequence read as a document of one sequence).

A shard is named by its ``.idx`` URL; its ``.bin`` is the same URL with ``.bin`` for ``.idx``. The ``.idx`` (what
megatron-core's ``IndexedDatasetBuilder`` writes, version 1, little-endian) is::

    magic            9 bytes   b"MMIDIDX\\x00\\x00"
    version          uint64    1
    dtype code       uint8     1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16 (6 / 7 are floats: refused)
    S                uint64    number of sequences
    D                uint64    number of document indices (documents + 1)
    lengths          int32[S]  tokens per sequence
    pointers         int64[S]  byte offset of each sequence in the .bin
    document_indices int64[D]  document d is sequences [document_indices[d], document_indices[d + 1])

and the ``.bin`` is every sequence's ids back to back. A document's sequences are contiguous, so document ``d`` is one
byte range of the ``.bin``; the position of a sample (what an index, a range and a resume state hold) is its document
number, as parquet's is its row. A multimodal index (an int8 mode per sequence after the document indices) is refused.

**What one range costs a reader**: a stat of the ``.idx`` and of the ``.bin``, three small ranged reads of the
``.idx`` (its 34-byte header, the last sequence's length and pointer, which fix the ``.bin``'s size), then per 65,536
documents three more (their document indices, their sequences' lengths, their pointers: 8 bytes a document, 12 a
sequence) and the documents' ``.bin`` bytes in reads of at most :data:`CHUNK_BYTES`; never the whole ``.bin``, never
the ``.idx`` outside the range.
The per-shard index (:func:`document_lengths`) reads the whole ``.idx`` once (12 bytes a sequence + 8 a document) and
checks every pointer against the lengths, so a corrupt ``.idx`` is refused when the data set is indexed, naming the
first document it breaks. A ``.bin`` whose size is not exactly what the ``.idx`` says is refused (longer: a stale
pair) or read up to the cut (the documents past it are ``DataError`` s naming each); one rewritten with the same size
is refused by the pair's identity (:func:`streampack.io.shard_identity.identity`: both files' sizes and tags).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from streampack.errors import DataError
from streampack.io import storage
from streampack.io.decode import BAD_LENGTH, DecodeOptions, Item, make_sample
from streampack.io.limits import documents_in_bound, id_bound
from streampack.io.open import read_range
from streampack.io.retry import IOStats
from streampack.io.storage import OpenOptions
from streampack.io.token_block import TokenBlock, byte_runs

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")
"""magic, version, dtype code, sequence count, document-index count: 34 bytes."""
DTYPES: dict[int, np.dtype] = {1: np.dtype("u1"), 2: np.dtype("i1"), 3: np.dtype("<i2"), 4: np.dtype("<i4"),
                               5: np.dtype("<i8"), 8: np.dtype("<u2")}
"""megatron-core's ``DType`` codes of integer ids (6 float64 and 7 float32 hold no token ids)."""
CHUNK_BYTES = 4 << 20
"""``.bin`` bytes per read: a block holds the documents of one read (4 MiB: 1M int32 ids)."""
DOCS_PER_SLICE = 65_536
"""Documents whose index entries are read at once (~1.3 MiB of ``.idx`` at one sequence a document)."""


def bin_url(idx_url: str) -> str:
    """The ``.bin`` beside an ``.idx`` (a remote URL's query string kept)."""
    path, sep, query = idx_url.partition("?")
    if not path.endswith(".idx"):
        raise ValueError(f"a Megatron shard is named by its .idx URL, got {idx_url!r}")
    return path[:-4] + ".bin" + sep + query


@dataclass(frozen=True, slots=True, kw_only=True)
class Header:
    """The fixed part of an ``.idx`` and where its arrays sit."""

    dtype: np.dtype
    sequences: int
    documents: int
    """Number of documents (the index holds one more document index)."""

    @property
    def lengths_at(self) -> int:
        return HEADER.size

    @property
    def pointers_at(self) -> int:
        return HEADER.size + 4 * self.sequences

    @property
    def doc_index_at(self) -> int:
        return HEADER.size + 12 * self.sequences

    @property
    def size(self) -> int:
        """Bytes of the whole ``.idx``."""
        return self.doc_index_at + 8 * (self.documents + 1)


def parse_header(raw: bytes, size: int, url: str) -> Header:
    """The header of an ``.idx`` of ``size`` bytes starting ``raw``; a file that is not a text Megatron index
    or whose size disagrees with its counts raises ``DataError("corrupt_shard")``."""
    if len(raw) < HEADER.size or size < HEADER.size:
        raise DataError("corrupt_shard", f"{size}-byte file is shorter than a Megatron index header", url=url,
                        value=size)
    magic, version, code, sequences, count = HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise DataError("corrupt_shard", "not a Megatron index (bad magic)", url=url, value=magic[:9].hex())
    if version != 1:
        raise DataError("corrupt_shard", f"Megatron index version {version}, want 1", url=url, value=version)
    if code not in DTYPES:
        raise DataError("bad_dtype", f"Megatron dtype code {code} is not an integer token type "
                        f"(want one of {sorted(DTYPES)})", url=url, value=code)
    if count < 1:
        raise DataError("corrupt_shard", "Megatron index holds no document indices", url=url, value=count)
    header = Header(dtype=DTYPES[code], sequences=sequences, documents=count - 1)
    if size == header.size + sequences and sequences:
        raise DataError("corrupt_shard", "multimodal Megatron index (a mode per sequence) is not read: only token "
                        "sequences are", url=url, value=size)
    if size != header.size:
        raise DataError("corrupt_shard", f"{size}-byte index, but its {sequences} sequences and {count} document "
                        f"indices take {header.size} bytes (truncated or not a Megatron index)", url=url, value=size)
    return header


@dataclass(frozen=True, slots=True, kw_only=True)
class Documents:
    """Documents ``[first, first + n)`` of a shard: where each one's ids lie in the ``.bin``."""

    first: int
    starts: np.ndarray
    """int64 ``[n]``: byte offset of each document in the ``.bin``."""
    lengths: np.ndarray
    """int64 ``[n]``: tokens of each document."""


def _documents(doc_index: np.ndarray, lengths: np.ndarray, pointers: np.ndarray, *, first_seq: int, first_doc: int,
               header: Header, url: str) -> Documents:
    """Documents from the slices of an ``.idx`` that cover them (``doc_index`` the ``n + 1`` indices, ``lengths`` and
    ``pointers`` of sequences ``[first_seq, ...)``), checked: any inconsistency raises naming the first document."""
    def bad(doc: int, why: str) -> DataError:
        return DataError("corrupt_shard", f"document {doc}: {why}", url=url, key=str(doc), value=doc)

    def holding(seq: int) -> int:  # the document that holds sequence ``seq`` (the first, for one before the range)
        return first_doc + max(int(np.searchsorted(doc_index, seq, side="right")) - 1, 0)

    steps = np.diff(doc_index)
    if doc_index.size and (doc_index[0] < 0 or doc_index[-1] > header.sequences or (steps < 0).any()):
        broken = np.flatnonzero((doc_index[1:] < doc_index[:-1]) | (doc_index[1:] > header.sequences)
                                | (doc_index[:-1] < 0))
        at = int(broken[0]) if broken.size else 0
        raise bad(first_doc + at, f"document indices {doc_index[at:at + 2].tolist()} are not a run of sequences in "
                  f"[0, {header.sequences}]")
    if (lengths < 0).any():
        seq = first_seq + int(np.flatnonzero(lengths < 0)[0])
        raise bad(holding(seq), f"sequence {seq} has a negative length")
    width = header.dtype.itemsize
    ends = pointers + lengths.astype(np.int64) * width
    gaps = np.flatnonzero(pointers[1:] != ends[:-1]) if pointers.size > 1 else np.zeros(0, np.int64)
    if gaps.size:
        seq = first_seq + int(gaps[0]) + 1
        raise bad(holding(seq), f"sequence {seq}'s pointer does not follow the sequence before it (the .bin holds "
                  f"sequences back to back)")
    if first_seq == 0 and pointers.size and pointers[0] != 0:
        raise bad(first_doc, "the first sequence's pointer is not 0")
    cum = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    local = doc_index - first_seq
    # a document starts where its first sequence does; an empty one where the next sequence would
    places = np.append(pointers, ends[-1] if pointers.size else 0)
    return Documents(first=first_doc, starts=places[local[:-1]], lengths=cum[local[1:]] - cum[local[:-1]])


class MegatronShard:
    """One ``.idx`` / ``.bin`` pair opened for ranged reads (the ``.idx``'s header, the ``.bin``'s size: read once).
    ``per_sequence``: its samples are its sequences (sample ``s`` is sequence ``s``), else its documents."""

    def __init__(self, url: str, opts: OpenOptions, stats: IOStats | None = None, *, per_sequence: bool = False) -> None:
        self.url, self.bin, self.opts, self.stats = url, bin_url(url), opts, stats
        size = storage.identity(url, opts, stats).size
        self.header = parse_header(read_range(url, 0, min(size, HEADER.size), opts, stats), size, url)
        self.bin_size = storage.identity(self.bin, opts, stats).size
        self.per_sequence = per_sequence
        self.count = self.header.sequences if per_sequence else self.header.documents
        """Number of samples."""

    def documents(self, lo: int, hi: int) -> Documents:
        """Samples ``[lo, hi)`` (clipped to the shard) from three ranged reads of the ``.idx`` (two per sequence:
        a sequence is a document of one sequence)."""
        h = self.header
        hi = min(hi, self.count)
        lo = min(lo, hi)
        doc_index = (np.arange(lo, hi + 1, dtype=np.int64) if self.per_sequence else
                     np.frombuffer(read_range(self.url, h.doc_index_at + 8 * lo, h.doc_index_at + 8 * (hi + 1), self.opts,
                                         self.stats), "<i8").astype(np.int64))
        # one sequence before the range too: its end is where the range's first pointer must be
        a = max(int(np.clip(doc_index[0], 0, h.sequences)) - 1, 0)
        b = int(np.clip(doc_index.max(initial=a), a, h.sequences))
        lengths = np.frombuffer(read_range(self.url, h.lengths_at + 4 * a, h.lengths_at + 4 * b, self.opts, self.stats),
                                "<i4").astype(np.int64)
        pointers = np.frombuffer(read_range(self.url, h.pointers_at + 8 * a, h.pointers_at + 8 * b, self.opts,
                                       self.stats), "<i8").astype(np.int64)
        return _documents(doc_index, lengths, pointers, first_seq=a, first_doc=lo, header=h, url=self.url)

    def check_bin_size(self) -> None:
        """Refuse a ``.bin`` longer than its ``.idx`` says (a stale or mismatched pair); a short one is read up to
        the cut."""
        h = self.header
        if not h.sequences:
            expected = 0
        else:
            last = h.sequences - 1
            length = int(np.frombuffer(read_range(self.url, h.lengths_at + 4 * last, h.lengths_at + 4 * h.sequences,
                                             self.opts, self.stats), "<i4")[0])
            pointer = int(np.frombuffer(read_range(self.url, h.pointers_at + 8 * last, h.pointers_at + 8 * h.sequences,
                                              self.opts, self.stats), "<i8")[0])
            expected = pointer + length * h.dtype.itemsize
        if self.bin_size > expected:
            raise DataError("corrupt_shard", f"{self.bin} holds {self.bin_size} bytes, its index says {expected}: not "
                            f"the .bin this .idx was written with", url=self.url, value=self.bin_size)

    def missing(self, docs: Documents, i: int) -> DataError:
        """The error of document ``i`` of ``docs`` whose bytes lie past the end of the ``.bin``."""
        doc = docs.first + i
        end = int(docs.starts[i]) + int(docs.lengths[i]) * self.header.dtype.itemsize
        return DataError("corrupt_shard", f"document {doc}: bytes [{int(docs.starts[i])}, {end}) lie past the end of "
                         f"{self.bin} ({self.bin_size} bytes): truncated .bin", url=self.url, key=str(doc), value=end)


def document_lengths(url: str, decode: DecodeOptions, opts: OpenOptions, stats: IOStats | None = None) -> np.ndarray:
    """int32 ``[documents]``: each document's token count for an index (:data:`BAD_LENGTH` where the reader refuses
    it: over ``max_sample_bytes``, or past the end of a truncated ``.bin``); the whole ``.idx`` is read and
    checked (a corrupt one raises naming the first document it breaks)."""
    shard = MegatronShard(url, opts, stats, per_sequence=decode.megatron_sample == "sequence")
    shard.check_bin_size()
    docs = shard.documents(0, shard.count)
    width = shard.header.dtype.itemsize
    out = docs.lengths.copy()
    out[docs.lengths * width > decode.limits.max_sample_bytes] = BAD_LENGTH
    out[docs.starts + docs.lengths * width > shard.bin_size] = BAD_LENGTH
    return np.minimum(out, 2**31 - 1).astype(np.int32)


def _runs(shard: MegatronShard, docs: Documents, limit: int) -> Iterator[tuple[int, int]]:
    """Document runs ``[i, j)`` of ``docs`` read together (:func:`~streampack.io.token_block.byte_runs`): a document
    over ``limit`` bytes or past the end of the ``.bin`` is a run alone."""
    nbytes = docs.lengths * shard.header.dtype.itemsize
    return byte_runs(nbytes, (nbytes <= limit) & (docs.starts + nbytes <= shard.bin_size), CHUNK_BYTES)


def _ids(shard: MegatronShard, docs: Documents, i: int, j: int) -> np.ndarray:
    """The ids of documents ``[i, j)`` in one ranged read of the ``.bin`` (native byte order)."""
    width = shard.header.dtype.itemsize
    lo = int(docs.starts[i])
    hi = lo + int(docs.lengths[i:j].sum()) * width
    raw = read_range(shard.bin, lo, hi, shard.opts, shard.stats)
    return np.frombuffer(raw, shard.header.dtype).astype(shard.header.dtype.newbyteorder("="), copy=False)


def iter_megatron_items(url: str, decode: DecodeOptions, *, opts: OpenOptions, start: int, end: int | None,
                        stats: IOStats | None = None) -> Iterator[Item]:
    """Decoded samples of documents ``[start, end)``: a document that is empty, over ``max_sample_bytes``, has an id
    out of range or lies past the end of the ``.bin`` is an ``Item`` with its error; a corrupt ``.idx`` raises."""
    shard = MegatronShard(url, opts, stats, per_sequence=decode.megatron_sample == "sequence")
    shard.check_bin_size()
    stop = shard.count if end is None else min(end, shard.count)
    limit, width = decode.limits.max_sample_bytes, shard.header.dtype.itemsize
    at = start
    while at < stop:
        docs = shard.documents(at, min(stop, at + DOCS_PER_SLICE))
        for i, j in _runs(shard, docs, limit):
            doc = docs.first + i
            size = int(docs.lengths[i]) * width
            if size > limit:
                err = DataError("sample_too_large", f"document of {size} bytes, over max_sample_bytes={limit}",
                                url=url, key=str(doc), value=size)
                yield Item(None, err, doc + 1, doc + 1, doc + 1 == stop)
                continue
            if int(docs.starts[i]) + size > shard.bin_size:
                yield Item(None, shard.missing(docs, i), doc + 1, doc + 1, doc + 1 == stop)
                continue
            ids = _ids(shard, docs, i, j)
            cut = np.concatenate([[0], np.cumsum(docs.lengths[i:j])])
            for k in range(j - i):
                doc = docs.first + i + k
                try:
                    sample = make_sample(url=url, key=str(doc), tokens=ids[cut[k]:cut[k + 1]],
                                         vocab_size=decode.vocab_size)
                    yield Item(sample, None, doc + 1, doc + 1, doc + 1 == stop)
                except DataError as e:
                    yield Item(None, e, doc + 1, doc + 1, doc + 1 == stop)
        at = docs.first + len(docs.lengths)


def megatron_blocks(url: str, start: int, end: int | None, *, decode: DecodeOptions, opts: OpenOptions,
                    stats: IOStats | None = None) -> Iterator[TokenBlock]:
    """Documents ``[start, end)`` as blocks, one per ``.bin`` read; at the first document the per-sample reader would
    not deliver as a plain sample (empty, over the limits, an id out of range, past the end) the blocks end, and that
    reader reads on from it."""
    shard = MegatronShard(url, opts, stats, per_sequence=decode.megatron_sample == "sequence")
    shard.check_bin_size()
    stop = shard.count if end is None else min(end, shard.count)
    limit, width, bound = decode.limits.max_sample_bytes, shard.header.dtype.itemsize, id_bound(decode.vocab_size)
    if start >= stop:
        yield TokenBlock.numbered(url, np.zeros(0, np.int64), np.zeros(1, np.int64), start, done=True)
        return
    at = start
    while at < stop:
        docs = shard.documents(at, min(stop, at + DOCS_PER_SLICE))
        for i, j in _runs(shard, docs, limit):
            lengths = docs.lengths[i:j]
            plain = (lengths >= 1) & (lengths * width <= limit) & (docs.starts[i:j] + lengths * width <= shard.bin_size)
            good = j - i if plain.all() else int(np.argmin(plain))
            ids = _ids(shard, docs, i, i + good) if good else np.zeros(0, shard.header.dtype)
            plain = documents_in_bound(ids, lengths[:good], bound)
            if plain < good:  # the documents before the one holding the first bad id are plain
                good, ids = plain, ids[:int(lengths[:plain].sum())]
            if good:
                yield TokenBlock.numbered(url, ids, np.concatenate([[0], np.cumsum(lengths[:good])]), docs.first + i,
                                          done=docs.first + i + good == stop)
            if good < j - i:
                return
        at = docs.first + len(docs.lengths)


__all__ = ["CHUNK_BYTES", "DOCS_PER_SLICE", "DTYPES", "MAGIC", "Documents", "Header", "MegatronShard", "bin_url",
           "document_lengths", "iter_megatron_items", "megatron_blocks", "parse_header"]
