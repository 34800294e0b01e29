"""Planning for many readers (issue 17): each reader plans its own share from shard totals, the
batch counts are made equal through an agreement on counts, and the union of all readers'
shares is the epoch, every sample exactly once. Readers are simulated in one process over a
fake manifest (no files): up to 1,024 ranks."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

from streampack.packing.window_rounds import PackerRules
from streampack.plan.epoch_plan import Counting, EpochPlanner, equalize


@dataclass(frozen=True)
class FakeShards:
    """The manifest fields a planner reads."""

    urls: tuple[str, ...]
    samples: np.ndarray
    tokens: np.ndarray
    byte_costs: np.ndarray

    def known_lengths(self) -> bool:
        return bool((self.tokens >= 0).all())

    def costs(self, *, tokens: bool) -> np.ndarray:
        return self.tokens if tokens else self.byte_costs


def fake_data(num_shards: int, seed: int) -> tuple[FakeShards, list[SimpleNamespace]]:
    rng = np.random.default_rng(seed)
    indexes = []
    for s in range(num_shards):
        n = int(rng.integers(0, 40))
        lengths = np.maximum(1, rng.lognormal(4.5, 1.0, n)).astype(np.int32)
        offsets = np.cumsum(np.concatenate([[0], 100 + lengths[:-1].astype(np.int64)])) if n else np.zeros(0, np.int64)
        end = int(offsets[-1] + 100 + lengths[-1]) if n else 0
        indexes.append(SimpleNamespace(offsets=offsets, numbers=np.arange(n), lengths=lengths, end=end, damage=None))
    shards = FakeShards(urls=tuple(f"s{s}" for s in range(num_shards)),
                        samples=np.array([len(i.offsets) for i in indexes], dtype=np.int64),
                        tokens=np.array([int(i.lengths.sum()) for i in indexes], dtype=np.int64),
                        byte_costs=np.array([int(np.maximum(np.append(i.offsets[1:], i.end) - i.offsets, 1).sum())
                                             for i in indexes], dtype=np.int64))
    return shards, indexes


class Store:
    """An in-process stand-in for the store agreement: every reader posts its count first."""

    def __init__(self, ranks: int, workers: int) -> None:
        self.counts = np.full((ranks, workers), -1, dtype=np.int64)

    def agree(self, key: str, dp_rank: int, worker_id: int, num_workers: int, count: int) -> SimpleNamespace:
        assert (self.counts >= 0).all(), "every reader posts before any reads"
        assert self.counts[dp_rank, worker_id] == count
        return SimpleNamespace(target=int(self.counts.sum(axis=1).max()),
                               workers=tuple(int(c) for c in self.counts[dp_rank]))


COUNTING = Counting(rules=PackerRules(capacity=512, window=16, algorithm="bfd", align=1, seed=3, max_wait=4, slack=None),
                    max_len=512, policy="split", packs_per_batch=2)


@pytest.mark.parametrize("ranks,workers,num_shards", [pytest.param(1024, 1, 300, marks=pytest.mark.slow), (128, 8, 150),
                                                       (64, 2, 2000)])
def test_many_readers_each_plan_their_share_and_counts_agree(ranks, workers, num_shards):
    shards, indexes = fake_data(num_shards, seed=ranks)
    opened: list[int] = []
    store = Store(ranks, workers)
    make = lambda: EpochPlanner(shards, lambda s: opened.append(s) or indexes[s], seed=7, shuffle=True,  # noqa: E731
                                dp_size=ranks, num_workers=workers, counting=COUNTING, agree=store.agree)
    readers = ranks * workers
    seen = [np.zeros(n, dtype=np.int64) for n in shards.samples]
    planners = []
    for g in range(readers):  # phase 1: each reader counts its own batches (only its own shards opened)
        planner, before = make(), len(opened)
        plan = planner.plan(3, g)
        assert len(set(opened[before:])) <= 4, "planning (before the first batch) opens only boundary shards"
        own, counted = {p.shard for p in planner.ranges(3, g)}, len(opened)
        store.counts[divmod(g, workers)] = planner.count_spans(g, plan.spans)
        assert set(opened[counted:]) <= own, "counting opens only its own shards"
        assert len(opened) - before <= len(own) + 4, "no index read twice but the boundary shards'"
        for p in planner.ranges(3, g):
            seen[p.shard][p.lo:p.hi] += 1
        planners.append(planner)
    assert all((s == 1).all() for s in seen), "the readers' shares are the epoch, every sample once"
    quotas = [planners[g].plan(3, g).quota.get() for g in range(readers)]  # phase 2: one agreement each
    totals = np.asarray(quotas).reshape(ranks, workers).sum(axis=1)
    assert len(set(totals.tolist())) == 1 and totals[0] == store.counts.sum(axis=1).max()
    assert totals[0] > 0 and store.counts.sum() > readers // 4, "enough data that the check is not vacuous"
    if readers <= 1024:  # the same quotas as counting everyone (the fallback without an agreement)
        assert quotas == equalize(store.counts.ravel().tolist(), ranks)[0]
