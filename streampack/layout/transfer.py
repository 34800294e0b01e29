"""How a batch crosses from a DataLoader worker to the training process, without a handshake.

torch's default moves every storage into its own segment whose descriptor the receiver fetches over a socket from the
worker's ``resource_sharer`` thread, which needs the worker's GIL while it builds the next batch. :func:`reduce_batch`
sends each distinct storage once instead: a small one inside the pickle, the large ones together in one slot of the
sender's ring (:mod:`streampack.layout.shm_ring`), or, without a free slot, through torch's ``file_system`` sharing;
:func:`from_wire` rebuilds every tensor as a view of its storage, so shared storages stay shared. Per batch: 2.9 ms of
CPU with the ring, 3.8 with named segments, 5.0 with torch's default (``benchmarks/bench_transfer.py``). Only the queue
between processes uses this (``ForkingPickler.register``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from multiprocessing.reduction import ForkingPickler
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef, rebuild_storage_filename, reduce_tensor, shared_cache

from streampack.layout import shm_receive, shm_ring
from streampack.layout.shm_ring import SlotRef

INLINE_BYTES = 1 << 16
"""Storages up to this size travel inside the pickle (a shared-memory segment costs more)."""
TENSOR_INLINE_BYTES = 1 << 20
"""With :func:`inline_small_tensors`: tensors whose storage is up to this size travel inside the
pickle (a window of 1024 references is 57 KB; copying 1 MiB through the pipe costs less than a
new shared-memory segment and its descriptor handshake)."""
_ALIGN = 64
"""Byte alignment of each storage inside a slot (any dtype's element size divides it)."""


class TensorView(NamedTuple):
    """One tensor of the batch: which storage it views, and how."""

    storage: int
    """Index into ``Wire.storages``."""
    dtype: torch.dtype
    storage_offset: int
    """In elements of ``dtype``."""
    size: tuple[int, ...]
    stride: tuple[int, ...]


class Wire(NamedTuple):
    """A batch on the wire: its class, non-tensor fields, its tensors and their storages."""

    cls: type
    plain: dict[str, Any]
    """Fields that are not tensors (extras excluded), pickled as they are."""
    tensors: dict[str, int]
    """Field name (``extras/NAME`` for an extra) -> index into ``views``."""
    views: tuple[TensorView, ...]
    storages: tuple[Any, ...]
    """Per storage: its bytes (small ones), its byte offset in ``slot`` (an int), or torch's
    shared-memory file handle ``(manager, handle, nbytes)`` from ``UntypedStorage._share_filename_cpu_``."""
    slot: SlotRef | None = None
    """The shared-memory slot holding every large storage of the batch (:mod:`streampack.layout.shm_ring`)."""


def _plain_cpu(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor and t.device.type == "cpu" and t.layout == torch.strided \
        and not t.is_quantized and not t.requires_grad and not t.is_conj() and not t.is_neg()


def _tensor_items(batch: Any) -> dict[str, torch.Tensor] | None:
    """Every tensor of ``batch`` by field name, or None if one cannot travel as bytes."""
    out: dict[str, torch.Tensor] = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            out[f.name] = value
        elif f.name == "extras" and isinstance(value, Mapping):
            for k, v in value.items():
                if not isinstance(v, torch.Tensor):
                    return None
                out[f"extras/{k}"] = v
    return out if all(_plain_cpu(t) for t in out.values()) else None


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))


def _send_storage(storage: torch.UntypedStorage) -> Any:
    nbytes = storage.nbytes()
    if nbytes <= INLINE_BYTES:
        return bytes(memoryview(_bytes_of(storage).numpy()))
    # torch's own file_system sharing for this one storage (what reduce_storage does under
    # set_sharing_strategy("file_system")): the segment is named, so the receiver opens it by
    # name with no handshake; torch_shm_manager unlinks it if either process dies first
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()  # the receiver's rebuild_storage_filename drops this reference
    shared_cache[handle] = StorageWeakRef(storage)
    return (manager, handle, size)


def _into_slot(large: list[torch.UntypedStorage]) -> tuple[SlotRef, list[int]] | None:
    """Copy ``large`` into one free slot of this process's ring: the slot and each storage's
    byte offset in it, or None (no ring here, or too many slots still held by receivers)."""
    offsets, end = [], 0
    for storage in large:
        offsets.append(end)
        end += -(-storage.nbytes() // _ALIGN) * _ALIGN
    got = shm_ring.take(end)
    if got is None:
        return None
    ref, memory = got
    slot = np.frombuffer(memory, dtype=np.uint8, count=end)
    for storage, offset in zip(large, offsets):
        # numpy's copy: one thread, ~30 µs for 768 KiB; torch's copy_ may wake its thread pool
        # (1.4-7 ms for the same bytes on the loaded 2-core box)
        slot[offset:offset + storage.nbytes()] = _bytes_of(storage).numpy()
    del slot
    return ref, offsets


def _receive_storage(sent: Any) -> torch.UntypedStorage:
    if isinstance(sent, bytes):
        # writable memory: a tensor over the pickle's own bytes object would be read-only
        return torch.frombuffer(bytearray(sent), dtype=torch.uint8).untyped_storage() if sent \
            else torch.UntypedStorage(0)
    return rebuild_storage_filename(torch.UntypedStorage, *sent)


def to_wire(batch: Any) -> Wire | None:
    """``batch`` (a dataclass with tensor fields and an optional ``extras`` mapping) in
    transfer form, or None when it holds a tensor that must go the default way."""
    items = _tensor_items(batch)
    if items is None:
        return None
    storages: dict[int, int] = {}  # storage data_ptr -> index into distinct
    distinct: list[torch.UntypedStorage] = []
    views: list[TensorView] = []
    slots: dict[str, int] = {}
    seen: dict[int, int] = {}  # id(tensor) -> view index: one object named twice stays one
    for name, t in items.items():
        if id(t) in seen:
            slots[name] = seen[id(t)]
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in storages:
            storages[key] = len(distinct)
            distinct.append(storage)
        seen[id(t)] = slots[name] = len(views)
        views.append(TensorView(storages[key], t.dtype, t.storage_offset(), tuple(t.shape), t.stride()))
    large = [i for i, st in enumerate(distinct) if st.nbytes() > INLINE_BYTES]
    placed = _into_slot([distinct[i] for i in large]) if large else None
    sent: list[Any] = [None] * len(distinct)
    if placed is not None:
        for i, offset in zip(large, placed[1]):
            sent[i] = offset
    for i, storage in enumerate(distinct):
        if sent[i] is None:
            sent[i] = _send_storage(storage)
    plain = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)
             if f.name not in items and not (f.name == "extras" and any(k.startswith("extras/") for k in items))}
    return Wire(type(batch), plain, slots, tuple(views), tuple(sent), placed[0] if placed is not None else None)


def from_wire(wire: Wire) -> Any:
    """The batch :func:`to_wire` took apart, every tensor a view of its received storage (the
    storages that came in a slot: views of one storage over the whole slot)."""
    slot = torch.from_numpy(shm_receive.attach(wire.slot)).untyped_storage() if wire.slot is not None else None
    storages = [(slot, sent) if isinstance(sent, int) else (_receive_storage(sent), 0) for sent in wire.storages]
    made = []
    for v in wire.views:
        storage, byte_offset = storages[v.storage]
        offset = byte_offset // v.dtype.itemsize + v.storage_offset
        made.append(torch.empty(0, dtype=v.dtype).set_(storage, offset, v.size, v.stride))
    fields = dict(wire.plain)
    extras = {}
    for name, index in wire.tensors.items():
        if name.startswith("extras/"):
            extras[name[len("extras/"):]] = made[index]
        else:
            fields[name] = made[index]
    if extras:
        fields["extras"] = extras
    return wire.cls(**fields)


def reduce_batch(batch: Any) -> Any:
    """``ForkingPickler`` reducer: the batch in transfer form, or the default reduction."""
    wire = to_wire(batch)
    if wire is None:
        return batch.__reduce_ex__(4)
    return from_wire, (wire,)


def _reduce_small_tensor(t: torch.Tensor) -> Any:
    """``ForkingPickler`` reducer for ``torch.Tensor`` in a DataLoader worker: a small plain CPU tensor travels inside
    the pickle; anything else (large, shared on purpose, on a GPU) the default way."""
    if _plain_cpu(t) and not t.is_shared():
        storage = t.untyped_storage()
        if storage.nbytes() <= TENSOR_INLINE_BYTES:
            data = bytes(memoryview(_bytes_of(storage).numpy()))
            return _rebuild_small_tensor, (data, t.dtype, t.storage_offset(), tuple(t.shape), t.stride())
    return reduce_tensor(t)


def _rebuild_small_tensor(data: bytes, dtype: torch.dtype, offset: int, size: tuple[int, ...],
                          stride: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(0, dtype=dtype).set_(_receive_storage(data), offset, size, stride)


def inline_small_tensors() -> None:
    """Send small plain tensors from this process by value: a state delta's tensors cost ~1-3 ms of both
    processes' CPU each through torch's reduction, a 0.6-60 KB copy inside the pickle."""
    ForkingPickler.register(torch.Tensor, _reduce_small_tensor)


_settled_pid = 0


def settle_worker() -> None:
    """Once per DataLoader worker process: :func:`inline_small_tensors` (no ``gc.freeze()``: it made the
    workers slower, ``docs/changelog.md``)."""
    global _settled_pid
    if _settled_pid != os.getpid():
        _settled_pid = os.getpid()
        inline_small_tensors()


def register(cls: type) -> None:
    """Send instances of ``cls`` (a dataclass batch) between processes in transfer form."""
    ForkingPickler.register(cls, reduce_batch)
