"""Elastic resume (issue 11, build item 4): the states of every reader of a run on
``(dp_size=a, num_workers=b)`` resume on ``(c, d)`` with every sample of the epoch trained
exactly once, including samples that sat in packer windows and chunks of a split document
still pending at save time.

Finding: a checkpoint only resumed on the same ``dp_size`` and ``num_workers``.

The 4x2 -> 3x3 and 2x1 -> 4x2 cases run real StatefulDataLoader workers; the others simulate
ranks and workers in-process (``topology_sim``) to try many stop points quickly.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from helpers_data import (
    make_text_docs,
    make_token_docs,
    write_jsonl_shards,
    write_tar_shards,
)
from node_checks import canon, collect_documents, write_token_shards
from topology_sim import SimRank, roundtrip
from torchdata.stateful_dataloader import StatefulDataLoader

from streampack.dataset import PackedDataset
from streampack.nodes.collate import FILLER_KEY
from streampack.nodes.stages import MapSamples, NodeStage
from streampack.options import PackOptions, TokenizeOptions, TopologyOptions
from streampack.plan import elastic
from streampack.plan.cursor import Split
from streampack.plan.sharding import Span
from streampack.plan.state import dataset_states, record_of, table_size

CAP = 256


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    # long-tail lengths up to 3 x capacity: windows carry samples and documents get split
    urls, docs = write_token_shards(tmp_path_factory.mktemp("elastic"), 300, 5, mean=110, seed=3, max_len=3 * CAP)
    list(PackedDataset(urls, capacity=CAP, epochs=1, packing=PackOptions(window=16)))  # compile the packer pre-fork
    return urls, docs


def _ds(urls, rank: int, size: int, *, window: int = 24, **kw) -> PackedDataset:
    return PackedDataset(urls, **{"capacity": CAP, "epochs": 1, "seed": 2, "packs_per_batch": 2,
                                  "packing": PackOptions(window=window, max_wait=3),
                                  "topology": TopologyOptions(dp_rank=rank, dp_size=size, equal_batches="count"), **kw})


def _carried(states) -> tuple[int, int]:
    """(samples carried in packer windows, split documents with chunks pending) at save time."""
    found = [(elastic.find_state(s["graph"], "WindowPacker"), elastic.find_state(s["graph"], "OverlongNode"))
             for s in states if s["graph"] is not None]
    carried = sum(table_size(elastic.WindowPacker.undelivered(p).carry) for p, _ in found if p is not None)
    pending = sum(Split.from_state(o["pending"]) is not None for _, o in found if o is not None)
    return carried, pending


@pytest.mark.parametrize("old,new,steps", [pytest.param((4, 2), (3, 3), 3, marks=pytest.mark.slow),
                                           ((2, 1), (4, 2), 5)])
def test_elastic_resume_with_dataloader_workers(shards, old, new, steps):
    urls, docs = shards
    (a, b), (c, d) = old, new
    consumed, states = [], []
    for rank in range(a):
        loader = StatefulDataLoader(_ds(urls, rank, a), batch_size=None, num_workers=b)
        it = iter(loader)
        consumed += [next(it) for _ in range(steps)]
        states += dataset_states(roundtrip(loader.state_dict()))  # e.g. all_gather_object of each rank's
        del it
    assert len(states) == a * max(b, 1)
    carried, _ = _carried(states)
    assert carried > 0, "the save point must hold samples in packer windows (else this proves little)"
    counts = []
    for rank in range(c):
        ds = _ds(urls, rank, c)
        ds.load_state_dict(states)
        got = list(StatefulDataLoader(ds, batch_size=None, num_workers=d))
        counts.append(len(got))
        consumed += got
    assert len(set(counts)) == 1, counts
    assert all(b.total_tokens == 2 * CAP for b in consumed)
    # every chunk of every document exactly once (collect_documents refuses a chunk seen twice)
    assert collect_documents(consumed) == {f"{i:08d}": doc for i, doc in enumerate(docs)}


def _old_run(make, a: int, b: int, steps: int) -> tuple[list, list]:
    ranks = [SimRank(lambda r=r: make(r, a), b) for r in range(a)]
    consumed = [next(rk) for rk in ranks for _ in range(steps)]
    return consumed, [s for rk in ranks for s in rk.states()]


def _new_run(make, c: int, d: int, states) -> tuple[list, list[int]]:
    """Every new rank's batches to the end (each loads all old states), and the counts."""
    runs = [list(SimRank(lambda r=rank: make(r, c), d, load=states)) for rank in range(c)]
    return [x for run in runs for x in run], [len(run) for run in runs]


def _chunks(batches) -> Counter:
    return Counter(k for b in batches for k in b.doc_keys if k != FILLER_KEY)


@pytest.mark.parametrize("a,b,c,d,steps", [(4, 2, 3, 3, 2), (3, 0, 1, 2, 4), (1, 3, 2, 2, 6)])
def test_elastic_simulated_topologies_and_pending_chunks(shards, a, b, c, d, steps):
    urls, _ = shards
    make = lambda r, size: _ds(urls, r, size, window=8, packs_per_batch=1)  # noqa: E731
    consumed, states = _old_run(make, a, b, steps)
    got, counts = _new_run(make, c, d, states)
    assert len(set(counts)) == 1
    consumed += got
    full = [x for r in range(a) for x in SimRank(lambda r=r: make(r, a), b)]
    assert _chunks(consumed) == _chunks(full) and max(_chunks(full).values()) == 1


def test_pending_chunks_of_a_split_document_move_to_the_new_readers(tmp_path):
    docs = make_token_docs(40, seed=1, max_len=60)
    docs[3] = list(range(20 * CAP))  # 20 chunks
    urls = write_tar_shards(tmp_path, docs, 2)
    make = lambda r, size: _ds(urls, r, size, window=4, shuffle=False, packs_per_batch=1)  # noqa: E731
    consumed, states = _old_run(make, 2, 0, 6)
    assert _carried(states)[1] == 1, "one reader must be in the middle of the long document"
    consumed += _new_run(make, 3, 0, states)[0]
    assert collect_documents(consumed) == {f"{i:08d}": doc for i, doc in enumerate(docs)}


def test_same_topology_through_the_list_is_the_exact_resume(shards):
    urls, _ = shards
    make = lambda r, size: _ds(urls, r, size, epochs=2)  # noqa: E731
    full = [[canon(x) for x in SimRank(lambda r=r: make(r, 2), 0)] for r in range(2)]
    ranks = [SimRank(lambda r=r: make(r, 2), 0) for r in range(2)]
    heads = [[canon(next(rk)) for _ in range(7)] for rk in ranks]
    states = [s for rk in ranks for s in rk.states()]
    for rank in range(2):
        rest = [canon(x) for x in SimRank(lambda r=rank: make(r, 2), 0, load=states)]
        assert heads[rank] + rest == full[rank]


def test_elastic_twice_and_across_epochs(shards):
    urls, _ = shards
    urls = urls[:3]
    make = lambda r, size: _ds(urls, r, size, epochs=2, window=8)  # noqa: E731
    consumed, states = _old_run(make, 3, 1, 9)
    mid = [SimRank(lambda r=r: make(r, 2), 2, load=states) for r in range(2)]
    consumed += [next(rk) for rk in mid for _ in range(4)]
    states = [s for rk in mid for s in rk.states()]
    consumed += _new_run(make, 4, 0, states)[0]
    full = [x for r in range(3) for x in SimRank(lambda r=r: make(r, 3), 1)]
    assert _chunks(consumed) == _chunks(full) and set(_chunks(full).values()) == {2}  # two epochs


def _tag_epoch(sample):
    return replace(sample, key=f"{sample.key}@{sample.origin.epoch}")


@pytest.mark.parametrize("num_shards,a,b", [(3, 2, 1), (1, 2, 2)])
def test_elastic_infinite_stream_text_and_tokenizer(tmp_path, num_shards, a, b):
    """Infinite stream, text tokenized in blocks (samples read but not yet tokenized at save):
    every (sample, epoch) up to the resumed epoch E* exactly once, later epochs at most once. With
    fewer shards than old readers, each old reader read a part of a shard (``ShardIndex.part``)."""
    urls = write_jsonl_shards(tmp_path, make_text_docs(50, seed=2), num_shards)
    kw = {"tokenizer": lambda t: list(t.encode()), "tokenize": TokenizeOptions(block_size=5), "stages": [_tag_epoch],
          "packing": PackOptions(window=6), "epochs": None, "capacity": 64}
    make = lambda r, size: _ds(urls, r, size, **kw)  # noqa: E731
    consumed, states = _old_run(make, a, b, 7)
    probe = make(0, 3)
    last = elastic.remaining(states, probe.config, probe.sources, probe.stages).epoch
    for rank in range(3):
        rk = SimRank(lambda r=rank: make(r, 3), 0, load=states)
        consumed += [next(rk) for _ in range(60)]
    seen = Counter()
    for k, n in _chunks(consumed).items():
        base, _, chunk = k.rpartition("#")[2].partition("/")
        key, _, epoch = base.partition("@")
        seen[(k.rpartition("#")[0], key, chunk, int(epoch))] += n
    assert max(seen.values()) == 1
    every = {(u, k, ch) for (u, k, ch, _) in seen}
    for epoch in range(last + 1):
        assert {(u, k, ch) for (u, k, ch, e) in seen if e == epoch} == every, epoch


def test_elastic_offline_packs(tmp_path):
    from streampack.cli.main import main

    paths = write_tar_shards(tmp_path / "in", make_token_docs(120, seed=4, max_len=90), 3)
    out = tmp_path / "packed"
    assert main(["pack", *paths, "--out", str(out), "--capacity", "256", "--packs-per-shard", "5",
                 "--no-progress"]) == 0
    make = lambda r, size: PackedDataset(out, capacity=256, epochs=2, packs_per_batch=2, shuffle=True,
                                         topology=TopologyOptions(dp_rank=r, dp_size=size, equal_batches="count"))
    consumed, states = _old_run(make, 3, 2, 4)
    got, counts = _new_run(make, 2, 3, states)
    consumed += got
    full = [x for r in range(3) for x in SimRank(lambda r=r: make(r, 3), 2)]
    assert len(set(counts)) == 1 and _chunks(consumed) == _chunks(full)


def test_elastic_refuses_what_it_cannot_split(shards, tmp_path):
    urls, _ = shards
    _, states = _old_run(lambda r, size: _ds(urls, r, size), 2, 1, 2)
    with pytest.raises(ValueError, match=r"missing \[\(1, 0\)\]"):
        _ds(urls, 0, 3).load_state_dict(states[:1])
    with pytest.raises(ValueError, match="different runs"):
        _ds(urls, 0, 3).load_state_dict([states[0], {**states[1], "fingerprint": {**record_of(states[1]["fingerprint"]),
                                                                                   "seed": 99}}])
    with pytest.raises(ValueError, match="seed: saved 2, now 5"):
        _ds(urls, 0, 3, seed=5).load_state_dict(states)
    node_stage = [NodeStage(lambda up: MapSamples(up, lambda s: s))]
    _, staged = _old_run(lambda r, size: _ds(urls, r, size, stages=node_stage), 2, 0, 2)
    with pytest.raises(ValueError, match="BaseNode stage"):
        _ds(urls, 0, 3, stages=node_stage).load_state_dict(staged)
    mix = {"a": urls[:2], "b": urls[2:]}
    make = lambda r, size: PackedDataset(mix, capacity=CAP, packing=PackOptions(window=8),
                                         topology=TopologyOptions(dp_rank=r, dp_size=size))  # noqa: E731
    _, mixed = _old_run(make, 2, 0, 2)
    with pytest.raises(ValueError, match="mixture"):
        make(0, 3).load_state_dict(mixed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(40))
def test_elastic_randomized(tmp_path, seed):
    """Random data (tar / jsonl / jsonl.gz, long documents), topologies, stop points, policies."""
    rng = np.random.default_rng(seed)
    cap = int(rng.choice([64, 128]))
    lengths = np.maximum(1, rng.lognormal(np.log(cap / 3), 1.0, int(rng.integers(30, 150)))).astype(int)
    docs = [rng.integers(0, 1000, n).tolist() for n in lengths]
    fmt, num_shards = str(rng.choice(["tar", "jsonl", "gz"])), int(rng.integers(1, 7))
    urls = (write_tar_shards(tmp_path, docs, num_shards) if fmt == "tar"
            else write_jsonl_shards(tmp_path, docs, num_shards, gz=fmt == "gz"))
    a, b, c, d = (int(x) for x in rng.integers([1, 0, 1, 0], [5, 4, 5, 4]))
    window, epochs, per_batch = int(rng.choice([4, 8, 16])), int(rng.integers(1, 3)), int(rng.integers(1, 3))
    overlong, max_wait = str(rng.choice(["split", "truncate", "drop"])), int(rng.integers(1, 5))
    kw = {"capacity": cap, "epochs": epochs, "packs_per_batch": per_batch, "seed": seed,
          "packing": PackOptions(window=window, overlong=overlong, max_wait=max_wait)}
    make = lambda r, size: PackedDataset(  # noqa: E731
        urls, topology=TopologyOptions(dp_rank=r, dp_size=size, equal_batches="count"), **kw)
    full = [list(SimRank(lambda r=r: make(r, a), b)) for r in range(a)]
    assert len({len(x) for x in full}) == 1
    consumed, states = _old_run(make, a, b, int(rng.integers(0, len(full[0]) + 1)))
    got, counts = _new_run(make, c, d, states)
    assert len(set(counts)) == 1
    assert _chunks(consumed + got) == _chunks([x for f in full for x in f])


def test_the_frontier_is_found_in_the_span_of_its_own_epoch(shards):
    """Finding (issue 17, 3a): the frontier row's epoch column was dropped when it was unpacked
    by position. After one elastic resume a reader's work for epoch E may hold the same shard
    twice (an old reader's tail of E-1, then the shard's span in E); a second elastic resume
    then continued after the frontier in the wrong span: 1 rank x 2 workers (old readers in
    epochs [1, 0]) -> 1 x 1 -> 1 x 2 trained 765 (document, epoch) chunks for 710, 55 twice."""
    urls, _ = shards
    ds = _ds(urls, 0, 1, epochs=2)
    old = elastic._OldPlans(ds.config, ds.sources, 1, 1, 0)
    spans = [Span(shard=2, start=3584, end=None, epoch=1), Span(shard=0, start=0, end=14848, epoch=1),
             Span(shard=2, start=29696, end=None, epoch=0), Span(shard=1, start=0, end=None, epoch=1)]
    row = {"source": 0, "shard": 2, "epoch": 0, "offset": 30720, "number": 20, "next_offset": 31744,
           "next_number": 21}  # the last sample pulled was in the epoch-0 tail of shard 2
    origin = elastic.Pulled(**row)
    assert old._after(spans, origin) == [Span(shard=2, start=31744, first=21, end=None, epoch=0), spans[3]]


def _epochs_of(states) -> list[int]:
    return [int(s["graph"]["epoch"]) for s in states]


def _doc_epochs(batches) -> Counter:
    return Counter(k for b in batches for k in b.doc_keys if k != FILLER_KEY)


def test_second_elastic_resume_reads_each_shard_once_per_epoch(tmp_path):
    """Finding (issue 17, 3a): the frontier's epoch column was dropped when it was unpacked, so
    after one elastic resume (a reader's work for epoch E then holds the same shard twice: an old
    reader's tail of E-1 and the shard's span in E) a second one picked the wrong span and
    trained 55 (document, epoch) chunks twice (765 trained, 710 expected)."""
    docs = make_token_docs(60, seed=5, max_len=2 * 64)
    urls = write_tar_shards(tmp_path, docs, 3)
    kw = {"capacity": 64, "epochs": 2, "seed": 1, "packs_per_batch": 1, "stages": [_tag_epoch],
          "packing": PackOptions(window=4, max_wait=2)}
    make = lambda r, size: PackedDataset(  # noqa: E731
        urls, topology=TopologyOptions(dp_rank=r, dp_size=size, equal_batches="count"), **kw)
    full = _doc_epochs(SimRank(lambda: make(0, 1), 0))
    assert set(full.values()) == {1} and {k.rpartition("@")[2].partition("/")[0] for k in full} == {"0", "1"}
    old, consumed, stops = SimRank(lambda: make(0, 1), 2), [], []
    for batch in old:
        consumed.append(batch)
        states = old.states()
        if sorted(_epochs_of(states)) == [0, 1]:  # the two old readers are in different epochs
            stops.append((list(consumed), states))
    assert stops, "no stop point left the two old readers in different epochs"
    for consumed, states in stops[:1]:
        for second in (5, 30, 55):
            mid = SimRank(lambda: make(0, 1), 0, load=states)
            got = consumed + [x for _, x in zip(range(second), mid)]
            rest = list(SimRank(lambda: make(0, 1), 2, load=mid.states()))
            assert _doc_epochs(got + rest) == full, (len(consumed), second)


@pytest.mark.parametrize("change", ["same_size", "truncated", "node_version"])
def test_elastic_resume_refuses_changed_shards_and_other_versions(tmp_path, change):
    """Finding (issue 17, 3b): the elastic path skipped the checks the same-topology resume makes.
    Shards rewritten with the same size resumed silently on new bytes at old offsets; shards
    truncated to 60% failed with ``lengths[0]=-1 must be >= 1``; a nested node state of another
    version was accepted on 3x1 (and refused on 4x2). Each is now a named refusal."""
    import os

    docs = make_token_docs(60, seed=6, max_len=120)
    urls = write_tar_shards(tmp_path, docs, 3)
    make = lambda r, size: _ds(urls, r, size, window=8)  # noqa: E731
    _, states = _old_run(make, 2, 1, 3)
    if change == "node_version":
        packer = elastic.find_state(states[1]["graph"], "OverlongNode")
        assert packer is not None
        _set_nested(states[1]["graph"], "OverlongNode", {**packer, "version": 99})
        match = "OverlongNode state of dp_rank=1 worker_id=0 version=99"
    else:
        sizes = [os.path.getsize(u) for u in urls]
        if change == "same_size":  # other tokens, same lengths: every file keeps its size
            write_tar_shards(tmp_path, [[t + 1 for t in d] for d in docs], 3)
            assert [os.path.getsize(u) for u in urls] == sizes
        else:
            for url in urls:
                data = open(url, "rb").read()
                with open(url, "wb") as f:
                    f.write(data[:len(data) * 6 // 10])
        for url in urls:  # a new mtime even on a coarse clock
            os.utime(url, ns=(os.stat(url).st_atime_ns, os.stat(url).st_mtime_ns + 10**9))
        # truncated shards lose the token count of their cut sample: a fresh plan refuses them too
        match = "changed since the states were saved" + ("|shards do not have" if change == "truncated" else "")
    for c, d in ((3, 0), (4, 2)):
        with pytest.raises(ValueError, match=match):
            SimRank(lambda: make(0, c), d, load=states)


def _set_nested(tree, kind: str, value) -> bool:
    for k, v in (tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()):
        if isinstance(v, dict) and v.get("kind") == kind:
            tree[k] = value
            return True
        if isinstance(v, (dict, list)) and _set_nested(v, kind, value):
            return True
    return False


def test_old_readers_plans_come_from_their_states_without_index_reads(shards, monkeypatch):
    """Issue 17: knowing what every old reader had left cost every new reader the index of every
    shard (the old plans were re-made for all old readers). A reader's state now keeps its planned
    epoch's first and last span (``work_ends``), so the old plans are rebuilt from the states and
    the manifest with no index read; the resume is still exact."""
    from streampack.plan.epoch_plan import EpochPlanner

    urls, _ = shards
    make = lambda r, size: _ds(urls, r, size, window=8, packs_per_batch=1)  # noqa: E731
    consumed, states = _old_run(make, 3, 2, 4)
    assert all(s["graph"] is not None and s["graph"]["chain"] is not None for s in states)
    opened = []
    real = EpochPlanner.samples
    monkeypatch.setattr(EpochPlanner, "samples", lambda self, shard: opened.append(shard) or real(self, shard))
    probe = make(0, 2)
    elastic.remaining(states, probe.config, probe.sources, probe.stages)
    assert opened == []
    got, counts = _new_run(make, 2, 3, states)
    assert len(set(counts)) == 1
    full = [x for r in range(3) for x in SimRank(lambda r=r: make(r, 3), 2)]
    assert _chunks(consumed + got) == _chunks(full) and max(_chunks(full).values()) == 1


def test_elastic_resume_refuses_states_taken_between_snapshots(shards):
    """A StatefulDataLoader state taken k steps after its workers' last snapshot (``snapshot_every_n_steps``, the
    integrations' option) holds each worker's state as of that snapshot: loaded into a dataset, the k batches since
    would be delivered again (before, silently). Loading them is refused, naming the way out; their metrics still
    read; a state on the interval loads."""
    urls, _ = shards
    loader = StatefulDataLoader(_ds(urls, 0, 1), batch_size=None, num_workers=2, snapshot_every_n_steps=4)
    it = iter(loader)
    for _ in range(3):
        next(it)
    stale = dataset_states(roundtrip(loader.state_dict()))
    assert [s["metrics"]["batches"]["batches"] for s in stale] == [0, 0]  # as of the snapshot
    refused = r"taken 3 batches after .*snapshot_every_n_steps > 1.*same dp_size and num_workers"
    with pytest.raises(ValueError, match=refused):
        _ds(urls, 0, 2).load_state_dict(stale)  # elastic: two ranks now
    with pytest.raises(ValueError, match=refused):
        _ds(urls, 0, 1).load_state_dict(stale[0])
    next(it)  # step 4: on the interval
    current = dataset_states(roundtrip(loader.state_dict()))
    assert [s["metrics"]["batches"]["batches"] for s in current] == [2, 2]
    _ds(urls, 0, 2).load_state_dict(current)
    del it
