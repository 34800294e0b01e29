"""Late quotas (issue 17): a planned finite reader reads no shard index but its <= 4 boundary
shards' before its first batch; its own batches are counted and agreed afterwards, in a
background thread, through a real TCPStore on loopback; the batches are exactly those of
``equal_batches="count"`` (every reader counting every reader), across a mid-epoch save and restore.

Ranks step in lockstep (as a training loop's collectives make them), each rank a ``SimRank``
(one PackedDataset per DataLoader worker, round-robin)."""

from __future__ import annotations

import threading
from datetime import timedelta

import numpy as np
import pytest
from node_checks import collect_documents, write_token_shards
from topology_sim import SimRank, through_store
from torch.distributed import TCPStore

from streampack.dataset import PackedDataset
from streampack.io.manifest import Manifest
from streampack.nodes.collate import BatchLayout, ThdCollate, is_filler
from streampack.options import PackOptions, ReadOptions, TopologyOptions
from streampack.plan.agree import Agreement

CAP, RANKS, WORKERS = 256, 3, 2


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("late")
    urls, docs = write_token_shards(root / "shards", 240, 40, mean=40, seed=2, max_len=2 * CAP)
    return urls, docs, str(root / "cache")


@pytest.fixture()
def store():
    server = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    yield server
    del server


class IndexReads:
    """Records every shard index load and whether the reading (main) thread made it."""

    def __init__(self, monkeypatch) -> None:
        self.main: list[int] = []
        self.background: list[int] = []
        real = Manifest.load_index

        def load(manifest, shard, *args, **kwargs):
            (self.main if threading.current_thread() is threading.main_thread() else self.background).append(shard)
            return real(manifest, shard, *args, **kwargs)

        monkeypatch.setattr(Manifest, "load_index", load)


def _ranks(data, agreement, load=None) -> list[SimRank]:
    """The ranks agreeing through ``agreement``; None: each reader counting every reader
    (``equal_batches="count"``), the batches the agreement must reproduce."""
    urls, _, cache = data
    equal = "count" if agreement is None else "plan"
    make = lambda rank: PackedDataset(  # noqa: E731
        urls, capacity=CAP, packing=PackOptions(window=16), epochs=1, seed=5, packs_per_batch=2,
        topology=TopologyOptions(dp_rank=rank, dp_size=RANKS, equal_batches=equal), read=ReadOptions(cache_dir=cache))
    with through_store(agreement):
        return [SimRank(lambda r=r: make(r), WORKERS, load=None if load is None else load[r]) for r in range(RANKS)]


def _lockstep(ranks: list[SimRank], steps: int | None = None) -> list[list]:
    out: list[list] = [[] for _ in ranks]
    while steps is None or len(out[0]) < steps:
        got = [next(r, None) for r in ranks]
        if all(b is None for b in got):
            break
        assert all(b is not None for b in got), "a rank ran out while another still stepped"
        for o, b in zip(out, got):
            o.append(b)
    return out


def _agreement(store, prefix: str) -> Agreement:
    return Agreement(host="127.0.0.1", port=store.port, prefix=prefix, dp_size=RANKS, timeout_s=60)


@pytest.fixture(scope="module")
def want(data):
    """``equal_batches="count"``'s batches: every reader counts every reader, in-process, when its data runs out."""
    return _lockstep(_ranks(data, None))


def test_no_index_before_the_first_batch_and_the_same_batches_as_counting_everyone(data, want, store, monkeypatch):
    """Finding: before its first batch each planned reader read the index of every shard of its own
    share (⌈N/G⌉ reads: 310 extra requests at 64 ranks over 20,000 shards) to count its batches."""
    reads = IndexReads(monkeypatch)
    got = _lockstep(_ranks(data, _agreement(store, "run")))
    readers = RANKS * WORKERS
    assert len(reads.main) <= 4 * readers, f"the reading threads opened {len(reads.main)} indexes (planning only)"
    assert len(set(reads.background)) >= 30, "the background count read the readers' own shards"
    assert [[b.doc_keys for b in r] for r in got] == [[b.doc_keys for b in r] for r in want]
    _, docs, _ = data
    assert collect_documents([b for r in got for b in r]) == {f"{i:08d}": d for i, d in enumerate(docs)}
    assert sum(is_filler(b) for r in got for b in r) > 0 or len({len(r) for r in got}) == 1


@pytest.mark.parametrize("stop", [2, pytest.param(6, marks=pytest.mark.slow)])  # whole rounds of the workers: SimRank restarts at worker 0
def test_restore_mid_epoch_continues_exactly_without_recounting(data, want, store, monkeypatch, stop):
    """A restored reader takes its count and quota back from the state (no index read to count
    again) and still joins the new run's round, so the readers that had not settled theirs can."""
    first = _ranks(data, _agreement(store, "first"))
    head = _lockstep(first, stop)
    lates = [ds._graph.nodes["collate"].late for rank in first for ds in rank.readers]
    assert len(lates) == RANKS * WORKERS, "every reader still inside the epoch"
    for late in lates:  # settle every reader's quota before the save (a worker not asked yet for a
        late.start()  # batch has not started its count: a DataLoader's workers all prefetch at once)
    for late in lates:
        late.get()
    states = [rank.states() for rank in first]
    assert all(s["graph"]["chain"]["late_quota"]["batches"] is not None for r in states for s in r)
    reads = IndexReads(monkeypatch)
    tail = _lockstep(_ranks(data, _agreement(store, "second"), load=[lambda w, r=r: states[r][w]
                                                                      for r in range(RANKS)]))
    assert reads.background == [], "a restored count is not counted again"
    assert [[b.doc_keys for b in h + t] for h, t in zip(head, tail)] == [[b.doc_keys for b in r] for r in want]


def test_restore_before_the_count_recounts_its_own_share(data, want, store):
    """A state saved before the count finished holds no count: the restored reader counts its own
    share again (O(T/G)) and the batches are the same."""
    first = _ranks(data, None)
    head = _lockstep(first, 4)
    states = [rank.states() for rank in first]
    for s in (s for r in states for s in r):  # as saved before a background count ended
        s["graph"]["chain"]["late_quota"] = {"batches": None, "quota": None}
        s["graph"]["chain"]["num_batches"] = None
    tail = _lockstep(_ranks(data, _agreement(store, "later"), load=[lambda w, r=r: states[r][w]
                                                                     for r in range(RANKS)]))
    assert [[b.doc_keys for b in h + t] for h, t in zip(head, tail)] == [[b.doc_keys for b in r] for r in want]


def test_a_late_quota_smaller_than_the_data_is_refused(data):
    """A count below the data (a stage that changed lengths) still fails loudly, never drops data."""
    from node_checks import ListSource, make_samples

    from streampack.nodes.overlong import OverlongNode
    from streampack.nodes.window_packer import WindowPacker
    from streampack.packing.window_rounds import PackerRules
    from streampack.plan.quota import LateQuota, Settled

    late = LateQuota(count=lambda: 2, settle=lambda mine: Settled(quota=mine, batches=mine, rank_fillers=0),
                     background=False)
    source = WindowPacker(OverlongNode(ListSource(make_samples([CAP] * 5)), CAP, "split"),
                          rules=PackerRules(capacity=CAP, window=4))
    node = ThdCollate(source, layout=BatchLayout(capacity=CAP), num_batches=late)
    node.reset(None)
    with pytest.raises(ValueError, match="num_batches=2"):
        [next(node) for _ in range(6)]
    filled = ThdCollate(WindowPacker(OverlongNode(ListSource(make_samples([CAP] * 2)), CAP, "split"),
                                     rules=PackerRules(capacity=CAP, window=4)), layout=BatchLayout(capacity=CAP),
                        num_batches=LateQuota(count=lambda: 2, settle=lambda m: Settled(quota=4, batches=m,
                                                                                          rank_fillers=2),
                                              background=True))
    filled.reset(None)
    batches = list(filled)
    assert len(batches) == 4 and [is_filler(b) for b in batches] == [False, False, True, True]
    assert filled.late.info["quota"] == 4 and np.isfinite(filled.late.info["batches"])


@pytest.mark.slow  # ~2.5 s: an old run, then an elastic one with a real store
def test_elastic_resume_counts_late_and_pins_its_quota(data, store):
    """An elastic resume's new readers read no index of their own shards before their first batch
    either; every sample of the epoch is still read once with equal counts, and the states taken
    in the resumed epoch carry its quota (the old states it came from are gone after a restore)."""
    urls, docs, cache = data
    old = [SimRank(lambda r=r: PackedDataset(urls, capacity=CAP, packing=PackOptions(window=16), epochs=1,
                                             topology=TopologyOptions(dp_rank=r, dp_size=2, equal_batches="count"),
                                             seed=5, packs_per_batch=2,
                                             read=ReadOptions(cache_dir=cache)), 0) for r in range(2)]
    head = _lockstep(old, 3)
    states = [s for rank in old for s in rank.states()]
    new = _ranks(data, _agreement(store, "elastic"), load=[lambda w: states] * RANKS)
    tail = _lockstep(new, 2)
    pinned = [s["graph"]["chain"]["num_batches"] for rank in new for s in rank.states()]
    assert all(isinstance(q, int) and q > 0 for q in pinned), pinned
    tail = [t + rest for t, rest in zip(tail, _lockstep(new))]
    assert len({len(t) for t in tail}) == 1
    assert collect_documents([b for r in head + tail for b in r]) == {f"{i:08d}": d for i, d in enumerate(docs)}


def test_ranks_simulated_in_one_process_agree_through_a_hashstore(data, want):
    """Any c10d store serves the agreement: ranks that are threads of one process (this simulation,
    or ``init_process_group(store=HashStore())``) agree through a HashStore, with the same batches."""
    from torch.distributed import HashStore

    agreement = Agreement.in_process(HashStore(), prefix="sim", dp_size=RANKS, timeout_s=60)
    got = _lockstep(_ranks(data, agreement))
    assert [[b.doc_keys for b in r] for r in got] == [[b.doc_keys for b in r] for r in want]
