"""A finite epoch's batch quota, settled late: when the reader first needs it, not before its first batch.

A reader whose data runs out emits filler batches up to its quota (``epoch_plan.rank_quotas``), which needs its own
batch count (the indexes of its ~N/G shards) and the other readers'. Counting before the first batch cost every reader
⌈N/G⌉ index reads before it could start (310 extra requests at 64 ranks over 20,000 shards,
``benchmarks/bench_scale.py``), so counting and agreeing run in a background thread started after the reader's first
batch (at once for a reader with no data); waiting until the data runs out could hang two ranks on each other. Without
an agreement the quota is computed in the calling thread when first needed. The quota only decides how many fillers
follow the last batch of data, so every batch is the same whenever the count ends.

State: the reader's own count and its quota once known; a restore takes them back (else recounts its share, O(T/G))
and, with an agreement, still joins the new run's round (5 requests, no index read). An elastic resume's quota is
pinned (``pin``): its inputs, the old states, are gone after a later restore.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from streampack.logs import get_logger

_log = get_logger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class Settled:
    """What settling one reader's quota gave."""

    quota: int
    """Batches it yields in the epoch, fillers included."""
    batches: int
    """Batches its own data makes."""
    rank_fillers: int
    """Fillers its rank's readers yield together."""
    fillers: int | None = None
    """Fillers over all ranks (None when only this rank's counts are known: agreed through the store)."""
    min_fillers: int | None = None
    """Fewest fillers any assignment of the batches to the ranks needs (None: as ``fillers``)."""

    def info(self) -> dict[str, Any]:
        """The keys ``metrics()["plan"]`` reports."""
        return {"quota": self.quota, "batches": self.batches, "fillers_rank": self.rank_fillers,
                "fillers_all_ranks": self.fillers, "min_fillers_all_ranks": self.min_fillers}


class LateQuota:
    """One reader's quota for one epoch: ``count()`` its own batches, ``settle(count)`` the :class:`Settled`
    quota; ``background`` runs both in a thread from :meth:`start`; ``info`` is updated when it settles."""

    COUNT_KEY = "batches"
    QUOTA_KEY = "quota"

    def __init__(self, *, count: Callable[[], int], settle: Callable[[int], Settled], background: bool,
                 info: dict[str, Any] | None = None, pin: bool = False) -> None:
        self._count, self._settle = count, settle
        self.background, self.pin = background, pin
        self._mine: int | None = None
        self._settled: Settled | None = None
        self._restored: int | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.info: dict[str, Any] = {}
        self.report_to(info if info is not None else {})

    def report_to(self, info: dict[str, Any]) -> None:
        """Keep ``info`` (``metrics()["plan"]``) up to date from now on."""
        self.info = info
        info.update(dict.fromkeys(Settled(quota=0, batches=0, rank_fillers=0).info()))
        if self._settled is not None:
            info.update(self._settled.info())

    def start(self) -> None:
        """Begin counting and agreeing in the background (idempotent; nothing without ``background``)."""
        with self._lock:
            if not self.background or self._thread is not None or self._settled is not None:
                return
            self._thread = threading.Thread(target=self._run, name="streampack-quota", daemon=True)
            self._thread.start()

    def ready(self) -> bool:
        """Whether :meth:`get` answers without waiting; raises what the background work raised."""
        if self._error is not None:
            raise self._error
        return self._restored is not None or self._settled is not None

    def get(self) -> int:
        """The quota, counting and agreeing now (or waiting for the thread) if need be."""
        if self._restored is not None:
            return self._restored
        if self._settled is None:
            if self.background:
                self.start()
                assert self._thread is not None
                self._thread.join()
            else:
                self._work()
        if self._error is not None:
            raise self._error
        assert self._settled is not None
        return self._settled.quota

    def state(self) -> dict[str, Any]:
        quota = self._settled.quota if self._settled is not None else self._restored
        return {self.COUNT_KEY: self._mine, self.QUOTA_KEY: quota}

    def restore(self, saved: dict[str, Any]) -> None:
        """Take back a saved count and quota; with an agreement and a known count, join the new
        run's round at once (the other readers may need it; no index is read)."""
        self._mine, self._restored = saved.get(self.COUNT_KEY), saved.get(self.QUOTA_KEY)
        if self._restored is not None:
            self.info["quota"] = self._restored
        if self._mine is not None:
            self.info["batches"] = self._mine
            self.start()

    def _run(self) -> None:
        try:
            self._work()
        except BaseException as e:  # noqa: BLE001 - handed to the reader at its next batch
            _log.error("counting this reader's batches failed: %s", e)
            self._error = e

    def _work(self) -> None:
        if self._mine is None:
            self._mine = int(self._count())
        settled = self._settle(self._mine)
        if self._restored is not None and settled.quota != self._restored:
            raise ValueError(f"this reader's restored quota {self._restored} differs from the one agreed now "
                             f"({settled.quota}): the readers resumed from states of different runs or steps")
        self._settled = settled
        self.info.update(settled.info())
