"""A DataError raised in a DataLoader worker reaches the caller, and the workers are gone within a second of the
caller letting the iterator go, with no garbage collection: torch re-raises it as ``DataError(message=...)``
(``DataError.message`` says why), which leaves no reference cycle holding the iterator, so its ``__del__`` stops the
workers while their queues still run; in a cycle the collector closed the queues first and the shutdown waited out
torch's 5 s join timeout per worker."""

from __future__ import annotations

import gc
import json
import time

import pytest
from helpers_hostile import write_bytes
from torch.utils.data import DataLoader

from streampack.dataset import PackedDataset
from streampack.errors import DataError
from streampack.options import PackOptions


def _dataset(tmp_path) -> PackedDataset:
    rows = [{"input_ids": [i + 1, 5]} for i in range(12)]
    rows[7] = {"input_ids": [1, 2 ** 40]}  # out of vocabulary: a DataError in whichever worker reads it
    good = write_bytes(tmp_path / "a.jsonl", "".join(json.dumps(r) + "\n" for r in rows[:6]).encode())
    bad = write_bytes(tmp_path / "b.jsonl", "".join(json.dumps(r) + "\n" for r in rows[6:]).encode())
    return PackedDataset([good, bad], capacity=16, epochs=1, shuffle=False, packing=PackOptions(window=4))


def _gone_within(workers: list, seconds: float) -> float | None:
    """Seconds until every worker process has exited, or None if one is still alive after ``seconds``."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if not any(w.is_alive() for w in workers):
            return time.perf_counter() - t0
        time.sleep(0.01)
    return None


@pytest.mark.parametrize("loader", ["torch", "stateful"])
def test_workers_are_gone_within_a_second_of_the_error(tmp_path, loader: str) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    make = DataLoader if loader == "torch" else StatefulDataLoader
    it = iter(make(_dataset(tmp_path), batch_size=None, num_workers=2))
    workers = list(it._workers)
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    gc.disable()  # the iterator must go by reference counting alone, as soon as the caller lets it go
    try:
        t0 = time.perf_counter()
        try:
            for _ in it:
                pass
            raise AssertionError("no DataError reached the caller")
        except DataError as e:
            reached = time.perf_counter() - t0
            assert e.reason == "out_of_vocab_id"
        del it
        gone = _gone_within(workers, 1.0)
    finally:
        gc.enable()
        gc.collect()  # a failing run's cycle: stop its workers here, not in a later test
    assert reached < 1.0, f"the DataError took {reached:.2f} s to reach the caller"
    assert gone is not None, "the workers outlived the iterator by over 1 s (held in a reference cycle?)"
