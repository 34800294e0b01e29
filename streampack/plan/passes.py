"""What the copies of one dataset in DataLoader worker processes must agree on.

Each DataLoader worker has its own copy of the dataset and the main process's copy never iterates, so
:class:`PassTracker` keeps in a small block of shared memory created with the dataset: the pass (a fresh iteration by
reader ``w`` starts a new pass if ``w`` already started the current one, so the shuffle does not depend on the worker
count), whether a worker process iterated (the main copy's ``state_dict()`` is stale) and the load generation each
reader slot used. The block is an anonymous shared file (``memfd``) locked with ``fcntl`` record locks, not a
``multiprocessing.Array(lock=True)``, whose named POSIX semaphore makes ``resource_tracker`` print ``leaked semaphore
objects`` on every SIGKILLed preemption; a record lock has no name and dies with its process. A spawned worker gets
the file's descriptor with its start (``multiprocessing.reduction.DupFd``).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import tempfile
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import context as mp_context
from multiprocessing.reduction import DupFd
from typing import Any

import numpy as np

MAX_READERS = 1024
_PASS, _FLAGS, _GENERATION = 0, 1, 2
_STARTED = 3
_USED = _STARTED + MAX_READERS
_SIZE = (_USED + MAX_READERS) * 8


def _shared_file() -> int:
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("streampack-passes", os.MFD_CLOEXEC)
    else:  # no memfd: an unlinked temporary file, in memory where the system has /dev/shm
        handle = tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        fd = os.dup(handle.fileno())
        handle.close()
    os.ftruncate(fd, _SIZE)
    return fd


class PassTracker:
    """Shared pass counter, worker flag and load generations of one dataset (and its copies)."""

    def __init__(self, fd: int | None = None) -> None:
        self._fd = _shared_file() if fd is None else fd
        weakref.finalize(self, os.close, self._fd)  # the mapping outlives the descriptor
        self._shared = np.frombuffer(mmap.mmap(self._fd, _SIZE), dtype=np.int64)
        self._pid = 0
        self._thread_lock = threading.Lock()

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The thread lock, then an exclusive record lock on the whole shared file."""
        if self._pid != os.getpid():  # a forked copy: a thread lock that no other thread can hold
            self._pid, self._thread_lock = os.getpid(), threading.Lock()
        with self._thread_lock:
            fcntl.lockf(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN)

    def set_next_pass(self, passes: int) -> None:
        """The pass the next fresh iteration runs."""
        with self._locked():
            self._shared[_PASS] = passes
            self._clear_started()

    def begin(self, reader: int, *, in_worker_process: bool, resume: int | None = None) -> int:
        """Reader ``reader`` starts iterating: the pass it runs (``resume``: a loaded state's)."""
        if not 0 <= reader < MAX_READERS:
            raise ValueError(f"at most {MAX_READERS} DataLoader workers are supported, got worker {reader}")
        a = self._shared
        with self._locked():
            if in_worker_process:
                a[_FLAGS] |= 1
            if resume is not None:
                if a[_PASS] != resume or a[_STARTED + reader]:
                    a[_PASS] = resume
                    self._clear_started()
            elif a[_STARTED + reader]:
                a[_PASS] += 1
                self._clear_started()
            a[_STARTED + reader] = 1
            return int(a[_PASS])

    def next_pass(self, reader: int) -> int:
        """The pass reader ``reader``'s next fresh iteration would run."""
        return int(self._shared[_PASS]) + (1 if self._shared[_STARTED + reader] else 0)

    def workers_iterated(self) -> bool:
        """Whether a DataLoader worker process has iterated this dataset."""
        return bool(self._shared[_FLAGS] & 1)

    def new_generation(self) -> int:
        with self._locked():
            self._shared[_GENERATION] += 1
            return int(self._shared[_GENERATION])

    def claim(self, reader: int, generation: int) -> bool:
        """True the first time ``reader`` asks for ``generation`` (a loaded state is used once)."""
        with self._locked():
            if self._shared[_USED + reader] >= generation:
                return False
            self._shared[_USED + reader] = generation
            return True

    def _clear_started(self) -> None:
        self._shared[_STARTED:_USED] = 0

    def __reduce__(self) -> Any:
        if mp_context.get_spawning_popen() is None:
            return (PassTracker, ())  # a copy, not a worker process: independent counters
        return (_restore, (DupFd(self._fd),))


def _restore(fd: Any) -> PassTracker:
    return PassTracker(fd.detach())
