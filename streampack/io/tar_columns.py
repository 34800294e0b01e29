"""The column checks of :mod:`streampack.io.tar_block`: headers, pax records, names, ``.npy``
headers and ids of a tar range, each as whole-array work over every member at once.

Each function answers whether *every* member passes, judged as the per-sample reader judges one;
a False (or None) sends the range to that reader, so a check may be stricter, never looser.
"""

from __future__ import annotations

import sys

import numpy as np

from streampack.io.limits import MAX_EXTENSION_BYTES, unsigned_ids
from streampack.io.npy import NPY_1D
from streampack.io.tar_header import BLOCK, Unreadable, parse_pax

USTAR = np.frombuffer(b"ustar", np.uint8)
_NUMPY = np.frombuffer(b"\x93NUMPY", np.uint8)
_SHAPE_END = np.frombuffer(b",), }", np.uint8)
_NATIVE = "<" if sys.byteorder == "little" else ">"
_POW8 = 8 ** np.arange(22, dtype=np.int64)
_POW10 = 10 ** np.arange(19, dtype=np.int64)
_MIX = np.random.default_rng(0x5EED).integers(1, 2**63, 13, dtype=np.uint64) | np.uint64(1)


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
    """Numeric tar fields (uint8 ``[k, w]``) as ``tar_header._number`` reads them: octal digits in one run between
    blanks (space or NUL), empty = 0; anything else is not ok (base-256, 8 or 9, a sign, a blank between digits)."""
    digit = (fields >= 48) & (fields <= 55)
    ok = (digit | (fields == 32) | (fields == 0)).all(1)
    runs = digit.copy()
    runs[:, 1:] &= ~digit[:, :-1]
    ok &= runs.sum(1) <= 1
    # in one run, a digit's power of 8 is the number of digits to its right
    right = np.cumsum(digit[:, ::-1], axis=1, dtype=np.int64)[:, ::-1] - 1
    value = (np.where(digit, fields.astype(np.int64) - 48, 0) * _POW8[np.maximum(right, 0)]).sum(1)
    return value, ok


def headers_ok(rows: np.ndarray, sizes: np.ndarray) -> bool:
    """Every header (``rows``: uint8 ``[k, 512]``) has the ustar magic, the size the chain
    followed written as ``tar_header._number`` reads it, and the checksum
    ``tar_header.parse_header`` checks (unsigned, or the signed sum old writers made)."""
    if not (rows[:, 257:262] == USTAR).all():
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


def pax_ok(blocks: np.ndarray, buf: bytes, pax: np.ndarray, sizes: np.ndarray) -> bool:
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


def member_names(headers: np.ndarray, tokens_key: str) -> tuple[np.ndarray, np.ndarray] | None:
    """From the members' header rows (uint8 ``[n, 512]``): each member's key length and the names (uint8
    ``[n, 100]``, NUL-padded), when every name is ``<key>.<field>`` with one token field for all (the key
    ends at the basename's first dot), the keys are distinct and no name has a ustar prefix or a newline."""
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
    if not distinct_rows(clean):
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
    if (keys == 10).any() or not distinct_rows(keys):
        return None
    clean = np.zeros((rows.shape[0], 100), dtype=np.uint8)
    clean[:, :n] = rows[:, :n]
    return np.full(rows.shape[0], dot, dtype=np.int64), clean


def distinct_rows(names: np.ndarray) -> bool:
    """Whether the rows of ``names`` (uint8 ``[n, 100]``) differ pairwise, by a sorted 64-bit hash per
    row; equal hashes count as a repeat (the per-sample reader then decides: a false alarm costs speed)."""
    words = np.zeros((names.shape[0], 13), dtype=np.uint64)
    words.view(np.uint8)[:, :names.shape[1]] = names
    mixed = (words * _MIX).sum(1) if names.shape[0] else words[:, 0]
    ordered = np.sort(mixed ^ (mixed >> np.uint64(29)))
    return not (ordered[1:] == ordered[:-1]).any()


def npy_members(first: np.ndarray, data: np.ndarray,
                msize: np.ndarray) -> tuple[np.dtype, np.ndarray, np.ndarray] | None:
    """The token dtype and each document's element start and length, when every member (its first data block ``first``,
    uint8 ``[n, 512]``, at byte ``data``) is a 1-D native-order integer ``.npy`` in numpy's own header form (what
    ``npy._fast_npy`` reads), with the header in that block, of exactly its member's size."""
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
    m = NPY_1D.match(bytes(text[0]))
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


def ids_in_range(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, bound: int) -> bool:
    """Every id of every document in ``[0, bound)``: one maximum per document segment, in one
    call (``reduceat`` over the interleaved starts and ends; the gaps between are headers), over the ids read as
    unsigned (:func:`~streampack.io.limits.unsigned_ids`)."""
    ends = starts + lengths
    cut = np.empty(2 * starts.size, dtype=np.int64)
    cut[0::2], cut[1::2] = starts, ends
    if cut[-1] >= tokens.size:
        cut = cut[:-1]
    tokens, bound = unsigned_ids(tokens, bound)
    high = np.maximum.reduceat(tokens, cut)[0::2]
    return bool((high < bound).all())


__all__ = ["USTAR", "distinct_rows", "headers_ok", "ids_in_range", "member_names", "npy_members", "pax_ok"]
