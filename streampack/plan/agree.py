"""Agreement between ranks through the job's c10d store: on the settings, once, and on per-epoch batch counts.

Ranks built with different settings (seed, shuffle, epochs, window, sources, ...) read the wrong
data — some samples never, others twice — while stepping in lockstep, so nothing else notices:
:func:`agree_settings` checks once, when the dataset is built, that every rank has the same
settings (the stream's fingerprint less the rank and the worker count, plus the manifest's sample
counts and sizes), and a difference is the same ValueError on every rank naming each setting and
both values.

In a finite epoch every data-parallel rank must yield the same number of batches, or a
collective hangs. Each reader (DataLoader worker, or the main process) counts only its own
batches; :func:`agree_counts` then tells every reader (a) the largest rank total and (b) its own
rank's per-worker counts. Readers are often DataLoader workers, which cannot join the trainer's
collectives, so they talk to the store torch.distributed was initialised with, as clients: a
TCPStore (torchrun, ``env://``, ``tcp://``), a FileStore (``file://``) or, for ranks that are
threads of one process, any store of that process (a HashStore; :meth:`Agreement.in_process`).

Waiting is bounded by ``Agreement.timeout_s`` (``TopologyOptions.agree_timeout_s``; default the
process group's timeout); the TimeoutError names the readers that did not arrive. Reaching the
store is bounded apart (``connect_timeout_s``) and happens once per process: a process keeps its
clients for later rounds (one per round running at the same time, as a blocked wait holds its
client), so a reader does not reconnect every epoch.

**Cost of the settings agreement** (R ranks; S = the settings' json, ~0.75 KB for a token stream,
more with a mixture, a cost model or media): per rank, once per dataset, in its main process,
5 store requests (compare_set, 2 add, wait, get) and 2 S + O(1) bytes; +1 request for a rank
that finds a difference, +1 for the last to arrive; on a difference +2 requests each (the second
barrier). Per DataLoader worker: 0 (it gets the checked dataset pickled). Store: ~5 R requests,
R + 3 keys, S bytes kept.

Protocol for round ``key`` (keys live under ``{prefix}/{key}/``; R = dp_size, W = num_workers):

1. ``compare_set(c/{r}/{w}, "", "{count} {W} {token}")``: the first reporter of (r, w) wins;
   a model-parallel peer with the same (r, w) reads the winner back, must match (else ValueError
   naming both values) and stops here, so duplicates never count twice.
2. The winner ``add``\\s 1 to ``a`` (readers arrived, for error messages) and to ``n/{r}``; the
   one that brings ``n/{r}`` to W is the rank aggregator: one ``multi_get`` of the W records, sets
   ``t/{r} = "{total} {c0},...,{cW-1}"``, ``add``\\s 1 to ``N``; the one that brings ``N`` to R is
   the global aggregator: one ``multi_get`` of the R totals, ``compare_set(done, "", max)``.
3. Everyone ``wait``\\s for ``done`` (bounded by ``timeout_s``), then one ``multi_get(done, t/{r})``.

A reader that finds the round inconsistent (peers disagree, workers of one rank disagree on W,
ranks run different W) writes ``"!message"`` into ``done`` so every reader raises the same
ValueError at once instead of some of them training on wrong counts or waiting out the timeout.

Cost per round, per reader: 5 store requests (compare_set, 2 add, wait, multi_get) of O(1)
bytes, plus one connection per process (kept across rounds); rank aggregator (1 per rank):
+3 requests, O(W) bytes; global aggregator: +2 requests, O(R) bytes; a model-parallel duplicate:
3 requests. Store, per round: 5 G + 3 R + 2 requests, G + 2 R + 3 keys of < 64 bytes (~0.6 MB
at 8,192 readers; never deleted, a late duplicate may still read them), and one open connection
per waiting reader (the store host needs ``ulimit -n`` > G + R + the job's own).

So a round costs at least (5 G + 3 R) / (store throughput) plus wake-ups: the loopback
TCPStore served ~8-9k requests/s on a shared 2-core box (``benchmarks/bench_agree.py``; its
rounds by G are in ``benchmarks/README.md``, "Agreement rounds"), i.e. >= 5 s for 1,024 ranks x
8 workers, once per epoch. Quotas settle in the background after each reader's first batch
(``plan.quota``), so a round delays no batch unless it outlasts the reader's epoch of data.

Against the alternatives: ``sync_batches`` costs one all-reduce per step (0.35 ms gloo, 2
local processes; more at 1,024 ranks), i.e. 3.5-35 s per epoch of 10^4-10^5 steps, and needs the
training loop's cooperation; every reader simulating every reader costs O(samples of the data
set) CPU per reader per epoch (1,100+ CPU-s at 10^9 samples and 8,192 readers). This costs O(1)
requests per reader per epoch, paid at the epoch boundary, and one O(G)-request burst on the
central store, which is the scaling limit: at 10^5 readers, >= 1 min per round on that box.
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
    """Where and under which namespace the readers of one run agree: a c10d store the job has, by
    address. Picklable: it travels to DataLoader workers (fork or spawn), where each process
    connects lazily and keeps its connections (:func:`_connection`).

    Exactly one address: ``host``/``port`` (a TCPStore: torchrun, ``env://``, ``tcp://``),
    ``path`` (a FileStore: ``file://`` init; every reader must see the same file) or ``local``
    (a store of this process, e.g. a HashStore, registered by :meth:`in_process`: readers that are
    threads of one process, as the in-process simulations are)."""

    prefix: str
    """Namespace of this run's keys: unique per run, identical on every rank."""
    dp_size: int
    """Data-parallel ranks taking part in every round."""
    host: str = ""
    """Host of the TCPStore server (the job's rendezvous store)."""
    port: int = 0
    """Its port."""
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
        """An agreement through ``store`` (any c10d store, e.g. a HashStore) for readers that are
        threads of this process; a reader in another process is refused with a ValueError."""
        name = f"{os.getpid()}/{id(store)}"
        _LOCAL[name] = store
        return cls(local=name, prefix=prefix, dp_size=dp_size, timeout_s=timeout_s)

    @classmethod
    def of_store(cls, store: Any, *, prefix: str, dp_size: int, timeout_s: float | None = None) -> Agreement:
        """The agreement through ``store`` (under torch's PrefixStore wrappers): a TCPStore or a
        FileStore by address, any other store (a HashStore) for this process only. ``timeout_s``
        None: the store's own timeout (``init_process_group`` sets it to the process group's)."""
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
        """The agreement for this run, or None without torch.distributed or with one rank.

        Collective over ``dp_group`` (None: the world group): call it on every rank of it, in
        the main process, when the dataset is built. The group's rank 0 draws a random nonce and
        broadcasts it, so keys left in the store by an earlier run (torchrun's agent keeps its
        store across restarts) or by another dataset of this run are never read as this one's.
        Any store torch.distributed was initialised with serves: a TCPStore, a FileStore
        (``file://``) or, for ranks that are threads of one process, any other (a HashStore).
        ``timeout_s`` None: the store's timeout, which ``init_process_group`` sets to the
        process group's. ``settings`` given: :func:`agree_settings` checks them once, here.
        """
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
    """Report this reader's ``count`` for round ``key`` and wait for every reader's. Every reader
    of every rank calls it once per round; model-parallel peers may repeat a (dp_rank,
    worker_id) with the same count. Raises ValueError on disagreement, TimeoutError after
    ``agreement.timeout_s`` naming the round, this reader and how many readers had arrived.
    ``key`` must name the round uniquely within the run: asking again (a resumed epoch) gets the
    first answer if the count is the same and a ValueError if not."""
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
    """Check once, when the dataset is built, that every rank has the same ``settings`` (the
    stream's fingerprint less what differs by rank: plain, json-able values). Every rank of
    ``agreement`` calls it once, in its main process; it returns when all have and agree, and on
    a difference raises the same ValueError on every rank, naming the settings and both values —
    only after every rank has read the outcome, so the store's host failing cannot turn the
    others' error into a lost connection. TimeoutError after ``agreement.timeout_s`` naming the
    ranks that did not arrive.

    Protocol (keys under ``{prefix}/settings/``): the first rank's ``compare_set(first, "",
    {rank, settings})`` wins and every rank compares its own to the winner's; a rank that
    differs ``compare_set``\\s ``done`` to ``"!message"``; each rank ``add``\\s 1 to ``at/{r}``
    and (the first of its model-parallel peers) to ``n``; the one bringing ``n`` to R sets
    ``done`` (unless set); all wait for ``done`` and get it. On an error, a second barrier
    (``add`` to ``read``, the last sets ``bye``, all wait for it) keeps every rank alive until all
    have read it."""
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
    """Wait for ``key`` until ``deadline``: False on a timeout (the store cancels the wait, so the
    same connection can still ask who arrived); a lost store (DistNetworkError) is raised as is."""
    from torch.distributed import DistNetworkError

    try:
        store.wait([key], timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    except DistNetworkError:
        raise
    except RuntimeError:  # DistStoreError from a TCPStore or HashStore, a plain RuntimeError from a FileStore
        if store.check([key]):
            return True
        return False
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
    """A forked child (a DataLoader worker) starts with no clients and a free lock, whatever a
    parent's thread held at the fork."""
    global _POOL_LOCK
    _POOL_LOCK = threading.Lock()
    _POOL.clear()


os.register_at_fork(after_in_child=_after_fork)


@contextmanager
def _connection(agreement: Agreement) -> Iterator[Any]:
    """A client of ``agreement``'s store for one round: an idle one of this process, else a new
    one (a blocked wait holds its client, so concurrent rounds need one each); returned to the
    pool afterwards, so a process's readers connect once, not once per epoch. A forked child
    never reuses its parent's socket (the pool is keyed by pid)."""
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
