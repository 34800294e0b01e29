"""A finite multi-rank plan never counts the whole data set silently (issue 29 item 7).

Explicit ``dp_rank``/``dp_size`` with no ``torch.distributed`` have no store to agree through: a
plan is refused when the dataset is built, naming the remedies. ``equal_batches="count"`` is the
explicit choice to pay O(samples of the data set) per reader (ranks simulated in one process,
small data sets): the batches and states of a plan agreed through a real c10d store, with no
store used for the counts even where there is one."""

from __future__ import annotations

import pytest
import torch
from node_checks import collect_documents, write_token_shards
from topology_sim import SimRank, in_threads, through_store
from torch.distributed import HashStore

from streampack.dataset import PackedDataset
from streampack.options import PackOptions, ReadOptions, TopologyOptions
from streampack.plan import agree as agree_mod
from streampack.plan.agree import Agreement, agree_settings
from tests.unit.plan.test_late_quota import _lockstep

CAP, RANKS, WORKERS, SHARDS = 128, 2, 2, 12


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("count")
    urls, docs = write_token_shards(root / "shards", 160, SHARDS, mean=40, seed=3, max_len=2 * CAP)
    return urls, docs, str(root / "cache")


def _dataset(data, rank: int, equal: str) -> PackedDataset:
    urls, _, cache = data
    return PackedDataset(urls, capacity=CAP, epochs=1, seed=7, packs_per_batch=2, packing=PackOptions(window=8),
                         topology=TopologyOptions(dp_rank=rank, dp_size=RANKS, equal_batches=equal),
                         read=ReadOptions(cache_dir=cache))


def _ranks(data, equal: str, store: Agreement | None = None, load=None) -> list[SimRank]:
    with through_store(store):
        return [SimRank(lambda r=r: _dataset(data, r, equal), WORKERS, load=None if load is None else load[r])
                for r in range(RANKS)]


def _store(prefix: str) -> tuple[HashStore, Agreement]:
    store = HashStore()
    return store, Agreement.in_process(store, prefix=prefix, dp_size=RANKS, timeout_s=60)


def _same(a: list[list], b: list[list]) -> None:
    """Batch for batch on every rank: the same documents, tokens and fillers."""
    assert [len(r) for r in a] == [len(r) for r in b]
    for x, y in zip((batch for rank in a for batch in rank), (batch for rank in b for batch in rank)):
        assert x.doc_keys == y.doc_keys
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels)


@pytest.fixture(scope="module")
def counted(data):
    return _lockstep(_ranks(data, "count"))


def test_explicit_ranks_without_a_store_refuse_a_plan_naming_the_remedies(data) -> None:
    """Finding: with explicit ranks and no torch.distributed the dataset only logged a warning, then
    every reader read every shard's index at its first state_dict() (~100 s at 2,000 shards)."""
    with pytest.raises(ValueError) as e:
        _dataset(data, 0, "plan")
    msg = str(e.value)
    for named in ("dp_size=2", "TopologyOptions(dp_rank=, dp_size=)", f"whole data set ({SHARDS} shards)",
                  "torch.distributed.init_process_group()", "batches_per_epoch=N", "equal_batches='sync'",
                  "streampack.sync_batches", "equal_batches='count'"):
        assert named in msg, (named, msg)
    _dataset(data, 0, "count")  # the remedies that need no store are accepted
    _dataset(data, 0, "sync")
    urls, _, cache = data
    PackedDataset(urls, capacity=CAP, epochs=1, read=ReadOptions(cache_dir=cache),
                  topology=TopologyOptions(dp_rank=0, dp_size=RANKS, batches_per_epoch=4))
    PackedDataset(urls, capacity=CAP, read=ReadOptions(cache_dir=cache),  # infinite: nothing to count
                  topology=TopologyOptions(dp_rank=0, dp_size=RANKS))


def test_a_launched_run_without_a_store_may_choose_count(data, monkeypatch) -> None:
    """Ranks from RANK/WORLD_SIZE and no torch.distributed: a plan is refused, naming the launcher;
    ``count`` is accepted, its cost chosen explicitly."""
    urls, _, cache = data
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", str(RANKS))
    with pytest.raises(ValueError, match=r"RANK/WORLD_SIZE from the launcher.*equal_batches='count'"):
        PackedDataset(urls, capacity=CAP, epochs=1, read=ReadOptions(cache_dir=cache))
    ds = PackedDataset(urls, capacity=CAP, epochs=1, read=ReadOptions(cache_dir=cache),
                       topology=TopologyOptions(equal_batches="count"))
    assert (ds.dp_rank, ds.dp_size) == (1, RANKS)


def test_count_yields_the_batches_of_a_plan_agreed_through_a_store(data, counted) -> None:
    _, docs, _ = data
    assert collect_documents([b for r in counted for b in r]) == {f"{i:08d}": d for i, d in enumerate(docs)}
    assert len({len(r) for r in counted}) == 1
    _, agreement = _store("plan")
    _same(_lockstep(_ranks(data, "plan", agreement)), counted)


def test_a_state_saved_under_count_resumes_under_a_plan_exactly(data, counted) -> None:
    """``count`` and ``plan`` make the same stream, so the state fingerprints them alike: a run
    simulated with ``count`` resumes where the ranks agree through a store, and back."""
    assert _dataset(data, 1, "count").fingerprint() == _dataset(data, 1, "sync").fingerprint() | {
        "equal_batches": "plan"}
    first = _ranks(data, "count")
    head = _lockstep(first, 4)  # whole rounds of the workers: SimRank restarts at worker 0
    states = [rank.states() for rank in first]
    _, agreement = _store("resume")
    tail = _lockstep(_ranks(data, "plan", agreement, load=[lambda w, r=r: states[r][w] for r in range(RANKS)]))
    assert all(tail), "the save was inside the epoch"
    _same([h + t for h, t in zip(head, tail)], counted)


def test_count_uses_no_store_for_the_counts_where_there_is_one(data, counted, monkeypatch) -> None:
    """With torch.distributed ``count`` still counts every reader itself (its settings are agreed
    when the dataset is built, not here): no count round reaches the store."""
    def no_round(*args, **kwargs):
        raise AssertionError("equal_batches='count' joined a store round")

    monkeypatch.setattr(agree_mod, "agree_counts", no_round)
    store, agreement = _store("count")
    _same(_lockstep(_ranks(data, "count", agreement)), counted)
    assert store.num_keys() == 0


def test_ranks_mixing_plan_and_count_are_refused_on_every_rank(data) -> None:
    """A ``plan`` rank would wait out the timeout in a count round a ``count`` rank never joins:
    the settings agreement names the difference instead, on every rank."""
    _, agreement = _store("mixed")
    with through_store(agreement):
        settings = [_dataset(data, r, e)._shared_settings(None) for r, e in enumerate(("plan", "count"))]
    got = in_threads(lambda r: agree_settings(agreement, dp_rank=r, settings=settings[r]), RANKS)
    assert all(isinstance(g, ValueError) for g in got), got
    assert all("equal_batches='plan'" in str(g) and "equal_batches='count'" in str(g) for g in got), got
