"""Picking chosen samples of a tar shard by offset (what a restore re-reads): the same documents,
origins and keys the block reader gives for them, and None wherever the block reader would not
take a sample, so the per-sample reader judges it."""

from __future__ import annotations

import numpy as np
import pytest
import webdataset as wds
from helpers_data import write_tar_shards

from streampack.io.blocks import read_blocks, read_samples_at
from streampack.io.decode import DecodeOptions
from streampack.io.formats import ShardRange
from streampack.io.storage import OpenOptions


def _shard(path, n=60, seed=0) -> str:
    rng = np.random.default_rng(seed)
    with wds.TarWriter(str(path)) as sink:  # pax headers, int32 ids
        for i in range(n):
            sink.write({"__key__": f"k{i:05d}", "input_ids.npy": rng.integers(0, 1000, int(rng.integers(1, 900))).astype(np.int32)})
    return str(path)


def _whole(url: str):
    streams: list = []
    blocks = list(read_blocks(url, ShardRange(start=0, first=0), decode=DecodeOptions(), opts=OpenOptions(), streams=streams))
    for f in streams:
        f.close()
    assert len(blocks) == 1 and blocks[0].done
    return blocks[0]


def _pick_all(shards, **kw):
    streams: list = []
    try:
        return read_samples_at(shards, decode=kw.get("decode", DecodeOptions()), opts=OpenOptions(), streams=streams)
    finally:
        for f in streams:
            f.close()


def _pick(url: str, clusters, **kw):
    blocks = _pick_all([(url, clusters)], **kw)
    return None if blocks is None else blocks[0]


def _same_docs(picked, whole, docs) -> None:
    assert len(picked) == len(docs)
    for i, d in enumerate(docs):
        assert picked.ids(i).tolist() == whole.ids(d).tolist()
        assert picked.doc_keys()[i] == whole.doc_keys()[d]
        for field in ("offsets", "next_offsets", "numbers", "next_numbers", "lengths"):
            assert int(getattr(picked, field)[i]) == int(getattr(whole, field)[d]), field


@pytest.mark.parametrize("need", [1, 4096, 1 << 20])
def test_picked_samples_are_the_block_readers(tmp_path, need: int) -> None:
    """Any read size (1 byte: every sample read on for; 1 MiB: the whole shard in one read)."""
    for url in (_shard(tmp_path / "pax.tar"),
                write_tar_shards(tmp_path / "plain", [[i + 1] * (i % 50 + 1) for i in range(60)], 1)[0]):
        whole = _whole(url)
        docs = [0, 3, 4, 17, 40, len(whole) - 1]
        at = [(int(whole.offsets[d]), int(whole.numbers[d])) for d in docs]
        picked = _pick(url, [(at[:3], need), (at[3:], need)])
        _same_docs(picked, whole, docs)


def test_not_a_plain_sample_is_none(tmp_path) -> None:
    url = _shard(tmp_path / "pax.tar")
    whole = _whole(url)
    good = (int(whole.offsets[2]), 2)
    # an offset inside a member's data, not at a header
    assert _pick(url, [([good, (int(whole.offsets[5]) + 512, 5)], 1 << 16)]) is None
    # ids past the vocabulary the options allow
    assert _pick(url, [([good], 1 << 16)], decode=DecodeOptions(vocab_size=2)) is None
    # options that ask for more than ids, or a format read by row group
    assert _pick(url, [([good], 1 << 16)], decode=DecodeOptions(labels_key="labels")) is None
    assert _pick(str(tmp_path / "x.parquet"), [([good], 1 << 16)]) is None
    # a shard cut inside the sample: the per-sample reader reports the truncation
    cut = tmp_path / "cut.tar"
    cut.write_bytes(open(url, "rb").read()[:int(whole.offsets[9]) + 1536])
    assert _pick(str(cut), [([(int(whole.offsets[9]), 9)], 1 << 16)]) is None
    # a corrupt header checksum
    bad = bytearray(open(url, "rb").read())
    bad[int(whole.offsets[7]) + 148] ^= 1
    (tmp_path / "bad.tar").write_bytes(bytes(bad))
    assert _pick(str(tmp_path / "bad.tar"), [([(int(whole.offsets[7]), 7)], 1 << 16)]) is None


def test_several_shards_are_checked_in_one_pass(tmp_path) -> None:
    """A block per shard, sharing one buffer; one sample that is not plain in any of them gives None."""
    urls = [_shard(tmp_path / f"s{i}.tar", seed=i) for i in range(3)]
    wholes = [_whole(u) for u in urls]
    docs = [[1, 2, 30], [0], [5, 59]]
    shards = [(u, [([(int(w.offsets[d]), int(w.numbers[d])) for d in ds], 4096)]) for u, w, ds in zip(urls, wholes, docs)]
    blocks = _pick_all(shards)
    assert [b.url for b in blocks] == urls and blocks[0].tokens is blocks[2].tokens
    for block, whole, ds in zip(blocks, wholes, docs):
        _same_docs(block, whole, ds)
    bad = bytearray(open(urls[1], "rb").read())
    bad[int(wholes[1].offsets[0]) + 148] ^= 1
    (tmp_path / "s1.tar").write_bytes(bytes(bad))
    assert _pick_all(shards) is None
