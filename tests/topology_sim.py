"""In-process simulation of ranks and DataLoader workers, for fast topology tests.

``SimRank`` stands for one rank's DataLoader: one ``PackedDataset`` copy per worker, each
iterated as if inside worker ``w`` of ``num_workers`` (``current_worker`` is patched while it
runs), and batches taken round-robin over the workers still running, skipping exhausted ones,
as torch's DataLoader does. Tests that must prove the behaviour with real worker processes
use ``DataLoader`` / ``StatefulDataLoader``; this harness lets randomized tests try many
topologies and stop points in seconds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from node_checks import roundtrip

import streampack.dataset as dataset_mod
from streampack.plan.topology import Worker


@contextmanager
def as_worker(worker_id: int, num_workers: int) -> Iterator[None]:
    saved = dataset_mod.current_worker
    dataset_mod.current_worker = lambda: Worker(id=worker_id, num_workers=num_workers)
    try:
        yield
    finally:
        dataset_mod.current_worker = saved


@contextmanager
def through_store(agreement: Any) -> Iterator[None]:
    """Datasets built inside agree through ``agreement`` (e.g. ``Agreement.in_process(HashStore(), ...)``)
    as ``Agreement.from_dist`` has them agree under ``torch.distributed``, so ranks simulated in one
    process can plan with ``equal_batches="plan"``, which is refused without a store. The settings
    are not agreed here: the ranks are built one after another on one thread."""
    saved = dataset_mod._agreement
    dataset_mod._agreement = lambda *args, **kwargs: agreement
    try:
        yield
    finally:
        dataset_mod._agreement = saved


class SimRank:
    """One rank's loader over ``make()`` datasets (one per worker; ``num_workers=0`` = main)."""

    def __init__(self, make: Callable[[], Any], num_workers: int, load: Any = None) -> None:
        self.num_workers = num_workers
        self.readers = [make() for _ in range(max(num_workers, 1))]
        self.iters = []
        for w, ds in enumerate(self.readers):
            with as_worker(w, num_workers):
                if load is not None:
                    ds.load_state_dict(load(w) if callable(load) else load)
                self.iters.append(iter(ds))
        self.live = list(range(len(self.readers)))
        self.turn = 0

    def __iter__(self) -> SimRank:
        return self

    def __next__(self) -> Any:
        while self.live:
            w = self.live[self.turn % len(self.live)]
            with as_worker(w, self.num_workers):
                batch = next(self.iters[w], None)
            if batch is None:
                self.live.remove(w)
                continue
            self.turn = (self.live.index(w) + 1) % len(self.live)
            return batch
        raise StopIteration

    def states(self) -> list[dict[str, Any]]:
        out = []
        for w, ds in enumerate(self.readers):
            with as_worker(w, self.num_workers):
                out.append(roundtrip(ds.state_dict()))
        return out


def in_threads(fn: Callable[[int], Any], n: int) -> list[Any]:
    """``fn(i)`` for ranks ``i < n``, each in its own thread (ranks that meet in a store must run at
    once); each result, or the exception it raised (a rank that never returns: RuntimeError)."""
    out: list[Any] = [RuntimeError("never returned")] * n

    def one(i: int) -> None:
        try:
            out[i] = fn(i)
        except Exception as e:  # noqa: BLE001 - handed to the test
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out
