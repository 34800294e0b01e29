"""The block reader's walk over tar headers (:func:`streampack.io.tar_block._chain`): the size fields are read as a
column, and the walk must be the one ``int(field, 8)`` gives header by header, for every form of the field."""

from __future__ import annotations

import numpy as np
import pytest
from helpers_data import make_token_docs, write_tar_shards
from helpers_hostile import BLOCK, archive, header, npy_bytes, pad, sample

from streampack.io import open as shard_open
from streampack.io import tar_block
from streampack.io.decode import DecodeOptions
from streampack.io.formats import ShardRange
from streampack.io.storage import OpenOptions
from streampack.io.tar_block import _chain, parse_tar
from streampack.io.tar_columns import ids_in_range


def _walk(buf: bytes, limit: int) -> tuple[list[int], list[int], int]:
    """The walk as tar defines it: each header's ``int(size, 8)`` data bytes, padded to a block, then the next."""
    heads, sizes, p = [], [], 0
    while p < limit:
        try:
            size = int(buf[p + 124:p + 135], 8)
        except ValueError:
            break
        step = BLOCK + ((size + BLOCK - 1) & -BLOCK)
        if step <= 0:
            break
        heads.append(p)
        sizes.append(size)
        p += step
    return heads, sizes, p


# forms of an 11-byte size field that int(..., 8) reads (blanks, a sign, underscores), and some it refuses
READ = [b"%011o", b"%11o", b"%-11o", b"+%010o", b"  %o  ", b"\t%o\n", b"0_%o"]
REFUSED = [b"%o\0", b"9%o", b"\x80%o", b"%o 1", b"-%o"]


def _member(rng: np.random.Generator, forms: list[bytes]) -> bytes:
    data = npy_bytes(rng.integers(0, 1000, int(rng.integers(1, 400))))
    form = forms[int(rng.integers(len(forms)))] if rng.random() < 0.3 else READ[0]
    field = (form % len(data))[:11].ljust(11, b" ")
    return header(f"{int(rng.integers(1 << 30)):010d}.npy", 0, size_field=field + b"\0") + pad(data)


@pytest.mark.parametrize("seed", range(20))
def test_chain_is_the_walk_of_int_sizes(seed: int) -> None:
    rng = np.random.default_rng(seed)
    members = [_member(rng, READ) for _ in range(int(rng.integers(3, 60)))]
    if seed % 2:  # one field int() refuses, where the walk ends
        members.insert(int(rng.integers(2, len(members) + 1)), _member(rng, REFUSED))
    buf = archive(*members)
    n = len(buf) - len(buf) % BLOCK
    for limit in (n, n // 2 + 7, BLOCK, 0):
        heads, sizes, p = _chain(buf, limit)
        want_heads, want_sizes, want_p = _walk(buf, limit)
        assert heads.tolist() == want_heads and sizes.tolist() == want_sizes and p == want_p, (seed, limit)
    assert len(_walk(buf, n)[0]) >= 2  # the walk went past the first header


def test_a_negative_size_ends_the_walk() -> None:
    """``-0000001000`` reads as -512: a step of no blocks, which held the walk on that header forever."""
    good = [sample(f"{i:08d}", [i + 1, 7]) for i in range(5)]
    bad = header("00000005.npy", 0, size_field=b"-0000001000\0") + pad(npy_bytes(np.array([4, 7])))
    buf = archive(*good, bad, *good)
    heads, _, p = _chain(buf, len(buf))
    assert len(heads) == 5 and p == len(b"".join(good))
    assert parse_tar(buf, base=0, first=0, end=None, final=True, url="x.tar", decode=DecodeOptions()) is None


@pytest.mark.parametrize("dtype", ["<i1", "<i2", "<i4", "<i8", ">i4", "<u1", "<u2", "<u4", "<u8"])
def test_ids_in_range_is_every_id_checked(dtype: str) -> None:
    """One maximum over the unsigned view decides what a minimum and a maximum decide, bound by bound."""
    rng = np.random.default_rng(len(dtype) + ord(dtype[1]))
    info = np.iinfo(np.dtype(dtype))
    starts, outcomes = np.array([0, 10, 30]), set()
    for bound in (5, 127, 128, 129, 2**15, 2**31, 2**63):
        for _ in range(20):
            tokens = rng.integers(0, min(info.max, 300) + 1, 50).astype(dtype)
            edges = [v for v in (info.min, info.max, -1, bound - 1, bound) if info.min <= v <= info.max]
            if rng.random() < 0.5:
                tokens[rng.integers(50)] = edges[int(rng.integers(len(edges)))]
            lengths = np.array([5, 15, int(rng.integers(1, 21))])
            want = all(0 <= int(x) < bound for a, n in zip(starts, lengths) for x in tokens[a:a + n])
            assert ids_in_range(tokens, starts, lengths, bound) == want, (bound, tokens)
            outcomes.add(want)
    assert outcomes == {True, False}


def test_a_read_buffer_is_reused_only_once_nothing_views_it(tmp_path) -> None:
    """The blocks of one shard view its read buffer: reading another shard meanwhile must not write into it, and once
    those blocks are gone the next read of that size takes it (no fresh pages to fault in)."""
    urls = write_tar_shards(tmp_path, make_token_docs(600, min_len=300, max_len=400, vocab=50_000), 2)
    streams: list = []

    def read(url: str) -> list:
        return list(tar_block.tar_blocks(url, ShardRange(start=0, first=0), decode=DecodeOptions(), opts=OpenOptions(),
                                         streams=streams))

    def buffer(block: tar_block.TokenBlock) -> object:
        return block.tokens.base.obj  # the memoryview numpy keeps of the buffer read into

    first = read(urls[0])
    assert len(first) == 1 and len(first[0]) == 300 and first[0].tokens.nbytes >= shard_open.SPARE_MIN
    kept = first[0].tokens.copy()
    second = read(urls[1])
    assert buffer(second[0]) is not buffer(first[0])
    assert np.array_equal(first[0].tokens, kept)  # the other read left the viewed buffer alone
    spare = [id(b) for b in shard_open.SPARE if b is buffer(first[0])]  # the pool keeps it alive: its id stays its own
    del first
    again = read(urls[0])
    assert np.array_equal(again[0].tokens, kept)
    assert spare == [id(buffer(again[0]))]  # the same buffer, taken again
    for f in streams:
        f.close()


def test_a_viewed_read_buffer_is_not_reused_where_the_reference_count_reads_low(tmp_path, monkeypatch) -> None:
    """An interpreter may keep fewer references than CPython 3.11 counts (3.14 skips some): the buffer's exports
    still keep a viewed buffer out of reuse."""
    import types

    monkeypatch.setattr(shard_open, "sys", types.SimpleNamespace(getrefcount=lambda obj: 3))
    urls = write_tar_shards(tmp_path, make_token_docs(600, min_len=300, max_len=400, vocab=50_000), 2)
    streams: list = []
    first = list(tar_block.tar_blocks(urls[0], ShardRange(start=0, first=0), decode=DecodeOptions(),
                                      opts=OpenOptions(), streams=streams))
    kept = first[0].tokens.copy()
    second = list(tar_block.tar_blocks(urls[1], ShardRange(start=0, first=0), decode=DecodeOptions(),
                                       opts=OpenOptions(), streams=streams))
    assert second[0].tokens.base.obj is not first[0].tokens.base.obj
    assert np.array_equal(first[0].tokens, kept)
    for f in streams:
        f.close()
