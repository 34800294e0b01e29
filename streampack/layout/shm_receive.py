"""The receiving side of :mod:`streampack.layout.shm_ring`: map a sender's slot, give it back.

A receiver keeps each slot it has seen mapped, keyed by the sender's pid, fd and the file's
``(st_dev, st_ino)``: a batch in a known slot costs no ``open``, ``mmap`` or page faults (a 768 KiB
batch: 1.2 ms from a fresh mapping, 0.4 ms from a kept one). A pidfd watch drops a sender's entries
when it exits. A batch whose sender died first raises ``RuntimeError`` in :func:`attach`; only the
process that attached a slot releases it (a forked child must not hand the parent's slot back).
"""

from __future__ import annotations

import mmap
import os
import select
import threading
import time
import weakref

import numpy as np

from streampack.layout.shm_ring import TICKET, SlotRef, identity

MAX_MAPPED = 256
"""Slots kept mapped at most (oldest dropped first)."""

_lock = threading.RLock()  # a release may run inside attach (a finalizer triggered by the collector)
_maps: dict[tuple[int, int, tuple[int, int]], mmap.mmap] = {}
_pipes: dict[tuple[int, int, tuple[int, int]], int] = {}
_watched: dict[int, int] = {}  # pidfd -> sender pid
_wake: tuple[int, int] | None = None  # the watcher thread's wake-up pipe (read, write)
_owner = 0
EXIT_WAIT_S = 2.0
"""How long a receiver waits for a sender whose slot vanished to finish exiting."""


def attach(ref: SlotRef) -> np.ndarray:
    """The slot's bytes in this process: a writable uint8 array over a mapping of the sender's
    memfd. When the array (and every tensor made from it) is freed, the slot goes back."""
    key = (ref.pid, ref.fd, ref.file_id)
    with _lock:
        _own()
        mapped = _maps.get(key)
        if mapped is None:
            _sweep()
            _watch(ref.pid)  # before mapping: the pidfd then names the process the identity check saw
            mapped = _maps[key] = _map(ref)
    array = np.frombuffer(mapped, dtype=np.uint8, count=ref.size)
    done = weakref.finalize(array, _release, os.getpid(), (ref.pid, ref.pipe_fd, ref.pipe_id),
                            TICKET.pack(ref.slot, ref.generation))
    done.atexit = False
    return array


def _map(ref: SlotRef) -> mmap.mmap:
    try:
        fd = os.open(f"/proc/{ref.pid}/fd/{ref.fd}", os.O_RDWR | os.O_CLOEXEC)
    except PermissionError as e:
        raise RuntimeError(f"cannot open the batch slot of process {ref.pid} through /proc ({e}): this system "
                           f"denies the training process ptrace-read access to its own DataLoader workers (a "
                           f"security module other than Yama?); streampack.layout.shm_ring.available() decides "
                           f"whether slots are used") from e
    except FileNotFoundError:
        if _exited(ref.pid):
            raise RuntimeError(f"the process that sent this batch (pid {ref.pid}, a DataLoader worker) exited "
                               f"unexpectedly before the batch was received; its shared memory went with it "
                               f"(killed, e.g. by the out-of-memory killer: see its exit status)") from None
        raise RuntimeError(f"batch slot of process {ref.pid} is gone (its fd {ref.fd} was closed)") from None
    try:
        if identity(fd) != ref.file_id:
            raise RuntimeError(f"batch slot of process {ref.pid} is gone (its fd {ref.fd} names another file)")
        return mmap.mmap(fd, ref.size)
    finally:
        os.close(fd)


def _release(attacher: int, pipe: tuple[int, int, tuple[int, int]], ticket: bytes) -> None:
    if os.getpid() != attacher:
        return
    with _lock:
        fd = _pipes.get(pipe)
        try:
            if fd is None:
                fd = os.open(f"/proc/{pipe[0]}/fd/{pipe[1]}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                if identity(fd) != pipe[2]:
                    os.close(fd)
                    raise ProcessLookupError(pipe[0])
                _pipes[pipe] = fd
            # 8 bytes: atomic on a pipe; a full pipe (64 KiB of unread tickets) raises and the
            # slot stays held (the sender's ring grows instead)
            os.write(fd, ticket)
        except BlockingIOError:
            pass
        except OSError:  # the sender is gone (its ring went with it), or it is not the same process
            _forget(pipe[0])


def _exited(pid: int) -> bool:
    """Whether ``pid`` has exited (or does within :data:`EXIT_WAIT_S`): a killed process closes its files before it
    becomes a zombie, so a vanished slot can be seen a moment before the exit that the DataLoader checks for."""
    deadline = time.monotonic() + EXIT_WAIT_S
    while True:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in (b"Z", b"X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)


def _watch(pid: int) -> None:
    """Drop ``pid``'s entries when it exits (the watcher thread polls one pidfd per sender)."""
    global _wake
    if pid in _watched.values() or not hasattr(os, "pidfd_open"):
        return
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:  # gone already (the mapping fails next), or a kernel without pidfds: _sweep remains
        return
    _watched[pidfd] = pid
    if _wake is None:
        _wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        threading.Thread(target=_watcher, args=(_wake[0],), name="streampack-shm-watch", daemon=True).start()
    try:
        os.write(_wake[1], b"w")
    except BlockingIOError:  # enough wake-ups pending
        pass


def _watcher(wake: int) -> None:
    while True:
        with _lock:
            poller = select.poll()
            poller.register(wake, select.POLLIN)
            for pidfd in _watched:
                poller.register(pidfd, select.POLLIN)
        for fd, _ in poller.poll():
            if fd == wake:
                _drain(wake)
                continue
            with _lock:
                pid = _watched.pop(fd, None)
                if pid is not None:
                    _close(fd)
                    _forget(pid)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _new_lock_in_child() -> None:
    """The watcher thread may hold the lock at a fork; the child has no such thread to release it."""
    global _lock
    _lock = threading.RLock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def _own() -> None:
    """A forked child starts with no cached entries of its own (its copies of the parent's stay
    valid for what it inherited; they are simply not reused) and no watcher thread."""
    global _owner, _wake
    if _owner != os.getpid():
        _owner = os.getpid()
        _maps.clear()
        _pipes.clear()
        for pidfd in _watched:
            _close(pidfd)
        _watched.clear()
        if _wake is not None:
            _close(_wake[0])
            _close(_wake[1])
            _wake = None


def _sweep() -> None:
    for pid, fd, want in list(_maps):
        if not _names(pid, fd, want):
            _maps.pop((pid, fd, want), None)
    for pid, fd, want in list(_pipes):
        if not _names(pid, fd, want):
            _close(_pipes.pop((pid, fd, want), None))
    while len(_maps) >= MAX_MAPPED:
        _maps.pop(next(iter(_maps)))


def _forget(pid: int) -> None:
    for key in [k for k in _maps if k[0] == pid]:
        _maps.pop(key, None)
    for key in [k for k in _pipes if k[0] == pid]:
        _close(_pipes.pop(key, None))


def _names(pid: int, fd: int, want: tuple[int, int]) -> bool:
    try:
        st = os.stat(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == want


def _close(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
