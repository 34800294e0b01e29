"""``.npy`` headers are read without evaluating them.

numpy reads a header with ``ast.literal_eval``; on CPython 3.11 two threads building an AST at once fail with
``SystemError: AST constructor recursion depth mismatch`` (cpython gh-106905), which failed ``streampack index --pool
threads`` in CI. The headers writers produce are parsed here instead, equal to numpy's reading of them.
"""

import io

import numpy as np
import pytest

import streampack.io.npy as npy
from streampack.errors import DataError
from streampack.io.npy import HEADER_ERRORS, decode_npy, npy_length, read_header
from streampack.io.token_array import parse_layout


def _saved(array, version=None) -> bytes:
    buf = io.BytesIO()
    if version is None:
        np.save(buf, array)
    else:
        np.lib.format.write_array(buf, array, version=version)
    return buf.getvalue()


def _numpy_header(data: bytes):
    buf = io.BytesIO(data)
    version = np.lib.format.read_magic(buf)
    reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    return reader(buf), buf.tell()


ARRAYS = [
    np.arange(19, dtype=np.int64),
    np.arange(7, dtype=">u2"),
    np.zeros((0,), dtype=np.uint32),
    np.array(5, dtype=np.int16),
    np.arange(24, dtype=np.float32).reshape(2, 3, 4),
    np.asfortranarray(np.arange(12, dtype=np.uint8).reshape(3, 4)),
    np.zeros((3, 1), dtype=np.bool_),
]


@pytest.fixture
def no_ast(monkeypatch):
    """numpy's reader fails if called: a test passes only when nothing evaluates the header."""
    def refuse(*_a, **_k):
        raise AssertionError("the header was evaluated with ast")
    monkeypatch.setattr(npy.np.lib.format, "read_array_header_1_0", refuse)
    monkeypatch.setattr(npy.np.lib.format, "read_array_header_2_0", refuse)


@pytest.mark.parametrize("version", [None, (1, 0), (2, 0), (3, 0)])
def test_a_written_header_reads_as_numpy_reads_it(version):
    for array in ARRAYS:
        data = _saved(array, version)
        expected, data_at = _numpy_header(data)
        buf = io.BytesIO(data)
        assert read_header(buf) == expected, array
        assert buf.tell() == data_at


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_every_written_header_is_read_without_ast(version, no_ast):
    for array in ARRAYS:
        data = _saved(array, version)
        out = decode_npy(data, member="x.npy", url="u", key="k")
        np.testing.assert_array_equal(out, array)
        assert out.dtype == array.dtype
        assert npy_length(data[:256]) == (array.shape[0] if array.ndim else -1)


def test_a_token_arrays_header_is_read_without_ast(no_ast):
    data = _saved(np.arange(1000, dtype=np.uint16), (2, 0))
    layout = parse_layout(data[:256], len(data), "u", None)
    assert (layout.dtype, layout.ids) == (np.dtype(np.uint16), 1000)


def _with_header(text: bytes) -> bytes:
    text += b" " * (-(10 + len(text) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + bytes(8)


@pytest.mark.parametrize("text", [
    b"{'shape': (2,), 'descr': '<i4', 'fortran_order': False}",  # another writer's order, no trailing comma
    b"{ 'descr' : '<i4' ,'fortran_order':False,'shape':( 2 , ) , }",
])
def test_other_writers_spacing_and_key_order_read_as_numpy_reads_them(text, no_ast):
    assert read_header(io.BytesIO(_with_header(text))) == ((2,), False, np.dtype("<i4"))


@pytest.mark.parametrize("text", [
    b"{'descr': '<i4', 'fortran_order': False, 'shape': (2), }",  # an int, not a tuple
    b"{'descr': '<i4', 'fortran_order': 'no', 'shape': (2,), }",
    b"{'descr': True, 'fortran_order': False, 'shape': (2,), }",
    b"{'descr': '<i4', 'descr': '<i4', 'shape': (2,), }",
    b"{'descr': '<i4', 'shape': (2,), }",
    b"{'descr': '<q9', 'fortran_order': False, 'shape': (2,), }",
    b"not a dict at all",
])
def test_a_header_numpy_refuses_is_refused(text):
    data = _with_header(text)
    with pytest.raises(HEADER_ERRORS):
        _numpy_header(data)
    with pytest.raises(HEADER_ERRORS):
        read_header(io.BytesIO(data))
    with pytest.raises(DataError, match="bad_npy"):
        decode_npy(data, member="x.npy", url="u", key="k")
    assert npy_length(data) == -1


def test_a_cut_or_oversized_header_is_refused():
    data = _saved(np.arange(4))
    with pytest.raises(HEADER_ERRORS):
        read_header(io.BytesIO(data[:40]))
    huge = b"\x93NUMPY\x02\x00" + (20_000).to_bytes(4, "little") + b" " * 20_000
    with pytest.raises(HEADER_ERRORS):
        read_header(io.BytesIO(huge))


def test_a_structured_dtype_still_reads_through_numpy():
    array = np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")])
    data = _saved(array)
    assert read_header(io.BytesIO(data)) == _numpy_header(data)[0]
