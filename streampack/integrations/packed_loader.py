"""``PackedLoader``: a ``StatefulDataLoader`` whose workers send their batches through pipes of their own.

torch's worker loop moves every item through an index queue, a result queue and a feeder thread in each process; on
a busy worker that costs ~0.41 ms of CPU an item before anything is carried, and a 32 k-token batch 0.9-1.1 ms in
all, 1.7-2.1× an in-process batch. Here each worker builds its batches on its main thread and writes each one (in
the same transfer form, :mod:`streampack.layout.transfer`) straight to a pipe the training process reads:
0.39-0.42 ms a batch at 32-128 k tokens where torch's queues take 0.93-1.42 (``benchmarks/bench_compact.py
--sending``). The training process does not ask for batches; it hands a worker one credit for each batch it takes,
so a worker runs at most ``prefetch_factor`` batches ahead.

The batches come in the order ``StatefulDataLoader`` gives them (worker 0, 1, ..., 0, ...; a worker whose data ended
drops out of the turn). A worker keeps its dataset's state after each of its last batches (every
``snapshot_every_n_steps``-th) and sends one only when :meth:`PackedLoader.state_dict` asks: a state sent with every
batch cost ~0.45 ms a batch in both processes, about an in-process 32 k-token batch (``benchmarks/README.md``). A
loader state holds, per worker, its dataset's state as of that snapshot and the batches it delivered since; a
restored worker loads the one and makes and drops the others. With ``num_workers=0`` this is ``StatefulDataLoader``
itself.
"""

from __future__ import annotations

import multiprocessing
import random
import signal
import threading
import time
import traceback
import warnings
import weakref
from collections import deque
from multiprocessing.reduction import ForkingPickler
from typing import Any, NamedTuple

import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from streampack.integrations.loader import SET_VITAL_WARNING
from streampack.layout import transfer
from streampack.layout.parent_death import die_with_parent
from streampack.plan.state import LOADER_KIND, LOADER_VERSION, check_loader_state

EXIT_S = 0.5
"""How long a closing loader waits for its workers to exit on their own before it terminates them."""
JOIN_S = 5.0
"""How long it then waits for a terminated worker before it kills it."""
_POLL_S = 1.0
"""How often a waiting training process checks that the worker it waits for is alive."""
_OURS: set[Any] = set()
"""The training process's ends of every live pool's pipes: a forked worker closes its copies of them all (a pipe's
reader sees the other end close only once every process holding a copy has closed it)."""
_CREDIT = b"+"
_AGAIN = b"again"
"""To a persistent worker whose iteration ended: iterate its dataset again."""
_ASK = b"?"
"""``_ASK`` + a count: send your :class:`StateAt` that count (the training process has taken that many batches)."""
HISTORY = 8
"""How many batches back :meth:`PackedLoader.state_dict_before` reaches (the Lightning integration asks for the state
one batch back: Lightning fetches a batch ahead of the one it trains)."""


class Started(NamedTuple):
    """A worker's dataset's state once its iteration is built (and, on a resume, the batches since the state it
    loaded are made again): where it starts. None: the dataset keeps no state."""

    state: dict[str, Any] | None


class Delivered(NamedTuple):
    """A worker's batch."""

    batch: Any


class StateAt(NamedTuple):
    """A worker's dataset's state after its ``at``-th batch of this iteration, the latest it holds at or before the
    count the training process asked about (None: the dataset keeps no state)."""

    at: int
    state: dict[str, Any] | None


class Ended(NamedTuple):
    """A worker's data ran out: its latest state, as :class:`StateAt` (the pool may close before anyone asks)."""

    last: StateAt


class Failed(NamedTuple):
    """A worker raised: the exception when it pickles (else None) and its traceback as text."""

    error: BaseException | None
    trace: str


class WorkerStart(NamedTuple):
    """What a worker process starts from."""

    worker_id: int
    num_workers: int
    seed: int
    prefetch: int
    snapshot_every: int
    state: dict[str, Any] | None
    """Its dataset's state to load (None: from the start)."""
    skip: int
    """Batches it delivered after ``state`` was taken: made again and dropped."""


class PackedLoader(StatefulDataLoader):
    """``StatefulDataLoader(dataset, batch_size=None, ...)`` for an iterable dataset with ``state_dict`` /
    ``load_state_dict`` (a :class:`~streampack.PackedDataset`); with workers, they send their batches through pipes of
    their own (module docstring). Takes ``StatefulDataLoader``'s arguments; ``pin_memory`` pins in the training
    process's thread, and a loader iterated again before its workers' data ended (or after a ``load_state_dict``)
    starts new workers even with ``persistent_workers``."""

    def __init__(self, dataset: Any, batch_size: int | None = None, **kwargs: Any) -> None:
        if batch_size is not None:
            raise ValueError(f"PackedLoader yields the dataset's own batches: batch_size must be None, got {batch_size}")
        if not isinstance(dataset, torch.utils.data.IterableDataset):
            raise TypeError(f"PackedLoader needs an IterableDataset (a PackedDataset), got {type(dataset).__name__}")
        # the first moment the worker count is known: refused here, not in each worker behind its traceback
        topology = getattr(getattr(dataset, "config", None), "topology", None)  # a PackedDataset's, or none
        per_rank = getattr(topology, "batches_per_epoch", None)
        workers = kwargs.get("num_workers") or 0
        if per_rank is not None and workers and per_rank % workers:
            raise ValueError(f"batches_per_epoch={per_rank} must be a multiple of num_workers={workers} "
                             f"(each DataLoader worker yields an equal share of the rank's batches)")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=SET_VITAL_WARNING, category=UserWarning)
            super().__init__(dataset, batch_size=None, **kwargs)
        self._pool: _Pool | None = None
        self._resume: dict[str, Any] | None = None

    def __iter__(self) -> Any:
        if self.num_workers == 0:
            return super().__iter__()
        if self._pool is not None and self.persistent_workers and self._pool.finished() and self._resume is None:
            self._pool.again()  # the same workers iterate their datasets again, as StatefulDataLoader's do
            return self._pool
        self.close()
        resume, self._resume = self._resume, None
        ended = resume is not None and all(w["ended"] for w in resume["workers"])
        if ended:  # saved after the iteration's last batch: the workers restore it, then iterate again
            resume = {**resume, "turn": 0, "workers": [{**w, "ended": False} for w in resume["workers"]]}
        self._pool = _Pool(self, resume, then_again=ended)
        return self._pool

    def close(self) -> None:
        """End the workers now (they end by themselves with the data, or when the loader is collected)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def state_dict(self) -> dict[str, Any]:
        if self.num_workers == 0:
            return super().state_dict()
        return self.state_dict_before(0)

    def state_dict_before(self, batches: int) -> dict[str, Any]:
        """The state as of ``batches`` batches before the last one this iteration gave (at most :data:`HISTORY`;
        0: :meth:`state_dict`), for a trainer that trains behind what it fetched; needs workers (in-process the
        dataset's state is its current one)."""
        if self.num_workers == 0:
            raise ValueError("state_dict_before needs workers: without them take state_dict() after each batch")
        if self._pool is None:  # before the first iteration: where the next one would start
            if batches:
                raise ValueError(f"no batch was taken: no state {batches} batches back")
            return self._resume if self._resume is not None else _Pool.fresh_state(self.num_workers)
        return self._pool.state_dict(batches)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.num_workers == 0:
            super().load_state_dict(state_dict)
            return
        check_state(state_dict, self.num_workers)
        self.close()
        self._resume = state_dict


def check_state(state: dict[str, Any], num_workers: int) -> None:
    """Refuse a state that is not a :class:`PackedLoader` state of ``num_workers`` workers."""
    if state.get("kind") != LOADER_KIND:
        raise ValueError(f"not a PackedLoader state with workers (kind={state.get('kind')!r}): a StatefulDataLoader "
                         f"state loads into a StatefulDataLoader")
    if state.get("version") != LOADER_VERSION:
        raise ValueError(f"PackedLoader state version {state.get('version')!r}; this streampack reads {LOADER_VERSION}")
    check_loader_state(state, num_workers)


class _Pool:
    """One iteration's worker processes, read in turn."""

    def __init__(self, loader: PackedLoader, resume: dict[str, Any] | None, then_again: bool = False) -> None:
        n = loader.num_workers
        # a state saved after the iteration's last batch: restored, the datasets have nothing left; their next
        # iteration is the next pass of their epochs (each dataset counts its passes), as with StatefulDataLoader
        self.then_again = then_again
        state = resume if resume is not None else self.fresh_state(n)
        self.turn: int = state["turn"]
        self.workers: list[dict[str, Any]] = [dict(w) for w in state["workers"]]
        self.pin = loader.pin_memory and torch.cuda.is_available()
        self.persistent = loader.persistent_workers
        self.timeout = loader.timeout
        context = loader.multiprocessing_context or multiprocessing.get_context()
        if isinstance(context, str):
            context = multiprocessing.get_context(context)
        base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item())
        every = loader.snapshot_every_n_steps
        self.conns: list[Any] = [None] * n
        self.asks: list[Any] = [None] * n
        """Per worker, the write end of the pipe its answering thread reads questions about its states from."""
        self.procs: list[Any] = [None] * n
        self.taken = [0] * n
        """Batches taken from each worker this iteration (the count a state is asked about)."""
        self.waiting: list[deque[Any]] = [deque() for _ in range(n)]
        """Messages read while waiting for a worker's answer about its state, taken before the pipe's next."""
        self.history: deque[tuple[int, int]] = deque(maxlen=HISTORY)
        """``(worker, turn before)`` of the last batches taken, newest last (:meth:`state_dict` of an earlier batch)."""
        self.reading = threading.RLock()
        """Held while the pipes are read: a checkpoint thread's ``state_dict()`` waits for the loop's ``next()``."""
        # a pool dropped unclosed (a loop left with break, a collected iterator, a failed start) still ends its
        # workers: the finalizer holds the lists, filled in below, not the pool
        self._finalizer = weakref.finalize(self, _stop, self.conns, self.asks, self.procs)
        for i, w in enumerate(self.workers):
            if w["ended"]:
                continue
            here, there = context.Pipe()
            asks_there, asks_here = context.Pipe(duplex=False)
            start = WorkerStart(worker_id=i, num_workers=n, seed=base_seed + i, prefetch=loader.prefetch_factor or 2,
                                snapshot_every=every, state=w["dataset_state"], skip=w["since"])
            self.conns[i], self.asks[i] = here, asks_here
            _OURS.update((here, asks_here))
            proc = context.Process(target=_worker_main, args=(loader.dataset, loader.worker_init_fn,
                                                              loader.collate_fn, start, there, asks_there),
                                   daemon=True)
            proc.start()
            self.procs[i] = proc
            there.close()
            asks_there.close()
        # as StatefulDataLoader, the iteration begins with every worker's state: a state saved before a worker's
        # first batch names where that worker starts
        for i, conn in enumerate(self.conns):
            if conn is not None:
                self._record(i, self._receive(i))

    def finished(self) -> bool:
        """Every worker's data ended and every worker is still there to iterate again."""
        return self._finalizer.alive and all(w["ended"] for w in self.workers) and None not in self.conns

    def again(self) -> None:
        """Every worker iterates its dataset again (persistent workers)."""
        self.turn = 0
        self.history.clear()
        for i, conn in enumerate(self.conns):
            self.workers[i] = _fresh_worker()
            conn.send_bytes(_AGAIN)
        for i in range(len(self.conns)):
            self._record(i, self._receive(i))

    @staticmethod
    def fresh_state(num_workers: int) -> dict[str, Any]:
        return _loader_state(0, [_fresh_worker() for _ in range(num_workers)])

    def __iter__(self) -> _Pool:
        return self

    def __next__(self) -> Any:
        with self.reading:
            return self._next()

    def _next(self) -> Any:
        if not self._finalizer.alive and not all(w["ended"] for w in self.workers):
            raise RuntimeError("this PackedLoader iterator's workers were ended: its loader started another iteration, "
                               "or close() or load_state_dict() was called; iterate the loader again")
        before = self.turn
        while not all(w["ended"] for w in self.workers):
            i = self.turn
            self.turn = (i + 1) % len(self.workers)
            if self.workers[i]["ended"]:
                continue
            got = self.waiting[i].popleft() if self.waiting[i] else self._receive(i)
            self._record(i, got)
            if isinstance(got, Ended):
                continue
            self.history.append((i, before))
            self.conns[i].send_bytes(_CREDIT)
            return got.batch.pin_memory() if self.pin else got.batch
        if self.then_again:
            self.then_again = False
            self.again()
            return self._next()
        if not self.persistent:
            self.close()
        raise StopIteration

    def _record(self, i: int, got: Any) -> None:
        """What worker ``i`` sent, into its record; a failure raised here."""
        w = self.workers[i]
        if isinstance(got, Failed):
            self.close()
            if got.error is not None:
                got.error.add_note(f"in PackedLoader worker {i}; its traceback:\n{got.trace}")
                raise got.error
            raise RuntimeError(f"PackedLoader worker {i} raised an exception that does not pickle:\n{got.trace}")
        if isinstance(got, Delivered):  # one more to replay from the state the record holds
            w["since"] += 1
            self.taken[i] += 1
        elif isinstance(got, Started):
            w["dataset_state"], w["since"], self.taken[i] = got.state, 0, 0
        elif isinstance(got, Ended):
            w["ended"] = True
            self._hold(i, got.last)

    def _hold(self, i: int, got: StateAt) -> None:
        """Worker ``i``'s state after its ``got.at``-th batch, into its record (unless the record's is newer)."""
        w = self.workers[i]
        if got.state is not None and self.taken[i] - got.at < w["since"]:
            w["dataset_state"], w["since"] = got.state, self.taken[i] - got.at

    def _receive(self, i: int) -> Any:
        conn, proc = self.conns[i], self.procs[i]
        waited = 0.0
        while True:
            try:
                if conn.poll(_POLL_S):
                    return ForkingPickler.loads(conn.recv_bytes())
            except (EOFError, ConnectionError):  # its end closed with nothing more sent, or reset: it exited
                proc.join(JOIN_S)
                self._died(i)
            waited += _POLL_S
            if not proc.is_alive():
                self._died(i)
            if self.timeout and waited >= self.timeout:
                self.close()
                raise RuntimeError(f"PackedLoader timed out after {self.timeout} s waiting for worker {i}")

    def _died(self, i: int) -> None:
        proc = self.procs[i]
        code = proc.exitcode
        self.close()
        how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        raise RuntimeError(f"PackedLoader worker {i} (pid {proc.pid}) exited unexpectedly with {how} (killed, e.g. "
                           f"by the out-of-memory killer, or it crashed) before its data ended")

    def state_dict(self, back: int = 0) -> dict[str, Any]:
        """The loader's state after the batch ``back`` batches before the last one taken (0: the last). Each live
        worker is asked for its state at that point (its answering thread replies while its main thread works); a
        closed pool's records hold the last states they had, with the batches since to replay."""
        with self.reading:
            return self._state_dict(back)

    def _state_dict(self, back: int) -> dict[str, Any]:
        if back > len(self.history):
            raise ValueError(f"a PackedLoader keeps the turns of its last {len(self.history)} batches of this "
                             f"iteration (at most {HISTORY}): no state {back} batches back")
        turn, counts = self.turn, list(self.taken)
        for i, before in reversed(list(self.history)[len(self.history) - back:]):
            counts[i] -= 1
            turn = before
        asked = [i for i, conn in enumerate(self.asks) if conn is not None and self._finalizer.alive]
        for i in asked:
            self.asks[i].send_bytes(_ASK + str(counts[i]).encode())
        records = []
        for i, w in enumerate(self.workers):
            state, at = w["dataset_state"], self.taken[i] - w["since"]  # the record: the state after batch `at`
            if i in asked:
                got = self._answer(i)
                self._hold(i, got)
                if got.state is not None and (at > counts[i] or got.at > at):
                    state, at = got.state, got.at
            if at > counts[i]:
                raise ValueError(f"PackedLoader worker {i}'s state {self.taken[i] - counts[i]} batches back is gone "
                                 f"with its process")
            records.append({"dataset_state": state, "since": counts[i] - at,
                            "ended": w["ended"] and counts[i] == self.taken[i]})
        return _loader_state(turn, records)

    def _answer(self, i: int) -> StateAt:
        """Worker ``i``'s :class:`StateAt`, the batches and the end it sent before it kept for :meth:`__next__`."""
        while True:
            got = self._receive(i)
            if isinstance(got, StateAt):
                return got
            if isinstance(got, Failed):
                self._record(i, got)
            self.waiting[i].append(got)

    def close(self) -> None:
        self._finalizer()


def _fresh_worker() -> dict[str, Any]:
    """A worker's record before its first message: no dataset state yet, nothing delivered."""
    return {"dataset_state": None, "since": 0, "ended": False}


def _loader_state(turn: int, workers: list[dict[str, Any]]) -> dict[str, Any]:
    """The loader's state: whose turn is next and a copy of each worker's record."""
    return {"kind": LOADER_KIND, "version": LOADER_VERSION, "num_workers": len(workers), "turn": turn,
            "workers": [dict(w) for w in workers]}


def _stop(conns: list[Any], asks: list[Any], procs: list[Any]) -> None:
    """Close the pipes, then end the workers: one waiting on its pipe exits at once, but one blocked sending, or
    whose pipe end another process forked since holds open, never sees the close; after a short wait it is
    terminated (a worker holds nothing to clean up: its slots go with it, the batches already received stay)."""
    for conn in (*conns, *asks):
        if conn is not None:
            _OURS.discard(conn)
            conn.close()
    deadline = time.monotonic() + EXIT_S
    for proc in procs:
        if proc is not None:
            proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc is not None and proc.is_alive():
            proc.terminate()
            proc.join(JOIN_S)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _worker_main(dataset: Any, init_fn: Any, collate_fn: Any, start: WorkerStart, conn: Any, asks: Any) -> None:
    """A worker: its dataset's batches through ``collate_fn``, each written to ``conn`` once it has a credit."""
    from torch.utils.data._utils import worker as torch_worker

    for ours in list(_OURS):  # forked: the copies of the training process's ends (spawned: none)
        ours.close()
    _OURS.clear()
    die_with_parent()  # first: a worker must not outlive a killed training process
    transfer.settle_worker()
    # what torch's own worker loop sets: PackedDataset (and user code) finds its share through get_worker_info()
    torch.set_num_threads(1)
    random.seed(start.seed)
    torch.manual_seed(start.seed)
    np.random.seed(torch_worker._generate_state(start.seed - start.worker_id, start.worker_id))
    torch_worker._worker_info = torch_worker.WorkerInfo(id=start.worker_id, num_workers=start.num_workers,
                                                        seed=start.seed, dataset=dataset)
    worker = _Worker(dataset, collate_fn, start, conn)
    threading.Thread(target=worker.answer, args=(asks,), name="streampack-states", daemon=True).start()
    try:
        ready = worker.ran(lambda: _set_up(dataset, init_fn, start))
        skip = start.skip
        while ready and worker.ran(lambda: worker.deliver(skip)):
            skip = 0
            # persistent workers: the next iteration begins when the training process says so (the credits of
            # the last batches are still in the pipe)
            while worker.read() != _AGAIN:
                pass
        # the batches sent live in this process's memory until read: wait for the pipe to close
        while True:
            worker.read()
    except _PipeClosed:  # the training process closed the pipe: stop
        pass


class _PipeClosed(Exception):
    """The training process closed this worker's pipe (told apart from the data's own ``OSError``s)."""


def _set_up(dataset: Any, init_fn: Any, start: WorkerStart) -> None:
    if init_fn is not None:
        init_fn(start.worker_id)
    if start.state is not None:
        dataset.load_state_dict(start.state)


class _Worker:
    """A worker's iterations and its pipe. It keeps its dataset's states of its last batches (every
    ``snapshot_every``-th) and sends one only when the training process asks (module docstring), from a thread that
    reads the questions from a pipe of their own: the answer comes while the main thread builds a batch or waits on a
    slow read, so a checkpoint is not held up by the data."""

    def __init__(self, dataset: Any, collate_fn: Any, start: WorkerStart, conn: Any) -> None:
        self.dataset, self.collate_fn, self.start, self.conn = dataset, collate_fn, start, conn
        self.state_of = getattr(dataset, "state_dict", None)  # a dataset without one resumes by replaying
        self.credits = 0
        self.sending = threading.Lock()
        # the training process asks about a count at most prefetch + HISTORY batches behind this worker's: keep the
        # states that can be the latest at or before such a count
        self.held: deque[StateAt] = deque(maxlen=(start.prefetch + HISTORY) // start.snapshot_every + 2)

    def send(self, message: Any) -> None:
        self.send_pickled(ForkingPickler.dumps(message))

    def send_pickled(self, data: Any) -> None:
        try:
            with self.sending:  # the main thread's batches and the answering thread's states share the pipe
                self.conn.send_bytes(data)
        except (EOFError, OSError) as e:
            raise _PipeClosed from e

    def read(self) -> bytes:
        """The next message from the training process (a credit is counted)."""
        try:
            message = self.conn.recv_bytes()
        except (EOFError, OSError) as e:
            raise _PipeClosed from e
        if message == _CREDIT:
            self.credits += 1
        return message

    def answer(self, asks: Any) -> None:
        """The answering thread: each question (``_ASK`` + a count) answered with :meth:`latest`, until the pipe
        closes."""
        try:
            while True:
                message = asks.recv_bytes()
                try:
                    data = ForkingPickler.dumps(self.latest(int(message[len(_ASK):])))
                except Exception as e:  # noqa: BLE001 - the training process waits for an answer: it gets this
                    self.send(_failed(e))
                    continue
                self.send_pickled(data)
        except (EOFError, OSError, _PipeClosed):
            return

    def latest(self, count: int) -> StateAt:
        """The newest held state after at most ``count`` batches."""
        held = list(self.held)  # one C call: the main thread may append meanwhile
        return next((s for s in reversed(held) if s.at <= count), StateAt(0, None))

    def ran(self, step: Any) -> bool:
        """Run ``step``: True when it returned, False when it raised (the failure sent to the training process); a
        closed pipe goes on up."""
        try:
            step()
            return True
        except _PipeClosed:
            raise
        except Exception as e:  # noqa: BLE001 - every failure goes to the training process
            self.send(_failed(e))
            return False

    def deliver(self, skip: int) -> None:
        """One iteration of the dataset: its start, each batch once a credit allows, its end."""
        batches = iter(self.dataset)
        for _ in range(skip):
            next(batches)
        first = StateAt(0, self.state_of() if self.state_of is not None else None)
        self.held.clear()
        self.held.append(first)
        self.send(Started(first.state))
        self.credits, count, every = self.start.prefetch, 0, self.start.snapshot_every
        for batch in batches:
            while not self.credits:
                self.read()
            count += 1
            if self.state_of is not None and count % every == 0:
                self.held.append(StateAt(count, self.state_of()))  # before the batch leaves: it can be asked about
            self.send(Delivered(self.collate_fn(batch)))
            self.credits -= 1
        self.send(Ended(self.latest(count)))


def _failed(e: BaseException) -> Failed:
    """``e`` and the traceback being handled, as the training process receives them (``e`` only if it pickles)."""
    trace = traceback.format_exc()
    try:
        ForkingPickler.dumps(e)
    except Exception:  # noqa: BLE001
        return Failed(None, trace)
    return Failed(e, trace)


__all__ = ["PackedLoader", "check_state"]
