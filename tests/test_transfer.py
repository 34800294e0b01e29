"""A PackedBatch crossing from a DataLoader worker: no per-storage handshake, same batch."""

from __future__ import annotations

import dataclasses
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from streampack.layout.batch import PackedBatch, check_invariants, pack_batch
from streampack.layout.stats import WorkerStats
from streampack.sample import Sample


def _batch(align: int = 1, extras: bool = False) -> PackedBatch:
    rng = np.random.default_rng(0)
    packs = []
    for p in range(4):
        pack = []
        for i in range(3):
            n = int(rng.integers(100, 1300))
            extra = {"pixel_rows": rng.standard_normal((n, 2)).astype(np.float32)} if extras else {}
            loss_mask = rng.random(n) < 0.7
            pack.append(Sample(key=f"{p}-{i}", url="/d/x.tar", tokens=rng.integers(0, 50_000, n),
                               loss_mask=loss_mask, extras=extra))
        packs.append(pack)
    batch = pack_batch(packs, capacity=4096, align=align)
    return dataclasses.replace(batch, stats=WorkerStats(dp_rank=0, worker_id=1, batches=3), est_cost=1.5)


def _same(a: PackedBatch, b: PackedBatch) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        elif f.name == "extras":
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        elif f.name == "stats":
            assert dataclasses.asdict(x) == dataclasses.asdict(y)
        else:
            assert x == y, f.name


def test_round_trip_keeps_fields_sharing_and_identity() -> None:
    for align, extras in ((1, False), (2, True)):
        batch = _batch(align, extras)
        got = ForkingPickler.loads(ForkingPickler.dumps(batch))
        _same(batch, got)
        check_invariants(got)
        # the three [T] rows still share one storage, and a tensor named twice is one object
        ptr = got.input_ids.untyped_storage().data_ptr()
        assert got.labels.untyped_storage().data_ptr() == ptr == got.position_ids.untyped_storage().data_ptr()
        assert (got.varlen_cu_seqlens_bidirectional is got.varlen_cu_seqlens) == (align == 1)
        before = int(batch.input_ids[0])
        got.input_ids[0] = before + 1  # writable memory
        assert int(got.input_ids[0]) == before + 1


def test_large_storages_go_by_name_not_by_descriptor_handshake() -> None:
    """torch's default (file_descriptor) reduction makes the receiver fetch each storage's fd
    over an authenticated socket from the worker's resource_sharer thread: ~3 ms per storage
    per batch while the worker holds its GIL building the next batch."""
    batch = _batch()
    assert batch.input_ids.untyped_storage().nbytes() > 1 << 16
    data = bytes(ForkingPickler.dumps(batch))
    assert b"rebuild_storage_fd" not in data and b"DupFd" not in data
    assert b"/torch_" in data  # the named segment torch_shm_manager tracks


def test_tensor_that_cannot_travel_as_bytes_takes_the_default_way() -> None:
    batch = _batch()
    odd = dataclasses.replace(batch, extras={"w": torch.zeros(batch.total_tokens, requires_grad=True)})
    data = bytes(ForkingPickler.dumps(odd))
    assert b"/torch_" not in data and b"rebuild_storage_fd" in data
    got = ForkingPickler.loads(data)
    assert got.extras["w"].requires_grad and torch.equal(got.input_ids, batch.input_ids)


class _Batches(IterableDataset):
    def __iter__(self):
        for align in (1, 2):
            yield _batch(align, extras=align == 2)


def test_through_a_dataloader_worker() -> None:
    got = list(DataLoader(_Batches(), batch_size=None, num_workers=1))
    assert len(got) == 2
    for batch, want in zip(got, _Batches()):
        _same(want, batch)
        check_invariants(batch)
