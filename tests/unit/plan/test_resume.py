"""Exact resume under StatefulDataLoader: k consecutive interruptions == one uninterrupted run."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from node_checks import canon, roundtrip, take, write_token_shards
from torchdata.stateful_dataloader import StatefulDataLoader

from streampack.dataset import PackedDataset
from streampack.options import PackOptions
from streampack.plan.state import load_loader_state


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    # small on purpose: an infinite stream wraps several epochs inside a test run
    return write_token_shards(tmp_path_factory.mktemp("resume"), 240, 6, mean=90, seed=5)


def _ds(urls, **kw) -> PackedDataset:
    return PackedDataset(urls, **{"capacity": 256, "packs_per_batch": 2, "seed": 7,
                                  "packing": PackOptions(window=24, max_wait=3), **kw})


def _interrupted(urls, num_workers: int, stops: list[int], total: int, **kw) -> list:
    out, state, done = [], None, 0
    for stop in [*stops, total]:
        loader = StatefulDataLoader(_ds(urls, **kw), batch_size=None, num_workers=num_workers)
        if state is not None:
            load_loader_state(loader, roundtrip(state))
        it = iter(loader)
        if state is not None:
            # save right after the restore, restore that in another loader: same continuation
            again = loader.state_dict()
            other = StatefulDataLoader(_ds(urls, **kw), batch_size=None, num_workers=num_workers)
            other.load_state_dict(roundtrip(again))
            probe = [canon(b) for b in take(iter(other), 2)]
            head = [canon(b) for b in take(it, 2)]
            assert probe == head[:len(probe)], "state saved right after a restore diverged"
            out += head
            done += len(head)
        out += [canon(b) for b in take(it, stop - done)]
        done = stop
        state = loader.state_dict()
        del it
    return out


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])  # 2: ~3 s, -m slow
def test_three_interruptions_infinite(shards, num_workers: int) -> None:
    urls, _ = shards
    total = 120  # ~3 epochs of this tiny dataset: the stops cross epoch boundaries
    loader = StatefulDataLoader(_ds(urls), batch_size=None, num_workers=num_workers)
    full = [canon(b) for b in take(iter(loader), total)]
    stops = sorted(np.random.default_rng(num_workers).choice(np.arange(3, total - 3), 3, replace=False).tolist())
    assert _interrupted(urls, num_workers, stops, total) == full


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])  # 2: ~3 s, -m slow
def test_resume_finite_across_epoch_boundary(shards, num_workers: int) -> None:
    urls, docs = shards
    kw = {"epochs": 2}
    loader = StatefulDataLoader(_ds(urls, **kw), batch_size=None, num_workers=num_workers)
    batches = list(loader)
    full = [canon(b) for b in batches]
    n = len(full)
    got = _interrupted(urls, num_workers, [5, n // 2, n // 2 + 3], n + 5, **kw)
    assert got == full
    # a pass of 2 epochs holds every document exactly twice
    seen = Counter(k.rsplit("#", 1)[-1] for b in batches for k in b.doc_keys)
    whole = {f"{i:08d}" for i, d in enumerate(docs) if len(d) <= 256}
    assert whole <= set(seen) and all(seen[k] == 2 for k in whole)


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [1, 2])
def test_many_random_interruptions(shards, num_workers: int) -> None:
    urls, _ = shards
    total = 200
    loader = StatefulDataLoader(_ds(urls, packing=PackOptions(window=64, max_wait=3)), batch_size=None, num_workers=num_workers)
    full = [canon(b) for b in take(iter(loader), total)]
    for seed in range(3):
        rng = np.random.default_rng(seed + 10)
        stops = sorted(rng.choice(np.arange(1, total - 1), 5, replace=False).tolist())
        assert _interrupted(urls, num_workers, stops, total, packing=PackOptions(window=64, max_wait=3)) == full


@pytest.mark.slow  # ~4 s: two workers, four loaders
def test_a_state_taken_between_snapshots_resumes_exactly(shards) -> None:
    """``snapshot_every_n_steps=N`` (the integrations' option, docs/integrations.md): a state taken k steps after
    a worker snapshot restores it and drops k re-made batches, so every stop, on or off the interval, continues
    with the uninterrupted run's batches."""
    urls, _ = shards
    full = [canon(b) for b in take(iter(StatefulDataLoader(_ds(urls), batch_size=None, num_workers=2)), 40)]
    out, state, done, since = [], None, 0, []
    for stop in (7, 13, 29, 40):
        loader = StatefulDataLoader(_ds(urls), batch_size=None, num_workers=2, snapshot_every_n_steps=5)
        if state is not None:
            load_loader_state(loader, roundtrip(state))
        it = iter(loader)
        out += [canon(b) for b in take(it, stop - done)]
        done = stop
        state = loader.state_dict()
        since.append(state["_steps_since_snapshot"])
        del it
    assert since == [2, 3, 4, 0]  # off the interval three times: the replay ran
    assert out == full
