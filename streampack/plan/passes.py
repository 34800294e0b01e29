"""What the copies of one dataset in DataLoader worker processes must agree on.

A DataLoader gives each worker process its own copy of the dataset (forked, or pickled under
``spawn``), and the main process's copy never runs ``__iter__``. So a counter kept on the
dataset object cannot say which pass a worker runs (a second ``iter(loader)`` would repeat the
first pass's order), whether workers have read anything (so the main process's
``state_dict()`` is stale), or whether a loaded state was already used. :class:`PassTracker`
keeps those facts in a small block of shared memory created with the dataset:

- *passes*: a fresh iteration by reader ``w`` starts a new pass if ``w`` already started the
  current one, else joins it. Every worker of one loader iteration starts once, so they all
  agree — with 0, 2 or 8 workers, persistent or not — and the pass number (hence the shuffle)
  does not depend on the worker count.
- *worker iteration*: set once a DataLoader worker process iterates the dataset.
- *load generations*: a loaded state carries a generation drawn here; each reader slot uses a
  generation once, so the next fresh iteration of the loader starts a new pass instead of
  re-applying the checkpoint.

The block lives in a ``spawn``-context ``multiprocessing.Array`` (a fork-context lock cannot
be handed to a spawned worker); pickling the dataset for anything but starting a worker
process (``copy.deepcopy``, ``torch.save``) gives the copy a tracker of its own.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing import context as mp_context
from typing import Any

MAX_READERS = 1024
_PASS, _FLAGS, _GENERATION = 0, 1, 2
_STARTED = 3
_USED = _STARTED + MAX_READERS


class PassTracker:
    """Shared pass counter, worker flag and load generations of one dataset (and its copies)."""

    def __init__(self) -> None:
        self._shared = multiprocessing.get_context("spawn").Array("q", _USED + MAX_READERS, lock=True)

    def set_next_pass(self, passes: int) -> None:
        """The pass the next fresh iteration runs."""
        with self._shared.get_lock():
            self._shared[_PASS] = passes
            self._clear_started()

    def begin(self, reader: int, *, in_worker_process: bool, resume: int | None = None) -> int:
        """Reader ``reader`` starts iterating: the pass it runs (``resume``: a loaded state's)."""
        if not 0 <= reader < MAX_READERS:
            raise ValueError(f"at most {MAX_READERS} DataLoader workers are supported, got worker {reader}")
        a = self._shared
        with a.get_lock():
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
        with self._shared.get_lock():
            self._shared[_GENERATION] += 1
            return int(self._shared[_GENERATION])

    def claim(self, reader: int, generation: int) -> bool:
        """True the first time ``reader`` asks for ``generation`` (a loaded state is used once)."""
        with self._shared.get_lock():
            if self._shared[_USED + reader] >= generation:
                return False
            self._shared[_USED + reader] = generation
            return True

    def _clear_started(self) -> None:
        self._shared[_STARTED:_USED] = [0] * MAX_READERS

    def __reduce__(self) -> Any:
        if mp_context.get_spawning_popen() is None:
            return (PassTracker, ())  # a copy, not a worker process: independent counters
        return (_restore, (self._shared,))


def _restore(shared: Any) -> PassTracker:
    tracker = PassTracker.__new__(PassTracker)
    tracker._shared = shared
    return tracker
