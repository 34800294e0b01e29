"""What a PackedDataset's DataLoader worker sends per batch: no handshakes, same batches, exact resume."""

from __future__ import annotations

import gc
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing.reductions as reductions
from node_checks import write_token_shards
from torchdata.stateful_dataloader import StatefulDataLoader

from streampack.dataset import PackedDataset
from streampack.layout import shm_ring, transfer
from streampack.options import PackOptions
from streampack.plan.state import load_loader_state


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_token_shards(tmp_path_factory.mktemp("handover"), 160, 4, mean=300, seed=3)[0]


def _loader(urls, workers: int = 2) -> StatefulDataLoader:
    # 2 packs of 2048: the [3, T] rows are 96 KiB, above what travels inside the pickle
    ds = PackedDataset(urls, capacity=2048, packs_per_batch=2, epochs=1, seed=1, packing=PackOptions(window=16))
    return StatefulDataLoader(ds, batch_size=None, num_workers=workers)


def _counting(monkeypatch) -> dict[str, int]:
    """Count, in this (training) process, the storages rebuilt by torch's own sharing."""
    calls = {"rebuild_storage_fd": 0, "rebuild_storage_filename": 0}
    for name in calls:
        real = getattr(reductions, name)

        def counted(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)
        monkeypatch.setattr(reductions, name, counted)  # pickles name the function: loads look it up here
    return calls


@pytest.mark.skipif(not shm_ring.available(), reason="needs memfd_create and /proc (Linux)")
def test_no_descriptor_handshake_and_no_torch_segment_per_batch(shards, monkeypatch) -> None:
    calls = _counting(monkeypatch)
    got = [b.input_ids.clone() for b in _loader(shards)]
    assert len(got) > 10 and got[0].numel() == 4096
    # batches in slots, and the per-batch state deltas (window references, pack sizes) by value
    assert calls == {"rebuild_storage_fd": 0, "rebuild_storage_filename": 0}


def test_batches_and_resume_are_the_same_as_with_torchs_reduction(shards, monkeypatch) -> None:
    def epoch(stop: int | None = None) -> tuple[list[torch.Tensor], object]:
        loader, out = _loader(shards), []
        for batch in loader:
            out.append(batch.input_ids.clone())
            if len(out) == stop:
                return out, loader.state_dict()
        return out, None

    fresh, _ = epoch()
    head, state = epoch(stop=5)
    with monkeypatch.context() as m:  # the old hand-over, in the workers too (forked after this)
        m.setattr(shm_ring, "available", lambda: False)
        m.setattr(transfer, "settle_worker", lambda: None)
        old, _ = epoch()
    assert len(fresh) == len(old) and all(torch.equal(a, b) for a, b in zip(fresh, old))
    loader = _loader(shards)
    load_loader_state(loader, state)
    rest = [b.input_ids.clone() for b in loader]
    assert all(torch.equal(a, b) for a, b in zip(head + rest, fresh)) and len(head) + len(rest) == len(fresh)


def test_settling_a_worker_process_inlines_small_tensors_once(monkeypatch) -> None:
    saved = ForkingPickler._extra_reducers.get(torch.Tensor)
    ForkingPickler._extra_reducers[torch.Tensor] = reductions.reduce_tensor  # torch's, as in a fresh worker
    monkeypatch.setattr(transfer, "_settled_pid", 0)
    frozen = gc.get_freeze_count()
    try:
        transfer.settle_worker()
        mine = ForkingPickler._extra_reducers[torch.Tensor]
        assert mine is not reductions.reduce_tensor
        # not gc.freeze(): measured, it made the workers' collector run full collections more often
        assert gc.get_freeze_count() == frozen
        transfer.settle_worker()  # once per process
        assert ForkingPickler._extra_reducers[torch.Tensor] is mine
    finally:
        ForkingPickler._extra_reducers[torch.Tensor] = saved


def test_a_simulated_worker_in_this_process_changes_nothing_process_wide(shards) -> None:
    """Tests simulate DataLoader workers in-process (``topology_sim``): only a worker *process*
    sends its small tensors by value."""
    from torch.utils.data._utils import worker as torch_worker

    before = ForkingPickler._extra_reducers.get(torch.Tensor)
    ds = PackedDataset(shards, capacity=2048, epochs=1)
    torch_worker._worker_info = torch_worker.WorkerInfo(id=0, num_workers=2, seed=0, dataset=ds)
    try:
        next(iter(ds))
    finally:
        torch_worker._worker_info = None
    assert ForkingPickler._extra_reducers.get(torch.Tensor) is before


def test_fingerprint_is_made_once_and_handed_out_as_a_copy(shards) -> None:
    ds = PackedDataset(shards, capacity=2048)
    first = ds.fingerprint(2)
    first["limits"]["max_line_bytes"] = -1
    first["seed"] = -1
    again = ds.fingerprint(2)
    assert again["seed"] == 0 and again["limits"]["max_line_bytes"] != -1 and again["num_workers"] == 2
    assert ds.fingerprint(0)["num_workers"] == 0


@pytest.mark.slow  # three 2-worker loaders: ~1-3 s
def test_snapshots_every_few_steps_still_resume_exactly(shards) -> None:
    """``snapshot_every_n_steps=N`` (a snapshot per checkpoint instead of per batch, ~1.6 ms of CPU
    per batch saved with 2 workers): a state taken between snapshots makes the loader regenerate
    the batches since the last one, and the resume is still exact."""
    def loader() -> StatefulDataLoader:
        ds = PackedDataset(shards, capacity=2048, packs_per_batch=2, epochs=1, seed=1, packing=PackOptions(window=16))
        return StatefulDataLoader(ds, batch_size=None, num_workers=2, snapshot_every_n_steps=4)

    fresh = [b.input_ids.clone() for b in loader()]
    first, head = loader(), []
    for batch in first:
        head.append(batch.input_ids.clone())
        if len(head) == 7:  # between the snapshots at 4 and 8
            break
    state = first.state_dict()
    resumed = loader()
    load_loader_state(resumed, state)
    rest = [b.input_ids.clone() for b in resumed]
    assert len(head) + len(rest) == len(fresh) and all(torch.equal(a, b) for a, b in zip(head + rest, fresh))


@pytest.mark.slow  # four 2-worker passes: ~1-2 s
def test_persistent_workers_over_two_passes_keep_every_held_batch(shards) -> None:
    """Persistent workers keep their rings across passes; every batch the loop holds (all of them
    here) keeps its own bytes, and the passes are those of fresh workers."""
    def passes(persistent: bool) -> list[torch.Tensor]:
        ds = PackedDataset(shards, capacity=2048, packs_per_batch=2, epochs=1, seed=1, packing=PackOptions(window=16))
        loader = StatefulDataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent)
        held = [b for _ in range(2) for b in loader]  # the batches themselves, not copies
        return [b.input_ids for b in held]

    kept, fresh = passes(True), passes(False)
    assert len(kept) == len(fresh) > 20 and all(torch.equal(a, b) for a, b in zip(kept, fresh))


@pytest.mark.slow  # spawned workers import torch: several seconds
@pytest.mark.skipif(not shm_ring.available(), reason="needs memfd_create and /proc (Linux)")
def test_spawned_workers_hand_batches_over_the_same_way(shards, monkeypatch) -> None:
    calls = _counting(monkeypatch)
    ds = PackedDataset(shards, capacity=2048, packs_per_batch=2, epochs=1, seed=1, packing=PackOptions(window=16))
    spawned = [b.input_ids.clone() for b in StatefulDataLoader(ds, batch_size=None, num_workers=2,
                                                               multiprocessing_context="spawn")]
    forked = [b.input_ids.clone() for b in _loader(shards)]
    assert len(spawned) == len(forked) and all(torch.equal(a, b) for a, b in zip(spawned, forked))
    assert calls == {"rebuild_storage_fd": 0, "rebuild_storage_filename": 0}


@pytest.mark.slow  # a fresh interpreter imports torch: a few seconds
def test_workers_inherit_numpy_random_instead_of_importing_it_each() -> None:
    """torch's worker loop seeds numpy.random as each worker starts: imported once in the training
    process, forked workers start in 9.5 ms of CPU instead of 22 (measured on the 2-core box)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import sys, streampack.dataset; print('numpy.random' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
