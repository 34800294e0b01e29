"""The batch slot ring: a slot comes back only after its receiver dropped every view of it."""

from __future__ import annotations

import dataclasses
import gc
import os
import pickle

import numpy as np
import pytest
import torch

from streampack.layout import shm_receive, shm_ring
from streampack.layout.shm_ring import SlotRef

pytestmark = pytest.mark.skipif(not shm_ring.available(), reason="needs memfd_create and /proc (Linux)")


@pytest.fixture(autouse=True)
def fresh_ring(monkeypatch):
    monkeypatch.setattr(shm_ring, "_ring", None)
    monkeypatch.setattr(shm_receive, "_maps", {})
    monkeypatch.setattr(shm_receive, "_pipes", {})
    yield
    gc.collect()


def _send(nbytes: int, fill: int) -> SlotRef:
    got = shm_ring.take(nbytes)
    assert got is not None
    ref, memory = got
    np.frombuffer(memory, dtype=np.uint8, count=nbytes)[:] = fill
    return ref


def test_a_held_slot_is_never_handed_out_again() -> None:
    first = _send(10_000, 1)
    held = shm_receive.attach(first)
    others = [_send(10_000, 2 + i) for i in range(5)]
    assert first.slot not in {r.slot for r in others}  # no release yet: every send took a new slot
    assert (held[:10_000] == 1).all()  # and the held bytes were never overwritten
    del held
    gc.collect()
    again = _send(10_000, 9)
    assert again.slot == first.slot and again.generation == first.generation + 1


def test_released_slots_are_reused_so_the_ring_stays_small() -> None:
    for i in range(50):
        view = shm_receive.attach(_send(100_000, i % 256))
        assert int(view[0]) == i % 256
        del view
    assert len(shm_ring._ring.slots) == 1


def test_releases_are_read_only_when_no_slot_known_free_fits(monkeypatch) -> None:
    """Reading the release pipe is a syscall a batch in the worker's feeder thread (~20 µs there,
    ``bench_transfer.py --in-worker``): one read serves every release written before it."""
    views = [shm_receive.attach(_send(10_000, i)) for i in range(3)]
    del views
    gc.collect()  # all three released: three tickets wait in the pipe
    reads = []
    real_read = os.read
    monkeypatch.setattr(shm_ring.os, "read", lambda fd, n: reads.append(fd) or real_read(fd, n))
    again = [_send(10_000, 7) for _ in range(3)]
    assert len(reads) == 1  # the first take read all three releases; the next two took slots known free
    assert sorted(r.slot for r in again) == [0, 1, 2] and len(shm_ring._ring.slots) == 3


def test_a_view_made_from_the_slot_keeps_it_held() -> None:
    """The trainer may keep one tensor of a batch (a slice of ``input_ids``) and drop the rest."""
    ref = _send(4096, 7)
    kept = torch.from_numpy(shm_receive.attach(ref)).untyped_storage()
    view = torch.empty(0, dtype=torch.uint8).set_(kept, 8, (16,), (1,))
    del kept
    gc.collect()
    other = _send(4096, 8)
    assert other.slot != ref.slot and bool((view == 7).all())


def test_stale_or_repeated_release_does_not_free_a_slot_in_use() -> None:
    ref = _send(4096, 1)
    shm_receive.attach(ref)  # dropped at once: released
    reused = _send(4096, 2)
    assert reused.slot == ref.slot
    # a duplicate of the first use's ticket arrives late: the slot's second use is still held
    shm_receive._release(os.getpid(), (ref.pid, ref.pipe_fd, ref.pipe_id), shm_ring.TICKET.pack(ref.slot, ref.generation))
    assert _send(4096, 3).slot != reused.slot


def test_full_ring_says_so(monkeypatch) -> None:
    monkeypatch.setattr(shm_ring, "MAX_SLOTS", 2)
    refs = [_send(4096, 1), _send(4096, 2)]
    assert shm_ring.take(4096) is None  # the caller sends this batch the old way
    del refs


def test_a_reference_to_another_file_is_refused() -> None:
    ref = _send(4096, 1)
    wrong = dataclasses.replace(ref, file_id=(ref.file_id[0], ref.file_id[1] + 1))
    with pytest.raises(RuntimeError, match="gone"):
        shm_receive.attach(wrong)


def test_release_to_a_process_that_is_gone_is_harmless() -> None:
    shm_receive._release(os.getpid(), (2**22 + 12345, 3, (0, 0)), shm_ring.TICKET.pack(0, 1))  # no such pid


def test_a_forked_child_gets_a_ring_of_its_own() -> None:
    parent = _send(4096, 1)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            ref = shm_ring.take(4096)[0]
            os.write(write, f"{ref.pid} {ref.fd}".encode())
        finally:
            os._exit(0)
    os.close(write)
    got = os.read(read, 100).decode().split()
    os.waitpid(pid, 0)
    assert int(got[0]) == pid != parent.pid


def test_a_slot_seen_before_is_not_mapped_again(monkeypatch) -> None:
    maps = []
    real = shm_receive._map
    monkeypatch.setattr(shm_receive, "_map", lambda ref: maps.append(ref.slot) or real(ref))
    for i in range(20):
        assert int(shm_receive.attach(_send(65_536, i))[0]) == i  # each batch's own bytes
    assert maps == [0]


def test_mappings_of_a_sender_that_is_gone_are_dropped() -> None:
    to_parent, to_child = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child: send one slot, wait, exit
        try:
            os.write(to_parent[1], pickle.dumps(_send(4096, 5)))
            os.read(to_child[0], 1)
        finally:
            os._exit(0)
    view = shm_receive.attach(pickle.loads(os.read(to_parent[0], 1000)))
    assert int(view[0]) == 5 and any(k[0] == pid for k in shm_receive._maps)
    os.write(to_child[1], b"x")
    os.waitpid(pid, 0)
    shm_receive.attach(_send(4096, 6))  # a new slot: the sweep drops the gone sender's entries
    assert not any(k[0] == pid for k in shm_receive._maps)
    assert int(view[0]) == 5  # what is still viewed stays mapped
    del view  # its release finds the sender gone: harmless


def test_a_forked_child_freeing_an_inherited_batch_does_not_release_it() -> None:
    ref = _send(4096, 1)
    held = shm_receive.attach(ref)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            del held
            gc.collect()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert _send(4096, 2).slot != ref.slot and int(held[0]) == 1
