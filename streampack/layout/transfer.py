"""How a batch crosses from a DataLoader worker to the training process, without a handshake.

torch's default moves every storage into its own segment whose descriptor the receiver fetches over a socket from the
worker's ``resource_sharer`` thread, which needs the worker's GIL while it builds the next batch. :func:`reduce_batch`
sends each distinct storage once instead: when one is large, all of them together in one slot of the sender's ring
(:mod:`streampack.layout.shm_ring`); else, or without a free slot, a small one inside the pickle and a large one
through torch's ``file_system`` sharing; :func:`from_wire` rebuilds every tensor as a view of its storage, so shared
storages stay shared. A 32 k-token batch from 2 workers, CPU of all processes: 1.5 ms with the ring, 1.9 with named
segments, 2.8 with torch's default (``benchmarks/bench_transfer.py``); of it the ring's own parts, 0.11 ms
(``--parts``). Only the queue between processes uses this (``ForkingPickler.register``).
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


class Wire(NamedTuple):
    """A batch on the wire: its class, its fields' values, its tensors as views of their storages.

    Plain tuples throughout (a named tuple or dataclass per view costs a Python-level reduce in the pickle); the
    views are named columns, one entry per view."""

    cls: type
    values: tuple[Any, ...]
    """Every field's value in ``dataclasses.fields(cls)`` order; a tensor field holds its index into the views."""
    tensor_fields: int
    """Bit ``i`` set: field ``i`` is a tensor (``values[i]`` indexes the views)."""
    extras: tuple[tuple[str, int], ...] | None
    """The ``extras`` mapping's ``(name, view index)`` pairs when its values are tensors, else None (it travels as
    its value in ``values``)."""
    view_storage: tuple[int, ...]
    """Per view: index into ``storages``."""
    view_dtype: tuple[torch.dtype, ...]
    view_offset: tuple[int, ...]
    """Per view: storage offset in elements of its dtype."""
    view_size: tuple[tuple[int, ...], ...]
    view_stride: tuple[tuple[int, ...], ...]
    storages: tuple[Any, ...]
    """Per storage: its bytes (small ones), its byte offset in ``slot`` (an int), or torch's
    shared-memory file handle ``(manager, handle, nbytes)`` from ``UntypedStorage._share_filename_cpu_``."""
    slot: SlotRef | None = None
    """The shared-memory slot holding every storage of the batch (:mod:`streampack.layout.shm_ring`), or None."""


_names: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    """``cls``'s field names in order, looked up once per class (``dataclasses.fields`` costs ~4 µs a call)."""
    names = _names.get(cls)
    if names is None:
        names = _names[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _plain_cpu(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor and t.is_cpu and t.layout == torch.strided \
        and not t.is_quantized and not t.requires_grad and not t.is_conj() and not t.is_neg()


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


def _into_slot(storages: list[torch.UntypedStorage]) -> tuple[SlotRef, list[int]] | None:
    """Copy ``storages`` into one free slot of this process's ring: the slot and each storage's
    byte offset in it, or None (no ring here, or too many slots still held by receivers)."""
    offsets, end = [], 0
    for storage in storages:
        offsets.append(end)
        end += -(-storage.nbytes() // _ALIGN) * _ALIGN
    got = shm_ring.take(end)
    if got is None:
        return None
    ref, memory = got
    slot = np.frombuffer(memory, dtype=np.uint8, count=end)
    for storage, offset in zip(storages, offsets):
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


class _Views:
    """The distinct storages and the views of a batch's tensors, as :func:`to_wire` collects them."""

    def __init__(self) -> None:
        self.index: dict[int, int] = {}  # id(tensor) -> view index: one object named twice stays one
        self.by_ptr: dict[int, int] = {}  # storage data_ptr -> index into distinct
        self.distinct: list[torch.UntypedStorage] = []
        self.storage: list[int] = []
        self.dtype: list[torch.dtype] = []
        self.offset: list[int] = []
        self.size: list[tuple[int, ...]] = []
        self.stride: list[tuple[int, ...]] = []

    def add(self, t: torch.Tensor) -> int:
        got = self.index.get(id(t))
        if got is not None:
            return got
        storage = t.untyped_storage()
        which = self.by_ptr.setdefault(storage.data_ptr(), len(self.distinct))
        if which == len(self.distinct):
            self.distinct.append(storage)
        self.index[id(t)] = len(self.storage)
        self.storage.append(which)
        self.dtype.append(t.dtype)
        self.offset.append(t.storage_offset())
        self.size.append(tuple(t.shape))
        self.stride.append(t.stride())
        return len(self.storage) - 1


def to_wire(batch: Any) -> Wire | None:
    """``batch`` (a dataclass with tensor fields and an optional ``extras`` mapping) in
    transfer form, or None when it holds a tensor that must go the default way."""
    cls = type(batch)
    values = [getattr(batch, name) for name in _field_names(cls)]
    views, mask, extras = _Views(), 0, None
    for i, (name, value) in enumerate(zip(_names[cls], values)):
        if isinstance(value, torch.Tensor):
            if not _plain_cpu(value):
                return None
            values[i], mask = views.add(value), mask | 1 << i
        elif name == "extras" and isinstance(value, Mapping) and value:
            if not all(isinstance(v, torch.Tensor) and _plain_cpu(v) for v in value.values()):
                return None  # a mapping of tensors and other values has no transfer form
            extras, values[i] = tuple((k, views.add(v)) for k, v in value.items()), None
    # with one large storage, the small ones share its slot too: each would cost a bytes object in the pickle and
    # a writable copy in the training process (~6 µs a storage)
    placed = _into_slot(views.distinct) if any(st.nbytes() > INLINE_BYTES for st in views.distinct) else None
    sent = placed[1] if placed is not None else [_send_storage(storage) for storage in views.distinct]
    return Wire(cls, tuple(values), mask, extras, tuple(views.storage), tuple(views.dtype), tuple(views.offset),
                tuple(views.size), tuple(views.stride), tuple(sent), placed[0] if placed is not None else None)


def from_wire(wire: Wire) -> Any:
    """The batch :func:`to_wire` took apart, every tensor a view of its received storage (the
    storages that came in a slot: views of one storage over the whole slot)."""
    slot = torch.from_numpy(shm_receive.attach(wire.slot)).untyped_storage() if wire.slot is not None else None
    storages = [(slot, sent) if isinstance(sent, int) else (_receive_storage(sent), 0) for sent in wire.storages]
    made = []
    for which, dtype, offset, size, stride in zip(wire.view_storage, wire.view_dtype, wire.view_offset,
                                                  wire.view_size, wire.view_stride):
        storage, byte_offset = storages[which]
        made.append(torch.empty(0, dtype=dtype).set_(storage, byte_offset // dtype.itemsize + offset, size, stride))
    names = _field_names(wire.cls)
    fields = dict(zip(names, wire.values))
    mask = wire.tensor_fields
    for i, name in enumerate(names):
        if mask >> i & 1:
            fields[name] = made[fields[name]]
    if wire.extras is not None:
        fields["extras"] = {name: made[index] for name, index in wire.extras}
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
    if _plain_cpu(t):
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes <= TENSOR_INLINE_BYTES and not storage.is_shared():
            if nbytes and t.nbytes == nbytes and t.is_contiguous() and t.dtype in _NUMPY_DTYPES:
                # the whole storage as one array (a state's columns): half the CPU each way (empty ones not: numpy
                # may give every empty array one null storage, which torch.save refuses as a storage of two types)
                return _rebuild_array, (t.numpy().tobytes(), _NUMPY_DTYPES[t.dtype], tuple(t.shape))
            data = bytes(memoryview(_bytes_of(storage).numpy()))
            return _rebuild_small_tensor, (data, t.dtype, t.storage_offset(), tuple(t.shape), t.stride())
    return reduce_tensor(t)


_NUMPY_DTYPES = {torch.bool: "?", torch.uint8: "u1", torch.int8: "i1", torch.int16: "i2", torch.int32: "i4",
                 torch.int64: "i8", torch.float16: "f2", torch.float32: "f4", torch.float64: "f8"}
"""The dtypes a tensor shares with numpy, as numpy names them (a state's tensors are among them)."""


def _rebuild_array(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    # writable memory: a tensor over the pickle's own bytes object would be read-only
    return torch.from_numpy(np.frombuffer(bytearray(data), dtype=dtype).reshape(shape))


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


def _rebuild_record(cls: type, values: tuple[Any, ...]) -> Any:
    return cls(**dict(zip(_field_names(cls), values)))


def _reduce_record(record: Any) -> Any:
    return _rebuild_record, (type(record), tuple([getattr(record, name) for name in _field_names(type(record))]))


def register_record(cls: type) -> None:
    """Send instances of ``cls`` (a slotted dataclass of plain values whose every field is an ``__init__`` argument)
    between processes as the tuple of its field values: a slotted dataclass's own pickling looks its fields up twice
    (~12 µs a batch's :class:`~streampack.layout.stats.WorkerStats` through the queue, ~6 µs as a tuple)."""
    if not all(f.init for f in dataclasses.fields(cls)):
        raise TypeError(f"{cls.__name__} has a field that is not an __init__ argument: it cannot be rebuilt from its "
                        f"fields' values")
    ForkingPickler.register(cls, _reduce_record)
