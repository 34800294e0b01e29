"""The ``[3, T]`` int64 buffers batches are laid out in, reused once every tensor viewing one is gone.

A batch's rows are 24 bytes a token: 768 KiB for 8 x 4096 tokens, above glibc's ``mmap``
threshold. A process that has just started -- every DataLoader worker, each epoch, unless its
workers persist -- grows its heap into a steady state first: freed batch buffers get split by
smaller allocations, each new one lands on fresh pages, and every fresh page is a page fault
(3.5-4.9 µs each on the 2-core VM, zeroing included). Measured 2026-11-27 with
``benchmarks/profile_worker_faults.py`` (tar, 4M tokens, 8 x 4096, 2 workers): a worker's layout
took 3,000-3,600 faults for its 62 batches (~56 a batch, ~0.2 ms) and ran 0.8 ms a batch against
0.36 ms in a warm in-process epoch, whose layout took 6-582 faults for 123 batches. Setting
glibc's thresholds (``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``) did not remove them.

So buffers are kept here by size: :func:`rows` hands out a free one (already faulted in) or a
new one, and a buffer comes back when the numpy view the tensors were made from is freed, i.e.
when the last tensor viewing its storage is (``torch.from_numpy`` keeps the view alive, a
``weakref.finalize`` on the view returns the buffer). A batch the caller still holds -- in a
list, across the worker queue, pinned, as a view -- keeps its buffer out of the pool, so a
buffer is never handed out twice. Free buffers of one size are kept up to ``KEEP_BYTES`` (at
least two): a worker's queue holds up to ``prefetch_factor`` batches whose buffers come back
together once the queue's feeder thread has copied them out.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import torch

KEEP_BYTES = 32 << 20
"""Bytes of free buffers kept per size (at least two buffers): 42 of 8 x 4096 tokens."""
_FREE: dict[int, list[np.ndarray]] = {}
_LOCK = threading.Lock()  # buffers come back from whichever thread frees the last view


def rows(total: int) -> torch.Tensor:
    """An int64 ``[3, total]`` tensor with unspecified contents, from the pool when it has one."""
    with _LOCK:
        free = _FREE.get(total)
        base = free.pop() if free else None
    if base is None:
        base = np.empty((3, total), dtype=np.int64)
    view = base.view()
    weakref.finalize(view, _give_back, base).atexit = False  # nothing to give back at exit
    return torch.from_numpy(view)


def _give_back(base: np.ndarray) -> None:
    with _LOCK:
        free = _FREE.setdefault(base.shape[1], [])
        if len(free) < max(2, KEEP_BYTES // base.nbytes):
            free.append(base)


def free_count(total: int) -> int:
    """Free buffers of ``[3, total]`` held now (for tests)."""
    with _LOCK:
        return len(_FREE.get(total, ()))


__all__ = ["KEEP_BYTES", "free_count", "rows"]
