"""Reusable shared-memory slots for batches leaving a process, released by the receiver.

A process keeps a ring of slots (one anonymous ``memfd`` each, mapped once) and copies a batch's large storages into a
free one, where torch's ``file_system`` sharing makes a segment per batch through ``torch_shm_manager`` (0.25-1.4 s to
start before a worker's first batch). The receiver maps the slot through ``/proc/<pid>/fd/<fd>`` and, when the last view
is freed, writes its ticket into the sender's release pipe, which the sender reads when no slot it knows free fits (one
read serves the next several takes), so a held batch is never overwritten (past ``MAX_SLOTS`` / ``MAX_BYTES``
:func:`take` returns None and the batch goes torch's way); the pipe also orders memory. References carry the memfd's
and pipe's (device, inode), so a reused pid is refused. Linux only: :func:`available` is False elsewhere, without
readable ``/proc/self/fd`` entries or under Yama ``ptrace_scope`` 2 or 3.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from dataclasses import dataclass

MAX_SLOTS = 64
"""Slots a process may have in flight (not yet released by their receivers); typical use holds
``prefetch_factor`` + 2 per worker (queued batches, the one the loop holds, the next one)."""
MAX_BYTES = 4 << 30
"""Bytes of slots a process may hold in all."""
TICKET = struct.Struct("<II")
"""A release: slot index, generation."""
_PAGE = mmap.PAGESIZE


@dataclass(frozen=True, slots=True)
class SlotRef:
    """Where a receiver finds a batch's bytes, and how it gives the slot back."""

    pid: int
    fd: int
    """The slot's memfd in process ``pid``."""
    file_id: tuple[int, int]
    """``(st_dev, st_ino)`` of that memfd (a reused pid or fd number is refused)."""
    size: int
    """Bytes mapped (the slot's size, a multiple of the page size)."""
    slot: int
    generation: int
    """Which use of the slot this is (a stale or repeated release is ignored)."""
    pipe_fd: int
    pipe_id: tuple[int, int]
    """The sender's release pipe (write end) and its ``(st_dev, st_ino)``."""


@dataclass(slots=True)
class _Slot:
    fd: int
    file_id: tuple[int, int]
    size: int
    memory: mmap.mmap
    generation: int = 0
    busy: bool = False


class _Ring:
    """One process's slots and the read end of its release pipe."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.read_fd, self.write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.pipe_id = identity(self.write_fd)
        self.slots: list[_Slot] = []
        self.lock = threading.Lock()  # batches are pickled in the queue's feeder thread, or anywhere

    def drain(self) -> None:
        while True:
            try:
                data = os.read(self.read_fd, 1 << 16)
            except BlockingIOError:
                return
            if not data:
                return
            for slot, generation in TICKET.iter_unpack(data[: len(data) - len(data) % TICKET.size]):
                s = self.slots[slot] if slot < len(self.slots) else None
                if s is not None and s.busy and s.generation == generation:
                    s.busy = False
            if len(data) < 1 << 16:  # emptied: a second read would only raise (~2 µs a batch)
                return

    def take(self, nbytes: int) -> tuple[SlotRef, mmap.mmap] | None:
        with self.lock:
            return self._take(nbytes)

    def _take(self, nbytes: int) -> tuple[SlotRef, mmap.mmap] | None:
        free = [i for i, s in enumerate(self.slots) if not s.busy and s.size >= nbytes]
        if not free:  # read the releases only when no slot known free fits: one read serves the next several takes
            self.drain()
            free = [i for i, s in enumerate(self.slots) if not s.busy and s.size >= nbytes]
        if free:
            index = min(free, key=lambda i: self.slots[i].size)
        else:
            busy = [s for s in self.slots if s.busy]
            if len(busy) >= MAX_SLOTS or sum(s.size for s in busy) + nbytes > MAX_BYTES:
                return None
            index = self._new(nbytes)
        slot = self.slots[index]
        slot.busy = True
        slot.generation = (slot.generation + 1) & 0xFFFFFFFF
        ref = SlotRef(pid=self.pid, fd=slot.fd, file_id=slot.file_id, size=slot.size, slot=index,
                      generation=slot.generation, pipe_fd=self.write_fd, pipe_id=self.pipe_id)
        return ref, slot.memory

    def _new(self, nbytes: int) -> int:
        """Index of a new slot of at least ``nbytes``: appended, or replacing the smallest free
        slot (too small for this batch) so the ring does not keep slots it no longer uses."""
        size = -(-nbytes // _PAGE) * _PAGE
        fd = os.memfd_create("streampack-batch", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        slot = _Slot(fd=fd, file_id=identity(fd), size=size, memory=mmap.mmap(fd, size))
        idle = [i for i, s in enumerate(self.slots) if not s.busy]
        if not idle:
            self.slots.append(slot)
            return len(self.slots) - 1
        index = min(idle, key=lambda i: self.slots[i].size)
        old = self.slots[index]
        # keep counting generations: a late duplicate release of the old slot's last use
        # cannot free the new one
        slot.generation = old.generation
        old.memory.close()
        os.close(old.fd)
        self.slots[index] = slot
        return index


_ring: _Ring | None = None
_available: bool | None = None


def available() -> bool:
    """Whether this platform has memfds and this process can open its own ``/proc`` fd links."""
    global _available
    if _available is None:
        _available = False
        if hasattr(os, "memfd_create") and hasattr(os, "pipe2") and _ptrace_scope() < 2:
            try:
                fd = os.memfd_create("streampack-probe", os.MFD_CLOEXEC)
                try:
                    os.close(os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC))
                    _available = True
                finally:
                    os.close(fd)
            except OSError:
                pass
    return _available


def _ptrace_scope() -> int:
    """Yama's ``kernel.yama.ptrace_scope`` (0 where Yama is absent)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def take(nbytes: int) -> tuple[SlotRef, mmap.mmap] | None:
    """A free slot of at least ``nbytes`` (its reference and its writable bytes), or None when the
    ring is full or unavailable. The slot is the receiver's until it releases it."""
    global _ring
    if not available():
        return None
    if _ring is None or _ring.pid != os.getpid():  # a forked child gets a ring of its own
        _ring = _Ring()
    return _ring.take(nbytes)


def identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino)
