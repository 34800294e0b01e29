"""Flat token arrays (issue 33): arrays numpy writes (``np.save`` with its header, ``np.memmap`` without one, raw
``.bin``) read document for document, split at the EOS id or by an offsets file, per sample and as token blocks, whole
and in the index's ranges; every damaged file is a ``DataError`` naming the file and the document, never its ids."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

import streampack.io.token_array as token_array
from streampack.errors import DataError
from streampack.io.blocks import read_blocks
from streampack.io.decode import BAD_LENGTH, DecodeOptions
from streampack.io.formats import ShardRange, open_range
from streampack.io.index import build_index, index_decode
from streampack.io.limits import Limits
from streampack.io.storage import OpenOptions
from streampack.io.urls import expand_urls, shard_format

EOS = 3
ID = 4242
"""Every id of the damaged files: an error message must never show it."""


def _docs(n: int = 40, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 60_000, rng.integers(1, 30)).tolist() + [EOS] for _ in range(n)]


def _items(url: str, decode: DecodeOptions, start: int = 0, first: int = 0, end: int | None = None) -> list:
    return list(open_range(url, ShardRange(start=start, first=first, end=end), decode=decode, opts=OpenOptions(),
                           streams=[]))


def _block_docs(url: str, decode: DecodeOptions, where: ShardRange) -> list[list[int]]:
    blocks = read_blocks(url, where, decode=decode, opts=OpenOptions(), streams=[])
    assert blocks is not None
    return [b.tokens[s:s + n].tolist() for b in blocks for s, n in zip(b.starts, b.lengths)]


def _write(kind: str, path, flat: np.ndarray) -> str:
    if kind == "save":
        np.save(f"{path}.npy", flat)
        return f"{path}.npy"
    name = f"{path}.npy" if kind == "memmap" else f"{path}.bin"
    mm = np.memmap(name, dtype=flat.dtype, mode="w+", shape=flat.shape)
    mm[:] = flat
    mm.flush()
    return name


@pytest.fixture(autouse=True)
def small_reads(monkeypatch):
    """Reads of a few ids and slices of a few offsets, so documents cross reads and slices."""
    monkeypatch.setattr(token_array, "CHUNK_BYTES", 40)
    monkeypatch.setattr(token_array, "DOCS_PER_SLICE", 7)


@pytest.mark.parametrize(("kind", "dtype"), [(k, d) for k in ("save", "memmap", "bin") for d in (np.uint16, np.uint32)]
                         + [("save", np.dtype(">u2"))])
def test_every_document_at_eos_whole_in_ranges_and_as_blocks(tmp_path, kind, dtype):
    docs = _docs() + [[77, 78]]  # ids after the last EOS are a last document
    url = _write(kind, tmp_path / "a", np.concatenate(docs).astype(dtype))
    decode = DecodeOptions(eos_id=EOS, token_dtype=None if kind == "save" else np.dtype(dtype).name)
    assert shard_format(url) == "token_array"
    assert [i.sample.tokens.tolist() for i in _items(url, decode)] == docs
    assert [i.sample.key for i in _items(url, decode)] == [str(d) for d in range(len(docs))]
    index = build_index(url, decode=index_decode(decode))
    assert index.lengths.tolist() == [len(d) for d in docs]
    assert index.offsets.tolist() == np.cumsum([0] + [len(d) for d in docs[:-1]]).tolist(), "position: first id"
    for parts in (1, 3, 8):
        ranges = [index.part(p, parts) for p in range(parts)]
        where = [ShardRange(start=s, first=f, end=e) for s, e, f in ranges]
        got = [i.sample.tokens.tolist() for w in where for i in _items(url, decode, w.start, w.first, w.end)]
        assert got == docs, f"{parts} ranges"
        assert [d for w in where for d in _block_docs(url, decode, w)] == docs, f"{parts} ranges as blocks"


@pytest.mark.parametrize("kind", ["save", "bin"])
def test_every_document_by_offsets_file(tmp_path, kind):
    docs = [d[:-1] for d in _docs(30, seed=1)]  # no EOS: the offsets file says where each ends
    url = _write(kind, tmp_path / "a", np.concatenate(docs).astype(np.uint32))
    np.save(tmp_path / "a.offsets.npy", np.cumsum([0] + [len(d) for d in docs]))
    decode = DecodeOptions(token_dtype=None if kind == "save" else "uint32")
    assert [i.sample.tokens.tolist() for i in _items(url, decode)] == docs
    index = build_index(url, decode=index_decode(decode))
    assert index.offsets.tolist() == list(range(len(docs))) and index.end == len(docs), "position: document number"
    for parts in (1, 4):
        where = [ShardRange(start=s, first=f, end=e) for s, e, f in (index.part(p, parts) for p in range(parts))]
        assert [i.sample.tokens.tolist() for w in where for i in _items(url, decode, w.start, w.first, w.end)] == docs
        assert [d for w in where for d in _block_docs(url, decode, w)] == docs


def test_a_directory_lists_arrays_not_their_companions(tmp_path):
    """``name.offsets.npy`` and a Megatron pair's ``.bin`` are read through another file, never listed as shards."""
    np.save(tmp_path / "a.npy", np.arange(4, dtype=np.uint16))
    np.save(tmp_path / "a.offsets.npy", np.array([0, 4]))
    np.arange(4, dtype=np.uint16).tofile(tmp_path / "b.bin")
    (tmp_path / "m.idx").write_bytes(b"")
    (tmp_path / "m.bin").write_bytes(b"")
    want = [str(tmp_path / n) for n in ("a.npy", "b.bin", "m.idx")]
    assert expand_urls(str(tmp_path)) == want
    assert expand_urls(str(tmp_path / "*")) == want
    with pytest.raises(ValueError, match="offsets file"):
        expand_urls(str(tmp_path / "a.offsets.npy"))
    with pytest.raises(ValueError, match=r"named by its \.idx"):
        expand_urls(str(tmp_path / "m.bin"))


def test_a_document_over_max_sample_bytes_is_refused_alone(tmp_path):
    """At the EOS id a long document is scanned across reads without holding its ids; its neighbours are read."""
    docs = [[11, EOS], [12] * 60 + [EOS], [13, 14, EOS], [15] * 9 + [EOS]]
    url = _write("save", tmp_path / "a", np.concatenate(docs).astype(np.uint16))
    decode = DecodeOptions(eos_id=EOS, limits=Limits(max_sample_bytes=20))
    got = _items(url, decode)
    assert [i.error.reason if i.error else i.sample.tokens.tolist() for i in got] == [
        docs[0], "sample_too_large", docs[2], docs[3]]
    assert got[1].error.key == "1" and got[1].next_offset == 63
    assert build_index(url, decode=index_decode(decode)).lengths.tolist() == [2, BAD_LENGTH, 3, 10]


def _flat(n: int = 30) -> np.ndarray:
    """Six documents of five ``ID`` s and an EOS."""
    return np.array(([ID] * 4 + [EOS]) * (n // 5), np.uint16)


def _save(path, flat) -> str:
    np.save(path, flat)
    return str(path)


def _header_lies(tmp_path) -> str:
    """A header declaring 20 ids more than the file holds."""
    url = _save(tmp_path / "a.npy", _flat())
    raw = open(url, "rb").read().replace(b"(30,)", b"(50,)")
    open(url, "wb").write(raw)
    return url


def _header_short(tmp_path) -> str:
    url = _save(tmp_path / "a.npy", _flat())
    raw = open(url, "rb").read().replace(b"(30,)", b"(20,)")
    open(url, "wb").write(raw)
    return url


def _cut(tmp_path) -> str:
    url = _save(tmp_path / "a.npy", _flat())
    os.truncate(url, os.path.getsize(url) - 3)  # inside the last document, half an id
    return url


def _raw_cut(tmp_path) -> str:
    _flat().tofile(tmp_path / "a.bin")
    os.truncate(tmp_path / "a.bin", 2 * 27 + 1)
    return str(tmp_path / "a.bin")


def _offsets(values):
    def make(tmp_path) -> str:
        url = _save(tmp_path / "a.npy", _flat())
        np.save(tmp_path / "a.offsets.npy", np.array(values, np.int64))
        return url
    return make


def _no_offsets(tmp_path) -> str:
    return _save(tmp_path / "a.npy", _flat())


def _float(tmp_path) -> str:
    return _save(tmp_path / "a.npy", _flat().astype(np.float32))


def _matrix(tmp_path) -> str:
    return _save(tmp_path / "a.npy", _flat().reshape(5, 6))


def _garbage_header(tmp_path) -> str:
    url = _save(tmp_path / "a.npy", _flat())
    raw = bytearray(open(url, "rb").read())
    raw[12:30] = b"{'descr': <4242>, "
    open(url, "wb").write(bytes(raw))
    return url


def _over_vocab(tmp_path) -> str:
    flat = _flat()
    flat[11] = 6000  # in document 2
    return _save(tmp_path / "a.npy", flat)


def _raw_npy(tmp_path) -> str:
    return _write("memmap", tmp_path / "a", _flat())


# damage, decode options, (reason, message), where: "open" raises opening the array, "index" building the index,
# a number: reading, the item of that document carries the error (the others read)
DAMAGE = {
    "header declares more ids than the file holds": (_header_lies, {"eos_id": EOS},
                                                     ("corrupt_shard", r"document 6: .*truncated array"), 6),
    "header declares fewer ids than the file holds": (_header_short, {"eos_id": EOS},
                                                      ("corrupt_shard", "not what the header says"), "open"),
    "array cut inside its last document": (_cut, {"eos_id": EOS}, ("corrupt_shard", "document 5: .*truncated"), 5),
    "raw .bin cut inside an id": (_raw_cut, {"eos_id": EOS, "token_dtype": "uint16"},
                                  ("corrupt_shard", "document 5: .*truncated"), 5),
    "no header and no token_dtype": (_raw_npy, {"eos_id": EOS}, ("bad_dtype", "token_dtype"), "open"),
    "header dtype other than token_dtype": (_no_offsets, {"eos_id": EOS, "token_dtype": "uint32"},
                                            ("bad_dtype", "token_dtype=uint32"), "open"),
    "float ids": (_float, {"eos_id": EOS}, ("bad_dtype", "1-D integer"), "open"),
    "a 2-D array": (_matrix, {"eos_id": EOS}, ("bad_dtype", "1-D integer"), "open"),
    "garbage header": (_garbage_header, {"eos_id": EOS}, ("corrupt_shard", "numpy header"), "open"),
    "no offsets file": (_no_offsets, {}, ("missing", "offsets.npy"), "open"),
    "offsets not from 0": (_offsets([2, 10, 30]), {}, ("corrupt_shard", "document 0: .*not 0"), "index"),
    "offsets out of order": (_offsets([0, 10, 5, 30]), {}, ("corrupt_shard", "document 1: .*out of order"), "index"),
    "offsets past the end": (_offsets([0, 10, 40]), {}, ("corrupt_shard", "document 1: .*past the end"), "index"),
    "offsets ending before the array": (_offsets([0, 10, 20]), {}, ("corrupt_shard", "ends at id 20"), "open"),
    "an empty document": (_offsets([0, 10, 10, 30]), {}, ("empty_sample", "0 tokens"), 1),
    "an id over the vocabulary": (_over_vocab, {"eos_id": EOS, "vocab_size": 5000}, ("out_of_vocab_id", "6000"), 2),
}


@pytest.mark.parametrize("name", list(DAMAGE))
def test_damage_is_a_data_error_naming_file_and_document(tmp_path, name):
    make, options, (reason, match), where = DAMAGE[name]
    url = make(tmp_path)
    decode = DecodeOptions(**options)
    if where in ("open", "index"):
        with pytest.raises(DataError) as e:
            build_index(url, decode=index_decode(decode))
        if where == "open":
            with pytest.raises(DataError):
                _items(url, decode)
        err = e.value
    else:
        items = _items(url, decode)
        bad = [i for i in items if i.error is not None]
        assert [int(i.error.key) for i in bad] == [where], [str(i.error) for i in bad]
        assert all(i.sample is not None and i.sample.tokens.size for i in items if i.error is None)
        err = bad[0].error
        # the block reader delivers the plain documents before the bad one and leaves it to the per-sample reader
        assert len(_block_docs(url, decode, ShardRange(start=0, first=0))) == where
    assert err.reason.startswith(reason) and err.url.startswith(url[:-4])
    assert re.search(match, str(err)), str(err)
    assert str(ID) not in str(err), "an error shows the file's ids"


def test_an_id_past_int64_in_a_uint64_array_is_refused(tmp_path):
    flat = np.array([5, EOS, 2**63 + 1, EOS, 6, EOS], np.uint64)
    url = _save(tmp_path / "a.npy", flat)
    decode = DecodeOptions(eos_id=EOS)
    assert [i.error.reason if i.error else i.sample.tokens.tolist() for i in _items(url, decode)] == [
        [5, EOS], "bad_dtype", [6, EOS]]
    assert _block_docs(url, decode, ShardRange(start=0, first=0)) == [[5, EOS]]


@pytest.mark.parametrize(("options", "match"), [({"eos_id": -1}, "eos_id=-1"), ({"eos_id": 9, "vocab_size": 9}, "eos_id=9"),
                                                ({"token_dtype": "float32"}, "token_dtype"),
                                                ({"megatron_sample": "sentence"}, "megatron_sample")])
def test_read_options_check_the_layout(options, match):
    from streampack.options import ReadOptions

    with pytest.raises(ValueError, match=match):
        ReadOptions(**options)


def test_over_http_by_ranged_reads(tmp_path):
    """On a loopback HTTP server both layouts read every document by ranged requests (the offsets file's too), whole
    and from the middle of an array."""
    from helpers_faults import serve_faulty

    docs = _docs(25, seed=2)
    os.makedirs(tmp_path / "d")
    np.save(tmp_path / "d" / "a.npy", np.concatenate(docs).astype(np.uint16))
    np.concatenate(docs).astype(np.uint32).tofile(tmp_path / "d" / "b.bin")
    np.save(tmp_path / "d" / "b.offsets.npy", np.cumsum([0] + [len(d) for d in docs]))
    with serve_faulty(tmp_path / "d") as server:
        a, b = f"{server.url}/a.npy", f"{server.url}/b.bin"
        assert [i.sample.tokens.tolist() for i in _items(a, DecodeOptions(eos_id=EOS))] == docs
        assert [i.sample.tokens.tolist() for i in _items(b, DecodeOptions(token_dtype="uint32"))] == docs
        index = build_index(a, decode=index_decode(DecodeOptions(eos_id=EOS)))
        s, e, f = index.part(1, 2)
        assert [i.sample.tokens.tolist() for i in _items(a, DecodeOptions(eos_id=EOS), s, f, e)] == docs[f:]


@pytest.mark.parametrize(("dtype", "bad", "vocab"), [(np.int32, -5, None), (np.int64, -(2**40), None),
                                                      (np.int16, 9, 9), (np.uint16, 60_000, 50_000)])
def test_blocks_end_before_the_document_holding_the_first_id_out_of_range(tmp_path, dtype, bad, vocab):
    """The block check is one maximum over the ids read as unsigned (a negative id reads as at least 2**(bits-1));
    the documents before the bad one still come as a block, the per-sample reader names it."""
    flat = np.array([5, 6, EOS, 7, EOS, 8, bad, EOS, 4, EOS], dtype)
    url = _save(tmp_path / "a.npy", flat)
    decode = DecodeOptions(eos_id=EOS, vocab_size=vocab)
    assert _block_docs(url, decode, ShardRange(start=0, first=0)) == [[5, 6, EOS], [7, EOS]]
    assert [i.error is not None for i in _items(url, decode)] == [False, False, True, False]
