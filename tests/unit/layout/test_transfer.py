"""A PackedBatch crossing from a DataLoader worker: no per-storage handshake, same batch."""

from __future__ import annotations

import dataclasses
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from streampack.layout import shm_ring, transfer
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
    batch = pack_batch(packs, capacity=8192, align=align)  # int32 ids: 128 KiB, past INLINE_BYTES
    return dataclasses.replace(batch, stats=WorkerStats(dp_rank=0, worker_id=1, batches=3), est_cost=1.5)


def _same(a: PackedBatch, b: PackedBatch) -> None:
    for name in [f.name for f in dataclasses.fields(a) if f.init] + ["labels", "position_ids"]:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), name
        elif name == "extras":
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        elif name == "stats":
            assert dataclasses.asdict(x) == dataclasses.asdict(y)
        else:
            assert x == y, name


def test_round_trip_keeps_fields_sharing_and_identity() -> None:
    for align, extras in ((1, False), (2, True)):
        batch = _batch(align, extras)
        batch.labels  # fills the sender's cache of derived fields
        got = ForkingPickler.loads(ForkingPickler.dumps(batch))
        assert batch._derived is not None and getattr(got, "_derived", None) is None  # the cache stays behind
        _same(batch, got)
        check_invariants(got)
        # only what is stored crosses: int32 ids, the bool loss mask, the offsets
        wire = transfer.to_wire(batch)
        assert set(wire.view_dtype) <= {torch.int32, torch.bool, torch.float32}
        transfer.from_wire(wire)  # gives its slot back
        assert got.input_ids.dtype == torch.int32 and got.loss_mask.dtype == torch.bool and got.target_ids is None
        assert (got.varlen_cu_seqlens_bidirectional is got.varlen_cu_seqlens) == (align == 1)
        before = int(batch.input_ids[0])
        got.input_ids[0] = before + 1  # writable memory
        assert int(got.input_ids[0]) == before + 1


@pytest.mark.skipif(not shm_ring.available(), reason="needs memfd_create and /proc (Linux)")
def test_large_storages_go_in_a_reused_slot_not_a_new_segment_per_batch() -> None:
    """torch's default (file_descriptor) reduction makes the receiver fetch each storage's fd
    over an authenticated socket from the worker's resource_sharer thread (~3 ms per storage per
    batch while the worker holds its GIL); its file_system sharing needs a new segment per batch
    and a torch_shm_manager process, which a worker starts on its first batch (0.25-1.4 s)."""
    batch = _batch(2, extras=True)
    assert batch.input_ids.untyped_storage().nbytes() > 1 << 16
    data = bytes(ForkingPickler.dumps(batch))
    assert b"rebuild_storage_fd" not in data and b"DupFd" not in data and b"/torch_" not in data
    assert b"SlotRef" in data
    got = ForkingPickler.loads(data)
    _same(batch, got)
    # every large storage of the batch (the ids, the loss mask and the extra) is in one slot: one mapping
    ptrs = {got.input_ids.untyped_storage().data_ptr(), got.extras["pixel_rows"].untyped_storage().data_ptr()}
    assert len(ptrs) == 1
    # a held batch keeps its slot; released ones come back, so the ring stays as small as what is held
    held = transfer.from_wire(transfer.to_wire(batch))
    for _ in range(10):
        transfer.from_wire(transfer.to_wire(batch))  # dropped at once
    shm_ring._ring.drain()
    assert sum(s.busy for s in shm_ring._ring.slots) == 2 and len(shm_ring._ring.slots) <= 3
    _same(batch, held)


@pytest.mark.skipif(not shm_ring.available(), reason="needs memfd_create and /proc (Linux)")
def test_a_batch_with_a_slot_sends_its_small_storages_in_it_too() -> None:
    """The offsets and a small loss mask ride in the ids' slot: no bytes object of each in the pickle, no writable
    copy of each in the training process."""
    batch = _batch(2, extras=True)
    data = bytes(ForkingPickler.dumps(batch))
    assert len(data) < 4096, len(data)  # the doc keys, the stats and the views: no storage's bytes
    got = ForkingPickler.loads(data)
    _same(batch, got)
    small = (got.cu_seqlens, got.cu_seqlens_padded, got.varlen_cu_seqlens, got.varlen_cu_seqlens_bidirectional)
    assert {t.untyped_storage().data_ptr() for t in (got.input_ids, *small)} == {got.input_ids.untyped_storage().data_ptr()}


def test_worker_stats_cross_as_their_fields_values() -> None:
    """A slotted dataclass pickles through a Python ``__getstate__`` that looks its fields up (~2x the CPU)."""
    stats = WorkerStats(dp_rank=1, worker_id=2, batches=3, tokens=7, build_seconds=0.5, events={"retry": 2})
    data = bytes(ForkingPickler.dumps(stats))
    assert b"_rebuild_record" in data
    got = ForkingPickler.loads(data)
    assert type(got) is WorkerStats and dataclasses.asdict(got) == dataclasses.asdict(stats)

    @dataclasses.dataclass(slots=True)
    class Derived:
        a: int
        b: int = dataclasses.field(init=False, default=0)

    with pytest.raises(TypeError, match="not an __init__ argument"):
        transfer.register_record(Derived)


def test_without_a_slot_large_storages_go_by_name(monkeypatch) -> None:
    """No ring (not Linux, or too many batches held): torch's named segments, no handshake."""
    monkeypatch.setattr(shm_ring, "take", lambda nbytes: None)
    batch = _batch()
    data = bytes(ForkingPickler.dumps(batch))
    assert b"rebuild_storage_fd" not in data and b"/torch_" in data
    _same(batch, ForkingPickler.loads(data))


def test_held_batches_are_never_overwritten() -> None:
    """The trainer keeps every batch (e.g. in a list): each keeps its own bytes while the worker
    goes on sending."""
    wires = [ForkingPickler.dumps(_batch(align=1 + i % 2)) for i in range(6)]
    got = [ForkingPickler.loads(w) for w in wires]
    for i, batch in enumerate(got):
        _same(_batch(align=1 + i % 2), batch)


def _pickled_in_a_worker(state: dict) -> bytes:
    """``state`` pickled with the tensor reduction every worker installs (``transfer.inline_small_tensors``)."""
    saved = ForkingPickler._extra_reducers.get(torch.Tensor)
    try:
        transfer.inline_small_tensors()
        return bytes(ForkingPickler.dumps(state))
    finally:
        ForkingPickler._extra_reducers[torch.Tensor] = saved


def test_small_state_tensors_travel_by_value_in_a_worker() -> None:
    """StatefulDataLoader sends the dataset's state delta after every batch; the tensors in it
    (window references, pack sizes) went through torch's fd handshake one by one."""
    state = {"refs": torch.arange(7000, dtype=torch.int64).reshape(1000, 7)[:, 1:], "n": torch.tensor(3),
             "big": torch.zeros(2 << 20, dtype=torch.uint8), "shared": torch.ones(4).share_memory_()}
    data = _pickled_in_a_worker(state)
    assert data.count(b"_rebuild_small_tensor") == 1 and data.count(b"rebuild_storage_fd") == 1  # big and shared
    got = ForkingPickler.loads(data)
    for k, v in state.items():
        assert got[k].dtype == v.dtype and got[k].stride() == v.stride() and torch.equal(got[k], v), k
    assert got["shared"].is_shared()


def test_a_states_whole_columns_travel_as_arrays_and_save_again() -> None:
    """A state's columns (each a whole storage) cross as numpy bytes, not as a storage rebuilt each (a PackedLoader
    worker's 58 KB state a batch: 454-481 µs there and back, now 219-326, ``benchmarks/README.md``); they come back
    writable and ``torch.save`` takes the state, empty columns too (those take the storage way: numpy may share one
    null storage among empty arrays)."""
    import io

    state = {"is_ref": torch.tensor([True, False, True]), "length": torch.arange(5, dtype=torch.int64),
             "n": torch.tensor(3), "half": torch.ones(4, dtype=torch.float16), "empty": torch.zeros(0, dtype=torch.int64),
             "empty2": torch.zeros(0, dtype=torch.int64), "bf16": torch.ones(2, dtype=torch.bfloat16)}
    data = _pickled_in_a_worker(state)
    ways = {k: transfer._reduce_small_tensor(v)[0].__name__ for k, v in state.items()}
    assert ways == {"is_ref": "_rebuild_array", "length": "_rebuild_array", "n": "_rebuild_array",
                    "half": "_rebuild_array", "empty": "_rebuild_small_tensor", "empty2": "_rebuild_small_tensor",
                    "bf16": "_rebuild_small_tensor"}
    got = ForkingPickler.loads(data)
    for k, v in state.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
    got["length"] += 1  # writable
    torch.save(got, io.BytesIO())


def test_tensor_that_cannot_travel_as_bytes_takes_the_default_way() -> None:
    batch = _batch()
    odd = dataclasses.replace(batch, extras={"w": torch.zeros(batch.total_tokens, requires_grad=True)})
    data = bytes(ForkingPickler.dumps(odd))
    assert b"/torch_" not in data and b"rebuild_storage_fd" in data
    got = ForkingPickler.loads(data)
    assert got.extras["w"].requires_grad and torch.equal(got.input_ids, batch.input_ids)


class _Batches(IterableDataset):
    def __init__(self, n: int = 2) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield _batch(1 + i % 2, extras=i % 2 == 1)


def test_through_a_dataloader_worker() -> None:
    # 12 batches all held by the loop, through 2 workers: the ring grows instead of reusing a held slot
    got = list(DataLoader(_Batches(12), batch_size=None, num_workers=2))
    assert len(got) == 24
    for batch, want in zip(got, (b for b in _Batches(12) for _ in range(2))):
        _same(want, batch)
        check_invariants(batch)
