"""``.npy`` tar members -> arrays, without trusting the header.

``np.load`` allocates whatever shape a header declares (``(10**12,)``: a ``MemoryError``) and object arrays unpickle.
Here the header is parsed with numpy's safe reader (a 10 KB cap), object dtypes are refused, and the declared size must
equal the member's bytes before any array exists; the array is a zero-copy view of the member.
"""

from __future__ import annotations

import io
import math
import re
import tokenize

import numpy as np

from streampack.errors import DataError

# A 1-D array's header as numpy writes it; anything else goes through the general path.
NPY_1D = re.compile(rb"\{'descr': '([<>|=][iuf][1248])', 'fortran_order': False, 'shape': \((\d+),\), \}")
# numpy parses the header dict with ``tokenize`` + ``ast.literal_eval``: a damaged one raises any of
_HEADER_ERRORS = (ValueError, EOFError, SyntaxError, TypeError, OverflowError, RecursionError, tokenize.TokenError)


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


def _header(buf: io.BytesIO) -> tuple[tuple[int, ...], bool, np.dtype]:
    version = np.lib.format.read_magic(buf)
    # version 3.0 differs from 2.0 only by a utf-8 (not latin-1) header: the same for ascii
    reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    return reader(buf)


def decode_npy(data: bytes, *, member: str, url: str, key: str) -> np.ndarray:
    """The array stored in ``data`` (a whole ``.npy`` member); raises ``DataError("bad_npy")``."""
    fast = _fast_npy(data)
    if fast is not None:
        return fast
    buf = io.BytesIO(data)
    try:
        shape, fortran, dtype = _header(buf)
    except _HEADER_ERRORS as e:
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
        shape, _, _ = _header(io.BytesIO(prefix))
    except _HEADER_ERRORS:
        return -1
    return int(shape[0]) if len(shape) >= 1 else -1
