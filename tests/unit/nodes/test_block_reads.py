"""Reading shards as token blocks is how the one reader reads when it can, not a second semantics.

The graph's readers read pre-tokenized tar and parquet shards as blocks and hand the overlong
node runs of documents; the same reader read sample by sample (a ``ShardReader``, which has no
runs) gives the same PackedBatches, batch for batch and field for field (tar shards with or
without pax headers, parquet; every overlong policy; alignment; shuffled or not; finite and
infinite; several ranks), the same states (each restores the other's), and what the block
readers do not judge plain they hand to the per-sample reader, whose errors and counts are then
the stream's.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
from helpers_data import make_token_docs, write_tar_shards
from helpers_formats import write_parquet_shards
from helpers_hostile import archive, member, npy_bytes, sample, write_bytes
from node_checks import read_as, roundtrip, take

from streampack.dataset import PackedDataset
from streampack.errors import DataError, ErrorPolicy
from streampack.graph.build import build_graph
from streampack.io.urls import ShardList
from streampack.layout.batch import pack_batch
from streampack.layout.slices import pack_slices
from streampack.nodes.block_reader import BlockReader
from streampack.nodes.reader import ShardReader
from streampack.options import PackOptions, ReadOptions, TopologyOptions
from streampack.sample import Sample
from streampack.settings import Placement, Sources, StreamConfig

_TENSORS = ("input_ids", "labels", "position_ids", "cu_seqlens", "cu_seqlens_padded", "varlen_cu_seqlens",
            "varlen_cu_seqlens_bidirectional")
_SCALARS = ("max_seqlen", "varlen_max_seqlen", "varlen_max_seqlen_bidirectional", "num_tokens", "num_targets",
            "num_target_docs", "doc_keys", "capacity", "num_packs", "align", "pad_id", "ignore_index", "est_cost")


def full(batch) -> tuple:
    """Every field of a batch that the stream decides (the stats without this process's timings)."""
    stats = None if batch.stats is None else {k: (type(v), v) for k, v in dataclasses.asdict(batch.stats).items()
                                              if k not in ("build_seconds", "events")}
    return (tuple(getattr(batch, f).dtype for f in _TENSORS), tuple(getattr(batch, f).numpy().tobytes() for f in _TENSORS),
            tuple(getattr(batch, f) for f in _SCALARS), stats,
            batch.varlen_cu_seqlens_bidirectional is batch.varlen_cu_seqlens)


def _run(monkeypatch, fast: bool, urls, n: int | None = None, state=None, **kw):
    read_as(monkeypatch, fast)
    ds = PackedDataset(urls, **{"capacity": 256, "packs_per_batch": 2, "seed": 3, "epochs": 1,
                                "packing": PackOptions(window=16), **kw})
    if state is not None:
        ds.load_state_dict(roundtrip(state))
    it = iter(ds)
    ds.reads_blocks = ds._graph.nodes["overlong"].reads_blocks
    reader = ds._graph.nodes["reader"]
    out = [full(b) for b in (take(it, n) if n is not None else it)]
    ds.reader_kind_reads = getattr(reader, "sample_reads", None)
    return out, ds


def _same(monkeypatch, urls, **kw):
    fast, ds_fast = _run(monkeypatch, True, urls, **kw)
    slow, ds_slow = _run(monkeypatch, False, urls, **kw)
    assert len(fast) > 2, "too few batches for the comparison to mean anything"
    assert fast == slow
    assert ds_fast.metrics() == ds_slow.metrics()
    assert ds_fast.reads_blocks and not ds_slow.reads_blocks
    return fast


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Documents of 1..700 tokens (some over the capacity of 256) in three formats."""
    root = tmp_path_factory.mktemp("contiguous")
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 30_000, int(n)).tolist() for n in np.clip(rng.lognormal(4.3, 1.0, 160), 1, 700)]
    tar = write_tar_shards(root / "tar", docs, 3)
    parquet = write_parquet_shards(root / "parquet", docs, 3, row_group_size=16)
    import webdataset as wds  # pax headers, int32 ids, "<key>.input_ids.npy": what the benchmarks write

    pax = []
    for s in range(3):
        path = str(root / f"pax-{s}.tar")
        with wds.TarWriter(path) as sink:
            for i in range(s * len(docs) // 3, (s + 1) * len(docs) // 3):
                sink.write({"__key__": f"{i:09d}", "input_ids.npy": np.asarray(docs[i], dtype=np.int32)})
        pax.append(path)
    return {"tar": tar, "pax": pax, "parquet": parquet}


@pytest.mark.parametrize("fmt", ["tar", "pax", "parquet"])
@pytest.mark.parametrize("overlong", ["split", "truncate", "drop"])
def test_same_batches_every_format_and_policy(monkeypatch, corpus, fmt: str, overlong: str) -> None:
    _same(monkeypatch, corpus[fmt], packing=PackOptions(window=16, overlong=overlong))


@pytest.mark.parametrize("settings", [
    {"topology": TopologyOptions(cp_size=2)},                                  # align 4
    {"shuffle": False, "packing": PackOptions(window=5, max_wait=2)},
    {"packs_per_batch": 3, "packing": PackOptions(window=64, algorithm="ffd", pad_id=7, ignore_index=-1)},
    {"epochs": 2, "packing": PackOptions(window=16, ignore_index=5)},           # ids may equal ignore_index
])
def test_same_batches_other_settings(monkeypatch, corpus, settings) -> None:
    _same(monkeypatch, corpus["pax"], **settings)


def test_same_batches_infinite_several_ranks(monkeypatch, corpus) -> None:
    for rank in range(2):
        kw = {"epochs": None, "n": 30, "topology": TopologyOptions(dp_rank=rank, dp_size=2)}
        fast, _ = _run(monkeypatch, True, corpus["tar"], **kw)
        slow, _ = _run(monkeypatch, False, corpus["tar"], **kw)
        assert len(fast) == 30 and fast == slow


def test_shard_parts_of_an_infinite_stream(monkeypatch, corpus) -> None:
    """Fewer shards than readers: each reader reads one part of a shard, cut through its index."""
    for rank in range(3):
        kw = {"epochs": None, "n": 12, "topology": TopologyOptions(dp_rank=rank, dp_size=3)}
        fast, ds = _run(monkeypatch, True, corpus["pax"][:1], **kw)
        slow, _ = _run(monkeypatch, False, corpus["pax"][:1], **kw)
        assert len(fast) == 12 and fast == slow and ds.reader_kind_reads == 0


def test_planned_ranges_end_inside_shards(monkeypatch, corpus) -> None:
    """A finite epoch over two ranks cuts shards at sample boundaries; with pax headers the
    per-sample reader judges a range's last sample by reading past its end: the blocks judge it
    the same way (``tar_block._intact_after``) instead of handing the range over."""
    for rank in range(2):
        kw = {"topology": TopologyOptions(dp_rank=rank, dp_size=2, equal_batches="count")}
        fast, ds = _run(monkeypatch, True, corpus["pax"], **kw)
        slow, _ = _run(monkeypatch, False, corpus["pax"], **kw)
        assert len(fast) > 2 and fast == slow
        assert ds.reader_kind_reads == 0, "a planned range was read per sample"


@pytest.mark.parametrize("save_fast,load_fast,read_ahead", [  # ~2 s each: the two crossings in the fast loop
    pytest.param(True, True, 16, marks=pytest.mark.slow), (True, False, 16), (False, True, 16),
    pytest.param(True, True, 1, marks=pytest.mark.slow), pytest.param(False, True, 1, marks=pytest.mark.slow)])
def test_states_restore_on_either_path(monkeypatch, corpus, save_fast: bool, load_fast: bool, read_ahead: int) -> None:
    """Restored packs are re-read ``read_ahead`` at a time (1: every pack alone, and the window's
    carried documents leave mixed with new ones in later rounds)."""
    import streampack.nodes.window_packer as window_packer

    monkeypatch.setattr(window_packer, "READ_AHEAD", read_ahead)
    kw = {"epochs": 2, "packing": PackOptions(window=48, overlong="split")}  # split chunks wait in the state
    whole, _ = _run(monkeypatch, True, corpus["pax"], **kw)
    for stop in (1, 7, len(whole) // 2 + 3):
        read_as(monkeypatch, save_fast)
        ds = PackedDataset(corpus["pax"], capacity=256, packs_per_batch=2, seed=3, **kw)
        head = [full(b) for b in take(iter(ds), stop)]
        rest, _ = _run(monkeypatch, load_fast, corpus["pax"], state=ds.state_dict(), **kw)
        assert head + rest == whole, f"resume after {stop} batches diverged"


def _restored_window(monkeypatch, urls, *, before) -> tuple[dict, list]:
    """A state saved once the reader has read every sample (it is at the next epoch), so only
    the packer's window is left, and the batches a restore of it yields (checked equal to the
    uninterrupted run's); ``before()`` runs right before those batches are read."""
    read_as(monkeypatch, True)

    def make():
        return PackedDataset(urls, capacity=1024, packs_per_batch=2, seed=1, epochs=1, packing=PackOptions(window=128))

    whole = [full(b) for b in make()]
    ds = make()
    it = iter(ds)
    done = 0
    while ds.state_dict()["graph"]["chain"]["source"]["source"]["source"]["epoch"] == 0:
        next(it)
        done += 1
    state = roundtrip(ds.state_dict())
    restored = make()
    restored.load_state_dict(state)
    before()
    rest = [full(b) for b in iter(restored)]
    assert rest == whole[done:]
    return state, rest


def test_restore_reads_only_the_carried_samples(monkeypatch, tmp_path) -> None:
    """A restore reads the window's carried samples, not the shard spans between them: before,
    every re-read of a few packs' documents read and checked the clusters they sat in whole (the
    25 batches after a restore on the benchmark corpus read 31.7 MB where uninterrupted ones read 3.6)."""
    import io

    import webdataset as wds
    from helpers_data import CountingFile

    import streampack.io.open as open_mod

    rng = np.random.default_rng(5)
    urls = []
    for s in range(2):
        urls.append(str(tmp_path / f"pax-{s}.tar"))
        with wds.TarWriter(urls[-1]) as sink:
            for i in range(400):
                n = int(np.clip(rng.lognormal(5.3, 0.8), 8, 1500))
                sink.write({"__key__": f"{s}-{i:06d}", "input_ids.npy": rng.integers(0, 30_000, n).astype(np.int32)})
    monkeypatch.setattr(open_mod, "_open_local", lambda p: io.BufferedReader(CountingFile(p)))
    state, rest = _restored_window(monkeypatch, urls, before=CountingFile.log.clear)
    assert len(rest) > 8
    refs = state["graph"]["chain"]["source"]["table"]["refs"]
    # each carried sample: int32 ids, a pax header, a header, an .npy header; a buffered file
    # reads at least io.DEFAULT_BUFFER_SIZE at a time
    carried = int(np.maximum(refs["length"].numpy() * 4 + 1536, io.DEFAULT_BUFFER_SIZE).sum())
    read = sum(n for _, n in CountingFile.log)
    assert 0 < read <= 1.5 * carried, (read, carried)  # 0.96x; 3.4x when clusters were read whole


def test_restore_reads_each_parquet_row_group_once(monkeypatch, tmp_path) -> None:
    """A restore reads each row group its carried rows are in once, however many re-reads
    (``READ_AHEAD`` packs at a time) they leave over: before, every re-read read the row groups
    from its first wanted row to its last (47 group reads for 13 groups here; the 25 batches after
    a restore on the benchmark corpus read 37 MB where the uninterrupted ones read 1.5)."""
    import streampack.io.parquet_block as parquet_block

    rng = np.random.default_rng(6)
    docs = [rng.integers(0, 30_000, int(np.clip(rng.lognormal(5.3, 0.8), 8, 1500))).tolist() for _ in range(800)]
    urls = write_parquet_shards(tmp_path, docs, 2, row_group_size=50)
    reads: list[tuple[int, int]] = []
    real = parquet_block._group

    def count() -> None:
        monkeypatch.setattr(parquet_block, "_group", lambda pf, group, firsts, decode: reads.append((id(pf), group))
                            or real(pf, group, firsts, decode))

    state, rest = _restored_window(monkeypatch, urls, before=count)
    refs = state["graph"]["chain"]["source"]["table"]["refs"]
    groups = len({(shard, row // 50) for shard, row in zip(refs["shard"].tolist(), refs["offset"].tolist())})
    assert len(rest) > 8 and 0 < len(reads) <= groups, (len(reads), groups)


def test_state_is_the_per_sample_state(monkeypatch, corpus) -> None:
    """Same keys, same values: a checkpoint does not say which path wrote it."""
    states = []
    for fast in (True, False):
        read_as(monkeypatch, fast)
        ds = PackedDataset(corpus["tar"], capacity=256, packs_per_batch=2, seed=3, epochs=1,
                           packing=PackOptions(window=16))
        take(iter(ds), 5)
        state = ds.state_dict()
        state.pop("metrics")
        states.append(state)
    assert _plain(states[0]) == _plain(states[1])


def _plain(tree):
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_plain(v) for v in tree]
    if isinstance(tree, torch.Tensor):
        return (str(tree.dtype), tuple(tree.shape), tree.tolist())
    return tree


def test_elastic_resume_same_on_both_paths(monkeypatch, corpus) -> None:
    """States of two ranks, resumed by one: the same batches whichever path saved and loads."""
    outs = []
    for fast in (True, False):
        read_as(monkeypatch, fast)
        states = []
        for rank in range(2):
            ds = PackedDataset(corpus["tar"], capacity=256, packs_per_batch=2, seed=3, epochs=1,
                               packing=PackOptions(window=16),
                               topology=TopologyOptions(dp_rank=rank, dp_size=2, equal_batches="count"))
            take(iter(ds), 3)
            states.append(roundtrip(ds.state_dict()))
        ds = PackedDataset(corpus["tar"], capacity=256, packs_per_batch=2, seed=3, epochs=1,
                           packing=PackOptions(window=16))
        ds.load_state_dict(states)
        outs.append([full(b) for b in ds])
    assert len(outs[0]) > 3 and outs[0] == outs[1]


def _stream(reader, blocks: bool) -> list:
    """Every document a reader hands out: (doc key, ids, origin), and its final state; a block
    reader counts in ``reader.from_blocks`` the documents it read as blocks."""
    reader.reset(None)
    reader.from_blocks = 0
    out = []
    while True:
        if not blocks:
            try:
                s = next(reader)
            except StopIteration:
                break
            out.append((s.doc_key, s.tokens.tolist(), s.origin))
            continue
        run = reader.run()
        if run is None:
            break
        k = len(run) if run.consumed else max(1, len(run) // 3)  # consume in uneven steps
        if not run.consumed:
            reader.consume(k)
            reader.from_blocks += k
        for i in range(run.lo, run.lo + k):
            b = run.block
            out.append((b.doc_keys()[i], b.ids(i).tolist(), (int(b.offsets[i]), int(b.numbers[i]), int(b.next_offsets[i]),
                                                           int(b.next_numbers[i]))))
    return out, _plain(reader.state_dict())


def _origins(stream):
    return [(k, t, o if isinstance(o, tuple) else (o.offset, o.number, o.next_offset, o.next_number)) for k, t, o in stream]


def _both_readers(url, chunk_bytes=None, **kw):
    """The documents a BlockReader hands out (as the ShardReader's), and how many came as blocks."""
    reader = BlockReader(url, shuffle=False, epochs=1, chunk_bytes=chunk_bytes, **kw)
    fast, fast_state = _stream(reader, True)
    slow, slow_state = _stream(ShardReader(url, shuffle=False, epochs=1, **kw), False)
    assert _origins(fast) == _origins(slow)
    assert fast_state == slow_state
    return fast, reader.from_blocks


def test_block_reader_small_chunks_is_the_shard_reader(corpus) -> None:
    for url in corpus["pax"] + corpus["tar"]:
        for chunk in (None, 2048):
            docs, from_blocks = _both_readers(url, chunk_bytes=chunk)
            assert len(docs) > 20 and from_blocks == len(docs)


def test_hostile_shard_hands_over(tmp_path) -> None:
    """Each kind of sample the block reader does not take: the per-sample reader reads on from
    there, so the stream (and what on_error='skip' counts) is the per-sample reader's."""
    good = [sample(f"{i:08d}", [i + 1, 7, 9]) for i in range(40)]
    bad = {
        "float ids": member("00000100.npy", npy_bytes(np.array([1.5, 2.0]))),
        "out of vocab": sample("00000101", [3, 2**31 + 5]),
        "two members": sample("00000102", [4, 5], **{"labels.npy": npy_bytes(np.array([4, 5]))}),
        "repeated key": sample("00000003", [6, 6]),
        "dot in key": sample("a.b", [7, 7]),
        "corrupt header": b"\x01" * 512,
        "empty": member("00000103.npy", npy_bytes(np.array([], dtype=np.int64))),
        "big-endian": member("00000104.npy", npy_bytes(np.array([1, 2], dtype=">i4"))),
        "long name": _gnu_long_name("x" * 120 + ".npy", npy_bytes(np.array([1, 2]))),
        "pax path": _pax_path("00000105.npy", npy_bytes(np.array([1, 2]))),
    }
    for what, part in bad.items():
        url = write_bytes(tmp_path / f"{what.replace(' ', '_')}.tar", archive(*good[:20], part, *good[20:]))
        for chunk in (None, 4096):
            stream, from_blocks = _both_readers(url, chunk_bytes=chunk, error_policy=ErrorPolicy("skip"))
            # read in small chunks, the samples before the bad one come as blocks (in one chunk, a
            # bad sample hands the whole chunk over: a known cost, not a difference)
            assert len(stream) >= 40 and (chunk is None or from_blocks >= 16), (what, chunk, from_blocks)


def test_restore_with_a_sample_the_pick_does_not_take(monkeypatch, tmp_path) -> None:
    """A carried sample of one shard is not plain (a member before its ids): the pick of all
    shards at once gives none, the other shards are picked alone, that one is read per sample,
    and the restore gives the uninterrupted batches."""
    rng = np.random.default_rng(9)
    urls = []
    for s in range(3):
        parts = [sample(f"{s}{i:07d}", rng.integers(0, 1000, int(rng.integers(20, 200))).tolist()) for i in range(60)]
        if s == 1:
            key, ids = f"{s}{30:07d}", np.arange(1, 301)  # its labels member first: the pick refuses it
            parts[30] = member(f"{key}.labels.npy", npy_bytes(ids)) + member(f"{key}.npy", npy_bytes(ids))
        urls.append(write_bytes(tmp_path / f"s{s}.tar", archive(*parts)))
    read_as(monkeypatch, True)
    kw = {"capacity": 512, "packs_per_batch": 2, "seed": 4, "epochs": 1, "shuffle": False,
          "packing": PackOptions(window=64)}
    whole = [full(b) for b in PackedDataset(urls, **kw)]
    for stop in range(1, len(whole)):  # some of them with the bad sample in the window
        ds = PackedDataset(urls, **kw)
        head = [full(b) for b in take(iter(ds), stop)]
        restored = PackedDataset(urls, **kw)
        restored.load_state_dict(roundtrip(ds.state_dict()))
        assert head + [full(b) for b in restored] == whole, f"resume after {stop} batches diverged"


def _tar_member(name: str, data: bytes, fmt: int, pax: dict[str, str] | None = None) -> bytes:
    """One member as ``tarfile`` writes it in format ``fmt`` (extension headers included)."""
    import io
    import tarfile

    buf = io.BytesIO()
    tf = tarfile.open(fileobj=buf, mode="w", format=fmt)
    info = tarfile.TarInfo(name)
    info.size = len(data)
    if pax:
        info.pax_headers = pax
    tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()  # before close(): no end-of-archive blocks yet


def _gnu_long_name(name: str, data: bytes) -> bytes:
    import tarfile

    return _tar_member(name, data, tarfile.GNU_FORMAT)


def _pax_path(name: str, data: bytes) -> bytes:
    import tarfile

    return _tar_member(name, data, tarfile.PAX_FORMAT, {"path": name, "comment": "x"})


def test_hostile_shard_errors_in_the_dataset(monkeypatch, tmp_path) -> None:
    good = [sample(f"{i:08d}", [i + 1] * (i % 9 + 1)) for i in range(60)]
    url = write_bytes(tmp_path / "bad.tar", archive(*good[:30], sample("00000100", [3, 2**31 + 5]), *good[30:]))
    _same(monkeypatch, [url], read=ReadOptions(on_error="skip"), capacity=32)
    errors = []
    for fast in (True, False):
        read_as(monkeypatch, fast)
        with pytest.raises(DataError) as info:
            list(PackedDataset([url], capacity=32, packs_per_batch=2, epochs=1, packing=PackOptions(window=16)))
        errors.append((info.value.reason, info.value.key, str(info.value)))
    assert errors[0] == errors[1] and errors[0][:2] == ("out_of_vocab_id", "00000100")


def test_missing_shard_is_skipped_as_per_sample(monkeypatch, tmp_path) -> None:
    urls = write_tar_shards(tmp_path, make_token_docs(60, seed=2, max_len=30), 3)
    urls.insert(1, str(tmp_path / "gone.tar"))
    open(urls[1], "wb").close()
    os.remove(urls[1])
    fast, ds = _run(monkeypatch, True, urls, read=ReadOptions(on_error="skip"), capacity=32)
    assert ds.metrics()["errors"]["counts"] == {"missing_shard": 1}
    _same(monkeypatch, urls, read=ReadOptions(on_error="skip"), capacity=32)


def test_parquet_with_nulls_and_text_hands_over(monkeypatch, tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = make_token_docs(50, seed=1, min_len=1, max_len=30)
    column = pa.array([None if i == 23 else d for i, d in enumerate(docs)], pa.list_(pa.int64()))
    nulls = str(tmp_path / "nulls.parquet")
    pq.write_table(pa.table({"input_ids": column}), nulls, row_group_size=8)
    _same(monkeypatch, [nulls], read=ReadOptions(on_error="skip"), capacity=32)


def test_what_reads_as_blocks(monkeypatch, tmp_path) -> None:
    """Documents go to the overlong node as block runs only from a reader that is its direct
    source and reads a format with blocks; jsonl, labels and stages read every sample alone."""
    from helpers_data import write_jsonl_shards

    tar = write_tar_shards(tmp_path / "t", make_token_docs(20), 2)
    jsonl = write_jsonl_shards(tmp_path / "j", make_token_docs(20), 2)
    config = StreamConfig(capacity=64, epochs=1, packing=PackOptions(window=8))

    def reads(urls, read=ReadOptions(), **kw):
        graph = build_graph(dataclasses.replace(config, read=read), Sources(shards=ShardList.of(urls)), Placement(), **kw)
        graph.root.reset(None)
        next(graph.root)
        overlong, reader = graph.nodes["overlong"], graph.nodes["reader"]
        list(graph.root)
        return overlong.reads_blocks, reader.sample_reads

    assert reads(tar) == (True, 0)
    assert reads(jsonl) == (True, 20)
    assert reads(tar, read=ReadOptions(labels_key="labels")) == (True, 20)
    assert reads(tar, stages=[lambda s: s]) == (False, 0)
    assert reads(tar, around={"reader": lambda n: n}) == (True, 0)


@pytest.mark.parametrize("align", [1, 2, 8])
@pytest.mark.parametrize("pad_id,ignore_index", [(0, -100), (7, -1), (0, 3)])
def test_pack_slices_is_pack_batch(align: int, pad_id: int, ignore_index: int) -> None:
    rng = np.random.default_rng(align * 31 + pad_id)
    buf = rng.integers(0, 9, 20_000).astype(np.int32)  # small ids: some equal ignore_index=3
    capacity, packs, starts, lengths = 64, [], [], []
    at = 0
    for _ in range(5):
        room, pack = capacity, []
        while True:
            n = int(rng.integers(1, 30))
            span = -(-n // align) * align
            if span > room:
                break
            room -= span
            pack.append(Sample(key=f"d{at}", url="u", tokens=buf[at:at + n].astype(np.int64)))
            starts.append(at)
            lengths.append(n)
            at += n + int(rng.integers(0, 5))
        packs.append(pack)
    keys = tuple(s.doc_key for p in packs for s in p)
    got = pack_slices([buf] * len(lengths), np.array(starts), np.array(lengths), [len(p) for p in packs], keys,
                      capacity=capacity, align=align, pad_id=pad_id, ignore_index=ignore_index, ids_nonnegative=True)
    want = pack_batch(packs, capacity=capacity, align=align, pad_id=pad_id, ignore_index=ignore_index)
    assert full(got) == full(want)


@pytest.mark.parametrize("pack_lengths", [
    [[64]], [[1]], [[64], [1], [63, 1]], [[1, 1, 1], [2, 62], [64], [30]], [[10, 20], [10, 20]]])
@pytest.mark.parametrize("ignore_index,nonnegative", [(-100, True), (-100, False), (5, True)])
def test_pack_slices_edges_are_pack_batch(pack_lengths, ignore_index: int, nonnegative: bool) -> None:
    # full packs (no padding run), one-token documents, packs of one document, a batch of one pack
    buf = np.arange(500, dtype=np.int32) % 11
    lengths = [n for pack in pack_lengths for n in pack]
    starts = np.cumsum([0] + lengths[:-1]) + 3
    packs, i = [], 0
    for pack in pack_lengths:
        packs.append([Sample(key=f"d{i + j}", url="u", tokens=buf[starts[i + j]:starts[i + j] + n].astype(np.int64))
                      for j, n in enumerate(pack)])
        i += len(pack)
    keys = tuple(s.doc_key for p in packs for s in p)
    got = pack_slices([buf] * len(lengths), starts, np.array(lengths), [len(p) for p in pack_lengths], keys,
                      capacity=64, pad_id=9, ignore_index=ignore_index, ids_nonnegative=nonnegative)
    assert full(got) == full(pack_batch(packs, capacity=64, pad_id=9, ignore_index=ignore_index))


@pytest.mark.parametrize("align", [1, 4])
def test_pack_slices_refuses_what_pack_batch_refuses(align: int) -> None:
    """The same refusals, in the same words, on both the back-to-back and the aligned path."""
    capacity = 60  # a multiple of 4: 63 tokens need a 64-token span
    cases = [  # packs of (key, length)
        ([[("a", 5)], []], "pack 1 is empty"),
        ([[("a", 5)], [("b", 0), ("c", 3)]], "document 'b' in pack 1 has zero length"),
        ([[("a", 5)], [("b", 56), ("c", 5)]], "pack 1 holds 6[14] tokens.*more than capacity=60"),
    ]
    if align > 1:
        cases.append(([[("a", 4)], [("b", 63)]], "document 'b' of length 63 needs 64 tokens after align=4"))
    buf = np.ones(200, dtype=np.int32)
    for packs, match in cases:
        flat = [doc for pack in packs for doc in pack]
        with pytest.raises(ValueError, match=match):
            pack_batch([[{"input_ids": [1] * n, "key": k} for k, n in pack] for pack in packs],
                       capacity=capacity, align=align)
        with pytest.raises(ValueError, match=match):
            pack_slices([buf] * len(flat), np.zeros(len(flat), dtype=np.int64), np.array([n for _, n in flat]),
                        [len(pack) for pack in packs], tuple(k for k, _ in flat), capacity=capacity, align=align)
