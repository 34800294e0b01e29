"""Agreement between ranks through the job's c10d store: on the settings, once, and on per-epoch batch counts.

:func:`agree_settings` checks once, when the dataset is built, that every rank has the same settings (else the ranks
read the wrong data in lockstep) and raises the same ValueError on every rank. :func:`agree_counts` tells each reader
of a finite epoch the largest rank total and its rank's per-worker counts. Readers are often DataLoader workers, which
cannot join collectives, so they are clients of the store torch.distributed was initialised with (TCPStore, FileStore,
or an in-process store for thread-simulated ranks), kept per process across rounds. Waiting is bounded by
``timeout_s`` (the TimeoutError names the readers that did not arrive); an inconsistent round writes ``"!message"``
into ``done`` so every reader raises the same ValueError at once.

Cost (R ranks, W workers, G = R W readers). Settings, once per dataset and rank: 5 store requests and 2 S bytes (S ~0.75
KB of json); store ~5 R requests, R + 3 keys. Per count round and reader: 5 requests (compare_set, 2 add, wait,
multi_get) of O(1) bytes; the rank aggregator +3 requests of O(W) bytes, the global one +2 of O(R); store 5 G + 3 R + 2
requests and G + 2 R + 3 keys (~0.6 MB at 8,192 readers, never deleted) and one connection per waiting reader. The
loopback TCPStore serves ~8-9k requests/s here (``benchmarks/bench_agree.py``), so a round at 1,024 ranks x 8 workers
takes >= 5 s once per epoch, settled in the background after the first batch (``plan.quota``).
"""

from __future__ import annotations

import json
import numbers
import os
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from streampack.logs import get_logger
from streampack.plan.topology import validate_topology

_log = get_logger(__name__)
_ERROR = "!"  # a ``done`` value starting with this is a message every reader raises


@dataclass(frozen=True, slots=True, kw_only=True)
class Agreement:
    """Where the readers of one run agree: a c10d store by address (exactly one of ``host``/``port``,
    ``path``, ``local``) and the run's key prefix. Picklable: each process connects lazily."""

    prefix: str
    """Namespace of this run's keys: unique per run, identical on every rank."""
    dp_size: int
    """Data-parallel ranks taking part in every round."""
    host: str = ""
    """Host of the TCPStore server (the job's rendezvous store)."""
    port: int = 0
    path: str = ""
    """The FileStore's file."""
    local: str = ""
    """Name of a store registered in this process (:meth:`in_process`)."""
    timeout_s: float = 1800.0
    """Longest a reader waits for the others in one round (``TopologyOptions.agree_timeout_s``;
    :meth:`from_dist` defaults it to the process group's timeout)."""
    connect_timeout_s: float = 60.0
    """Longest a process tries to reach the store (once per process, not per round): reaching a
    live store is not waiting for the others, so a short ``timeout_s`` does not bound it."""

    def __post_init__(self) -> None:
        given = [k for k, v in (("host/port", self.host or self.port), ("path", self.path), ("local", self.local)) if v]
        if len(given) != 1:
            raise ValueError(f"need exactly one store address (host and port, path, or local), got {given or 'none'}")
        if given == ["host/port"] and (not self.host or not 0 < self.port < 2**16):
            raise ValueError(f"need a TCPStore address, got host={self.host!r} port={self.port!r}")
        if not self.prefix:
            raise ValueError(f"prefix={self.prefix!r} must name the run (unique per run, same on every rank)")
        if self.dp_size < 1 or not self.timeout_s > 0 or not self.connect_timeout_s > 0:
            raise ValueError(f"need dp_size >= 1, timeout_s > 0 and connect_timeout_s > 0, got {self.dp_size=} "
                             f"{self.timeout_s=} {self.connect_timeout_s=}")

    @property
    def where(self) -> str:
        """The store, for messages."""
        if self.path:
            return f"the FileStore at {self.path!r}"
        if self.local:
            return f"the in-process store {self.local!r}"
        return f"the TCPStore at {self.host}:{self.port}"

    @classmethod
    def in_process(cls, store: Any, *, prefix: str, dp_size: int, timeout_s: float = 1800.0) -> Agreement:
        """An agreement through any c10d ``store`` of this process, for readers that are its threads."""
        name = f"{os.getpid()}/{id(store)}"
        _LOCAL[name] = store
        return cls(local=name, prefix=prefix, dp_size=dp_size, timeout_s=timeout_s)

    @classmethod
    def of_store(cls, store: Any, *, prefix: str, dp_size: int, timeout_s: float | None = None) -> Agreement:
        """The agreement through ``store``: a TCPStore or FileStore by address, any other for this process
        only; ``timeout_s`` None: the store's own (the process group's)."""
        from torch.distributed import FileStore, TCPStore

        if timeout_s is None:
            timeout_s = store.timeout.total_seconds()
        store = _unwrap(store)
        if isinstance(store, TCPStore):
            return cls(host=store.host, port=store.port, prefix=prefix, dp_size=dp_size, timeout_s=timeout_s)
        if isinstance(store, FileStore):
            return cls(path=store.path, prefix=prefix, dp_size=dp_size, timeout_s=timeout_s)
        return cls.in_process(store, prefix=prefix, dp_size=dp_size, timeout_s=timeout_s)

    @classmethod
    def from_dist(cls, dp_group: Any, dp_rank: int, dp_size: int, *, timeout_s: float | None = None,
                  settings: Mapping[str, Any] | None = None) -> Agreement | None:
        """The agreement for this run (None without torch.distributed or with one rank); collective over
        ``dp_group``. Rank 0 broadcasts a random key prefix, so keys an earlier run or another dataset
        left in the store are never read as this one's; ``settings`` given: :func:`agree_settings`."""
        import torch.distributed as dist

        if dp_size <= 1 or not (dist.is_available() and dist.is_initialized()):
            return None
        members = dist.get_world_size(group=dp_group)
        if dp_size > members:  # the others would draw their own nonce: every round would time out
            raise ValueError(f"dp_size={dp_size} but the process group the ranks agree over has {members} "
                             f"rank(s): pass dp_group= a group holding every data-parallel rank (or the world)")
        nonce = [uuid.uuid4().hex if dist.get_rank(group=dp_group) == 0 else None]
        dist.broadcast_object_list(nonce, group=dp_group, group_src=0)
        agreement = cls.of_store(dist.distributed_c10d._get_default_store(), prefix=f"streampack/agree/{nonce[0]}",
                                 dp_size=dp_size, timeout_s=timeout_s)
        if settings is not None:
            agree_settings(agreement, dp_rank=dp_rank, settings=settings)
        return agreement


@dataclass(frozen=True, slots=True, kw_only=True)
class RankCounts:
    """What one round agreed, as seen by one reader."""

    target: int
    """The largest rank total (sum of its workers' counts): every rank yields this many batches."""
    workers: tuple[int, ...]
    """This reader's rank's per-worker counts, by worker_id."""


def agree_counts(agreement: Agreement, *, key: str, dp_rank: int, worker_id: int, num_workers: int,
                 count: int) -> RankCounts:
    """Report this reader's ``count`` for round ``key`` (unique in the run) and wait for every reader's.
    The first report of a (dp_rank, worker_id) wins; a model-parallel peer or a resumed epoch asking
    again must report the same count (else ValueError)."""
    validate_topology(dp_rank, agreement.dp_size, worker_id, num_workers)
    if not isinstance(count, numbers.Integral) or isinstance(count, bool) or count < 0:
        raise ValueError(f"count={count!r} must be an int >= 0")
    count = int(count)  # numpy ints are welcome; the store's values are plain decimal
    if not key or not isinstance(key, str):
        raise ValueError(f"key={key!r} must be a non-empty str naming the round")
    with _connection(agreement) as store:
        deadline = time.monotonic() + agreement.timeout_s  # from a connection: reaching the store is apart
        base = f"{agreement.prefix}/{key}"
        done = f"{base}/done"
        mine = f"{count} {num_workers} {uuid.uuid4().hex}"
        first = store.compare_set(f"{base}/c/{dp_rank}/{worker_id}", "", mine).decode()
        if first != mine:
            theirs = first.split(" ")
            if theirs[:2] != mine.split(" ")[:2]:
                _fail(store, done, f"round {key!r}: dp_rank={dp_rank} worker_id={worker_id} reported count={count} "
                      f"num_workers={num_workers}, but a peer with the same dp_rank and worker_id (a model-parallel "
                      f"rank) reported count={theirs[0]} num_workers={theirs[1]}: they must read the same data")
        else:
            store.add(f"{base}/a", 1)
            if store.add(f"{base}/n/{dp_rank}", 1) == num_workers:
                _aggregate_rank(store, base, key, dp_rank, num_workers)
                if store.add(f"{base}/N", 1) == agreement.dp_size:
                    _aggregate_global(store, base, key, agreement.dp_size)
        if not _wait(store, done, deadline):
            raise _timeout(store, agreement, key, dp_rank, worker_id, num_workers)
        value, rank = (v.decode() for v in store.multi_get([done, f"{base}/t/{dp_rank}"]))
    if value.startswith(_ERROR):
        raise ValueError(value[len(_ERROR):])
    return RankCounts(target=int(value), workers=tuple(int(c) for c in rank.split(" ")[1].split(",")))


def agree_settings(agreement: Agreement, *, dp_rank: int, settings: Mapping[str, Any]) -> None:
    """Check that every rank has the same json-able ``settings``; every rank calls it once, in its main
    process. A difference is the same ValueError on every rank, raised only after all have read it
    (a second barrier), so the store's host failing cannot turn it into a lost connection."""
    text = json.dumps({"rank": int(dp_rank), "settings": dict(settings)}, sort_keys=True, default=str)
    base = f"{agreement.prefix}/settings"
    with _connection(agreement) as store:
        deadline = time.monotonic() + agreement.timeout_s
        first = json.loads(store.compare_set(f"{base}/first", "", text).decode())
        diff = _differences(dict(settings), first["settings"])
        if diff:
            store.compare_set(f"{base}/done", "", _ERROR + (
                f"the ranks were built with different settings, so they would read the wrong data (some samples "
                f"never, others twice): dp_rank={first['rank']} has {_values(diff, 1)}, dp_rank={dp_rank} has "
                f"{_values(diff, 0)}; build every rank's dataset with the same settings"))
        first_of_rank = store.add(f"{base}/at/{dp_rank}", 1) == 1  # model-parallel peers share a dp_rank
        if first_of_rank and store.add(f"{base}/n", 1) == agreement.dp_size:
            store.compare_set(f"{base}/done", "", "ok")
        if not _wait(store, f"{base}/done", deadline):
            arrived = [r for r in range(agreement.dp_size) if store.check([f"{base}/at/{r}"])]
            late = [r for r in range(agreement.dp_size) if r not in arrived]
            raise TimeoutError(
                f"{agreement.where} (prefix {agreement.prefix!r}): dp_rank={dp_rank} waited {agreement.timeout_s:g}s "
                f"for every rank to build its dataset; {len(arrived)} of {agreement.dp_size} ranks arrived, not "
                f"dp_rank {', '.join(map(str, late[:16]))}{' ...' if len(late) > 16 else ''}: check that every "
                f"rank builds this PackedDataset (same dp_group) and that none died, or raise "
                f"TopologyOptions(agree_timeout_s=...)")
        outcome = store.get(f"{base}/done").decode()
        if diff and not outcome.startswith(_ERROR):  # a late model-parallel peer: the others had agreed
            raise ValueError(f"dp_rank={dp_rank} (a model-parallel peer) was built with different settings from "
                             f"dp_rank={first['rank']}: {_values(diff, 0)} here, {_values(diff, 1)} there")
        if outcome.startswith(_ERROR):
            if store.add(f"{base}/read", 1) == agreement.dp_size:
                store.set(f"{base}/bye", "")
            _wait(store, f"{base}/bye", deadline)  # a rank that never reads it cannot hold the others past the deadline
            raise ValueError(outcome[len(_ERROR):])


def _differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(name, mine, theirs)`` for every setting that differs (json round trip: tuples as lists)."""
    mine = json.loads(json.dumps(mine, sort_keys=True, default=str))
    return [(k, mine.get(k), theirs.get(k)) for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]


def _values(diff: list[tuple[str, Any, Any]], side: int) -> str:
    """``name=value, ...`` of one side (0: mine, 1: theirs)."""
    return ", ".join(f"{name}={_short(values[side])}" for name, *values in diff)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _wait(store: Any, key: str, deadline: float) -> bool:
    """Wait for ``key`` until ``deadline``: False on a timeout; a lost store (DistNetworkError) is raised."""
    from torch.distributed import DistNetworkError

    try:
        store.wait([key], timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    except DistNetworkError:
        raise
    except RuntimeError:  # DistStoreError from a TCPStore or HashStore, a plain RuntimeError from a FileStore
        return bool(store.check([key]))
    return True


def _aggregate_rank(store: Any, base: str, key: str, dp_rank: int, num_workers: int) -> None:
    records = [v.decode().split(" ") for v in store.multi_get([f"{base}/c/{dp_rank}/{w}" for w in range(num_workers)])]
    told = sorted({int(r[1]) for r in records})
    if told != [num_workers]:
        _fail(store, f"{base}/done", f"round {key!r}: the workers of dp_rank={dp_rank} disagree on num_workers "
              f"({told}): one DataLoader cannot have both")
    counts = [int(r[0]) for r in records]
    store.set(f"{base}/t/{dp_rank}", f"{sum(counts)} {','.join(map(str, counts))}")


def _aggregate_global(store: Any, base: str, key: str, dp_size: int) -> None:
    totals = [v.decode().split(" ") for v in store.multi_get([f"{base}/t/{r}" for r in range(dp_size)])]
    workers = [t[1].count(",") + 1 for t in totals]
    if len(set(workers)) > 1:
        odd = next(r for r, w in enumerate(workers) if w != workers[0])
        _fail(store, f"{base}/done", f"round {key!r}: dp_rank=0 runs num_workers={workers[0]} but "
              f"dp_rank={odd} runs num_workers={workers[odd]}: every rank must run the same number of readers")
    store.compare_set(f"{base}/done", "", str(max(int(t[0]) for t in totals)))


def _fail(store: Any, done: str, message: str) -> None:
    """Publish ``message`` as the round's outcome (unless it already has one) and raise it."""
    store.compare_set(done, "", _ERROR + message)
    raise ValueError(message)


def _timeout(store: Any, agreement: Agreement, key: str, dp_rank: int, worker_id: int,
             num_workers: int) -> TimeoutError:
    base = f"{agreement.prefix}/{key}"
    try:  # add(k, 0) reads a counter without waiting for it; only now, so R + a few requests
        arrived = store.add(f"{base}/a", 0)
        per_rank = [store.add(f"{base}/n/{r}", 0) for r in range(agreement.dp_size)]
        short = [r for r, n in enumerate(per_rank) if n < num_workers]
        missing = []
        for r in short[:_NAMED]:
            gone = [w for w in range(num_workers) if not store.check([f"{base}/c/{r}/{w}"])]
            missing.append(f"dp_rank={r} worker_id={','.join(map(str, gone))}" if len(gone) < num_workers
                           else f"dp_rank={r} (none of its {num_workers} readers)")
        more = f" and {len(short) - _NAMED} more ranks" if len(short) > _NAMED else ""
        seen = (f"{arrived} of {agreement.dp_size * num_workers} readers had arrived "
                f"({agreement.dp_size - len(short)} of {agreement.dp_size} ranks complete); not arrived: "
                f"{'; '.join(missing)}{more}")
    except RuntimeError as e:
        seen = f"{agreement.where} did not answer how many had arrived ({e})"
    return TimeoutError(
        f"round {key!r} (prefix {agreement.prefix!r}): reader dp_rank={dp_rank} worker_id={worker_id} waited "
        f"{agreement.timeout_s:g}s for the others; {seen}. Check that every rank iterates this dataset with the "
        f"same num_workers and the same pass (set_epoch, epochs) and that none died; if ranks legitimately start "
        f"this epoch further apart, raise TopologyOptions(agree_timeout_s=...)")


_NAMED = 4  # ranks named in a timeout's message; the rest are counted
_LOCAL: dict[str, Any] = {}  # Agreement.in_process's stores, by name
_POOL: dict[tuple[int, str], list[Any]] = {}  # idle clients, by (pid, store): one per concurrent round
_POOL_LOCK = threading.Lock()


def _after_fork() -> None:
    """A forked child starts with no clients and a free lock."""
    global _POOL_LOCK
    _POOL_LOCK = threading.Lock()
    _POOL.clear()


os.register_at_fork(after_in_child=_after_fork)


@contextmanager
def _connection(agreement: Agreement) -> Iterator[Any]:
    """A client of the store for one round: an idle one of this process (keyed by pid), else a new one
    (a blocked wait holds its client, so concurrent rounds need one each)."""
    if agreement.local:
        store = _LOCAL.get(agreement.local)
        if store is None or not agreement.local.startswith(f"{os.getpid()}/"):
            raise ValueError(f"{agreement.where} is reachable only in the process that made it (a HashStore?): "
                             f"readers in DataLoader worker processes need a TCPStore or FileStore (initialise "
                             f"torch.distributed with env://, tcp:// or file://)")
        yield store
        return
    slot = (os.getpid(), agreement.where)
    with _POOL_LOCK:
        idle = _POOL.setdefault(slot, [])
        store = idle.pop() if idle else None
    if store is None:
        store = _connect(agreement)
    yield store  # not returned after an error: its state is unknown (a wait may still be pending)
    with _POOL_LOCK:
        _POOL.setdefault(slot, []).append(store)


def _connect(agreement: Agreement) -> Any:
    from torch.distributed import FileStore, TCPStore

    if agreement.path:
        return FileStore(agreement.path, -1)  # -1: never deletes the job's file
    try:
        return TCPStore(agreement.host, agreement.port, None, False, timedelta(seconds=agreement.connect_timeout_s),
                        wait_for_workers=False)
    except RuntimeError as e:
        raise TimeoutError(f"cannot reach {agreement.where} within {agreement.connect_timeout_s:g}s: {e}") from e


def _unwrap(store: Any) -> Any:
    """The store under torch's PrefixStore wrappers (``default_pg`` and group prefixes)."""
    from torch.distributed import PrefixStore

    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return store
