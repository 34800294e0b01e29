"""``.npy`` tar members -> arrays, without trusting the header.

``np.load`` allocates whatever shape a header declares (``(10**12,)``: a ``MemoryError``) and object arrays unpickle.
Here the header is parsed without evaluating it (a 10 KB cap), object dtypes are refused, and the declared size must
equal the member's bytes before any array exists; the array is a zero-copy view of the member.
"""

from __future__ import annotations

import io
import math
import re
import threading
import tokenize

import numpy as np

from streampack.errors import DataError

# A 1-D array's header as numpy writes it; anything else goes through the general path.
NPY_1D = re.compile(rb"\{'descr': '([<>|=][iuf][1248])', 'fortran_order': False, 'shape': \((\d+),\), \}")
# what a damaged header raises, from ``read_header``'s own checks or from numpy's reader (``tokenize`` +
# ``ast.literal_eval``) on the headers it leaves to numpy
HEADER_ERRORS = (ValueError, EOFError, SyntaxError, TypeError, OverflowError, RecursionError, tokenize.TokenError)


def _fast_npy(data: bytes) -> np.ndarray | None:
    """Decode a plain 1-D numeric ``.npy`` without numpy's per-call header parsing (``ast``:
    it was half the in-process pipeline time on 600-token samples)."""
    if data[:6] != b"\x93NUMPY" or len(data) < 12:
        return None
    start = 10 if data[6] == 1 else 12
    hlen = int.from_bytes(data[8:start], "little")
    m = NPY_1D.match(data, start, start + hlen)
    if m is None:
        return None
    dtype, count, offset = np.dtype(m.group(1).decode()), int(m.group(2)), start + hlen
    if len(data) != offset + count * dtype.itemsize:
        return None  # truncated or padded member: the general path names the mismatch
    return np.frombuffer(data, dtype=dtype, count=count, offset=offset)


# numpy reads a header with ``ast.literal_eval``, and CPython 3.11 keeps the AST constructor's recursion count in
# interpreter-wide state: two threads parsing at once fail with "SystemError: AST constructor recursion depth mismatch"
# (cpython gh-106905; it failed `streampack index --pool threads` in CI). So a header naming its three keys with
# literal values, in any order and spacing, is parsed here; anything else (a structured dtype's list) goes to numpy's
# reader, one thread at a time.
_VALUE = rb"'[^']*'|True|False|\(\s*\)|\(\s*\d+\s*,\s*(?:\d+\s*,\s*)*(?:\d+\s*)?\)"
_ITEM = rb"\s*'(descr|fortran_order|shape)'\s*:\s*(" + _VALUE + rb")\s*"
_DICT = re.compile(rb"\{" + _ITEM + rb"," + _ITEM + rb"," + _ITEM + rb",?\s*\}\s*")
_MAX_HEADER = 10_000  # numpy's own cap on a header it reads
_AST_LOCK = threading.Lock()


def read_header(buf: io.BytesIO) -> tuple[tuple[int, ...], bool, np.dtype]:
    """``(shape, fortran_order, dtype)`` of the ``.npy`` header at ``buf``'s start, ``buf`` left at the data; raises
    one of ``HEADER_ERRORS``."""
    version = np.lib.format.read_magic(buf)
    width = 2 if version == (1, 0) else 4  # 3.0 differs from 2.0 only by a utf-8 (not latin-1) header
    start = buf.tell()
    length = int.from_bytes(buf.read(width), "little")
    if length > _MAX_HEADER:
        raise ValueError(f"a {length}-byte header is over {_MAX_HEADER} bytes")
    text = buf.read(length)
    if len(text) != length:
        raise EOFError(f"the header is cut after {len(text)} of its {length} bytes")
    m = _DICT.fullmatch(text)
    if m is None or len(set(m.group(1, 3, 5))) != 3:
        buf.seek(start)
        reader = np.lib.format.read_array_header_1_0 if width == 2 else np.lib.format.read_array_header_2_0
        with _AST_LOCK:
            return reader(buf)
    fields = dict(zip(m.group(1, 3, 5), m.group(2, 4, 6)))
    descr, order, dims = fields[b"descr"], fields[b"fortran_order"], fields[b"shape"]
    if not descr.startswith(b"'") or order not in (b"True", b"False") or not dims.startswith(b"("):
        raise ValueError("the header's descr is not a string, fortran_order not a bool or shape not a tuple")
    shape = tuple(int(n) for n in re.findall(rb"\d+", dims))
    return shape, order == b"True", np.dtype(descr[1:-1].decode("latin-1"))


def decode_npy(data: bytes, *, member: str, url: str, key: str) -> np.ndarray:
    """The array stored in ``data`` (a whole ``.npy`` member); raises ``DataError("bad_npy")``."""
    fast = _fast_npy(data)
    if fast is not None:
        return fast
    buf = io.BytesIO(data)
    try:
        shape, fortran, dtype = read_header(buf)
    except HEADER_ERRORS as e:
        raise DataError("bad_npy", f"member {member!r}: {e}", url=url, key=key, value=member) from None
    if dtype.hasobject:
        raise DataError("bad_npy", f"member {member!r} is an object array (it would unpickle)", url=url, key=key,
                        value=str(dtype))
    offset, count = buf.tell(), math.prod(shape)
    if count < 0 or offset + count * dtype.itemsize != len(data):
        raise DataError("bad_npy", f"member {member!r} declares shape {shape} of {dtype} "
                        f"({max(count, 0) * dtype.itemsize} bytes) but holds {len(data) - offset}",
                        url=url, key=key, value=shape)
    try:
        flat = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
        return flat.reshape(shape, order="F" if fortran else "C")
    except (ValueError, TypeError) as e:
        raise DataError("bad_npy", f"member {member!r}: {e}", url=url, key=key, value=shape) from None


def npy_length(prefix: bytes) -> int:
    """Leading dimension from the first bytes of an ``.npy`` member (-1 if unreadable)."""
    try:
        shape, _, _ = read_header(io.BytesIO(prefix))
    except HEADER_ERRORS:
        return -1
    return int(shape[0]) if len(shape) >= 1 else -1
