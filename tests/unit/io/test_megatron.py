"""Megatron-core indexed data sets (``.bin`` + ``.idx``, issue 33): files written by megatron-core's own
``IndexedDatasetBuilder`` read document for document as megatron-core's ``IndexedDataset`` reads them, per sample
and as token blocks, whole and in ranges; a corrupt or truncated ``.idx`` / ``.bin`` is a ``DataError`` naming the
file and the document, never a silent misread."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from helpers_data import make_token_docs
from helpers_megatron import megatron_documents, write_megatron, write_megatron_shards

import streampack.io.megatron as megatron
from streampack.errors import DataError
from streampack.io.blocks import read_blocks
from streampack.io.decode import BAD_LENGTH, DecodeOptions
from streampack.io.formats import ShardRange, open_range
from streampack.io.index import build_index, index_decode
from streampack.io.limits import Limits
from streampack.io.storage import OpenOptions
from streampack.io.urls import expand_urls, shard_format
from streampack.nodes.reader import ShardReader
from streampack.options import ReadOptions


def _items(url: str, start: int = 0, end: int | None = None, **decode) -> list:
    return list(open_range(url, ShardRange(start=start, first=start, end=end), decode=DecodeOptions(**decode),
                           opts=OpenOptions(), streams=[]))


def _block_docs(url: str, start: int = 0, end: int | None = None) -> list[list[int]]:
    blocks = read_blocks(url, ShardRange(start=start, first=start, end=end), decode=DecodeOptions(),
                         opts=OpenOptions(), streams=[])
    return [b.ids(i).tolist() for b in blocks for i in range(len(b))]


@pytest.fixture(params=[np.uint16, np.int32, np.int64])
def shard(request, tmp_path, monkeypatch):
    """A shard of multi-sequence documents, read in chunks small enough that documents straddle reads, its index in
    slices of 7 documents."""
    monkeypatch.setattr(megatron, "CHUNK_BYTES", 256)
    monkeypatch.setattr(megatron, "DOCS_PER_SLICE", 7)
    docs = make_token_docs(60, seed=3, max_len=90, vocab=60_000)
    (url,) = write_megatron_shards(tmp_path, docs, 1, dtype=request.param, seed=1)
    return url, docs


def test_every_document_equals_megatron_core(shard):
    url, docs = shard
    reference = megatron_documents(url)
    assert reference == docs and len(reference) == 60
    samples = list(ShardReader([url], shuffle=False, epochs=1))
    assert [s.tokens.tolist() for s in samples] == reference
    assert [s.key for s in samples] == [str(i) for i in range(60)] and samples[0].url == url
    assert _block_docs(url) == reference


def test_ranges_and_index(shard):
    url, docs = shard
    index = build_index(url, decode=index_decode())
    assert index.lengths.tolist() == [len(d) for d in docs] and index.offsets.tolist() == list(range(60))
    for lo, hi in [(0, 1), (7, 23), (59, 60), (31, None), (60, None)]:
        items = _items(url, lo, hi)
        want = docs[lo:hi]
        assert [it.sample.tokens.tolist() for it in items] == want
        assert [it.next_offset for it in items] == list(range(lo + 1, lo + 1 + len(want)))
        assert not items or items[-1].at_end
        assert _block_docs(url, lo, hi) == want


def _sequences(url: str) -> list[list[int]]:
    """Every sequence's ids as megatron-core's ``IndexedDataset`` reads them (its items)."""
    from helpers_megatron import builder_and_dataset

    ref = builder_and_dataset()[1](url[:-len(".idx")])
    return [ref[s].tolist() for s in range(len(ref))]


def test_a_sample_per_sequence_equals_megatron_core(shard):
    """``megatron_sample="sequence"``: sample ``s`` is megatron-core's item ``s``, whole, in ranges, as blocks and in
    the index (keyed apart from the per-document index of the same shard)."""
    url, docs = shard
    sequences = _sequences(url)
    assert len(sequences) > len(docs), "the fixture cuts documents into several sequences"
    decode = DecodeOptions(megatron_sample="sequence")
    read = ReadOptions(megatron_sample="sequence")
    assert [s.tokens.tolist() for s in ShardReader([url], shuffle=False, epochs=1, read=read)] == sequences
    index = build_index(url, decode=index_decode(decode))
    assert index.lengths.tolist() == [len(s) for s in sequences] and index.end == len(sequences)
    n = len(sequences)
    for lo, hi in [(0, 1), (5, 40), (n - 1, n), (n // 2, None)]:
        where = ShardRange(start=lo, first=lo, end=hi)
        items = list(open_range(url, where, decode=decode, opts=OpenOptions(), streams=[]))
        assert [it.sample.tokens.tolist() for it in items] == sequences[lo:hi] and items[-1].at_end
        blocks = read_blocks(url, where, decode=decode, opts=OpenOptions(), streams=[])
        assert [b.ids(i).tolist() for b in blocks for i in range(len(b))] == sequences[lo:hi]
    from streampack.io import storage
    from streampack.io.index import fingerprint_of

    ident = storage.identity(url, OpenOptions())
    assert fingerprint_of(url, index_decode(decode), ident) != fingerprint_of(url, index_decode(), ident)


def test_empty_documents_and_ids_out_of_range_are_refused_alone(tmp_path):
    docs = [[1, 2], [], [3, 4, 5], [70_000], [6]]
    url = write_megatron(tmp_path / "e", docs)
    assert megatron_documents(url) == docs
    with pytest.raises(DataError, match="0 tokens"):
        list(ShardReader([url], shuffle=False, epochs=1))
    got = _items(url, vocab_size=65_536)
    assert [it.error.reason if it.error else it.sample.tokens.tolist() for it in got] == [
        [1, 2], "empty_sample", [3, 4, 5], "out_of_vocab_id", [6]]
    assert _block_docs(url) == [[1, 2]], "the blocks stop at the first document they do not judge plain"
    assert build_index(url).lengths.tolist() == [2, 0, 3, 1, 1]


def test_a_document_over_max_sample_bytes_is_refused_unread(tmp_path):
    url = write_megatron(tmp_path / "big", [[1] * 10, list(range(500)), [2] * 3])
    limits = Limits(max_sample_bytes=1000)
    got = _items(url, limits=limits)
    assert got[1].error.reason == "sample_too_large" and got[1].error.key == "1"
    assert [it.sample.tokens.tolist() for it in (got[0], got[2])] == [[1] * 10, [2] * 3]
    assert build_index(url, decode=index_decode(DecodeOptions(limits=limits))).lengths.tolist() == [10, BAD_LENGTH, 3]


def test_a_shard_is_named_by_its_idx(tmp_path):
    urls = write_megatron_shards(tmp_path / "d", make_token_docs(20, seed=1), 2)
    assert shard_format(urls[0]) == "megatron" and megatron.bin_url(urls[0]) == urls[0][:-4] + ".bin"
    assert expand_urls(str(tmp_path / "d")) == urls, "a directory lists each pair once, by its .idx"
    with pytest.raises(ValueError, match=r"named by its \.idx"):
        expand_urls(urls[0][:-4] + ".bin")
    assert megatron.bin_url("s3://b/x.idx?versionId=3") == "s3://b/x.bin?versionId=3"


def _rewrite(path: str, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def _damage(url: str, how: str) -> str:
    """Damage the pair of ``url``; returns what the error must say."""
    header = megatron.parse_header(open(url, "rb").read(34), os.path.getsize(url), url)
    if how == "magic":
        _rewrite(url, 0, b"NOTANIDX\x00")
        return "bad magic"
    if how == "version":
        _rewrite(url, 9, struct.pack("<Q", 2))
        return "version 2"
    if how == "float dtype":
        _rewrite(url, 17, struct.pack("<B", 7))
        return "dtype code 7"
    if how == "truncated idx":
        os.truncate(url, os.path.getsize(url) - 8)
        return "truncated or not a Megatron index"
    if how == "pointer":
        _rewrite(url, header.pointers_at + 8 * 5, struct.pack("<q", 12))
        return "document [0-9]+: sequence 5's pointer"
    if how == "document index":
        _rewrite(url, header.doc_index_at + 8 * 4, struct.pack("<q", 10**6))
        return "document [34]: document indices"
    if how == "longer bin":
        with open(megatron.bin_url(url), "ab") as f:
            f.write(b"\x00" * 8)
        return "not the .bin this .idx was written with"
    raise AssertionError(how)


def test_a_pointer_at_the_edge_of_a_read_is_checked(tmp_path, monkeypatch):
    """A range's index slice is checked against the sequence before it: a broken pointer at a slice's first sequence
    is found by the reader of that range alone (with no whole-index check before it)."""
    monkeypatch.setattr(megatron, "DOCS_PER_SLICE", 4)
    docs = make_token_docs(12, seed=2)
    url = write_megatron(tmp_path / "p", docs)  # one sequence a document
    header = megatron.parse_header(open(url, "rb").read(34), os.path.getsize(url), url)
    _rewrite(url, header.pointers_at + 8 * 8, struct.pack("<q", 4 * sum(map(len, docs[:8])) + 4))
    got = []
    with pytest.raises(DataError, match="document 8: sequence 8's pointer") as e:
        for item in _items(url, 8, 12):
            got.append(item)
    assert not got and e.value.key == "8"
    assert [it.sample.tokens.tolist() for it in _items(url, 0, 8)] == docs[:8]


@pytest.mark.parametrize("how", ["magic", "version", "float dtype", "truncated idx", "pointer", "document index",
                                 "longer bin"])
def test_a_corrupt_pair_is_refused_naming_the_file(tmp_path, how):
    docs = make_token_docs(12, seed=2)
    (url,) = write_megatron_shards(tmp_path, docs, 1)
    why = _damage(url, how)
    for read in (lambda: _items(url), lambda: build_index(url), lambda: _block_docs(url)):
        with pytest.raises(DataError, match=why) as e:
            read()
        assert e.value.url == url and len(str(e.value)) < 400, "the error names the file, never its content"


def test_a_truncated_bin_names_each_document_past_the_cut(tmp_path):
    docs = [[i] * 10 for i in range(1, 9)]
    url = write_megatron(tmp_path / "t", docs)
    bin_path = megatron.bin_url(url)
    os.truncate(bin_path, os.path.getsize(bin_path) - 50)  # int32: documents 6 (cut) and 7 are gone
    got = _items(url)
    assert [it.sample.tokens.tolist() for it in got[:6]] == docs[:6]
    assert [(it.error.reason, it.error.key) for it in got[6:]] == [("corrupt_shard", "6"), ("corrupt_shard", "7")]
    assert "truncated .bin" in str(got[6].error) and got[6].error.url == url
    assert build_index(url).lengths.tolist() == [10] * 6 + [BAD_LENGTH] * 2
    with pytest.raises(DataError, match="document 6: .*truncated .bin"):
        list(ShardReader([url], shuffle=False, epochs=1))
    kept = list(ShardReader([url], shuffle=False, epochs=1, read=ReadOptions(on_error="skip")))
    assert [s.tokens.tolist() for s in kept] == docs[:6]
    assert _block_docs(url) == docs[:6]


def test_the_bin_is_read_by_ranges_never_whole(tmp_path, monkeypatch):
    """A range reads its documents' bytes and a few index slices, not the shard."""
    import io

    from helpers_data import CountingFile

    import streampack.io.open as open_mod

    docs = make_token_docs(400, seed=4, max_len=200)
    url = write_megatron(tmp_path / "r", docs)
    monkeypatch.setattr(open_mod, "_open_local", lambda p: io.BufferedReader(CountingFile(p), 4096))
    CountingFile.log.clear()
    got = _items(url, 200, 210)
    assert [it.sample.tokens.tolist() for it in got] == docs[200:210]
    read = sum(n for _, n in CountingFile.log)
    wanted = 4 * sum(map(len, docs[200:210]))
    assert read <= wanted + 6 * 4096, (read, wanted)
    assert read < os.path.getsize(megatron.bin_url(url)) // 4
