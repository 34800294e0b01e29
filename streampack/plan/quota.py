"""A finite epoch's batch quota, settled late: when the reader first needs it, not before its first batch.

Every rank must yield the same number of batches in a finite epoch, so a reader whose data runs out
emits filler batches up to its *quota*: its rank's largest total spread over its workers
(``epoch_plan.rank_quotas``). The quota needs the reader's own batch count (its packer's rounds
over the token lengths of its own samples, i.e. the sample indexes of its ~N/G shards) and the
other readers' counts. Counting before the first batch cost every reader ⌈N/G⌉ index reads
before it could start (310 extra requests at 64 ranks over 20,000 shards,
``benchmarks/bench_scale.py``). The quota is first *used* when the reader's own data runs out, so:

- **Counting and agreeing run in a background thread**, started once the reader has handed out
  its first batch (or at once if it needs the quota first: a reader with no data). It reads its
  own shards' indexes (the <= 4 its plan already opened at its boundaries are reused), counts, and
  joins the agreement (``streampack.plan.agree``: one store round, O(1) requests per reader). It cannot
  wait for the data to run out: a rank whose reader waits there for a reader of another rank
  that is still reading, while that rank's training step waits for this rank's, would hang. The
  thread progresses whatever the training loop does.
- **Without an agreement** (explicit ``dp_rank``/``dp_size``, no ``torch.distributed``: ranks
  simulated in one process) the quota is computed, in the calling thread, when first needed (each
  reader counts every reader: O(T)). No thread. ``PackedDataset`` logs that cost when it is built
  this way, and refuses a launcher-started run (``RANK``/``WORLD_SIZE``) without
  ``torch.distributed`` up front: every store torch.distributed can be initialised with serves.

Every batch is the same whichever moment the count ends: the quota only decides how many fillers
follow the last batch of data. A quota that turns out smaller than the data (a stage that changed
lengths) is refused as before, at the first batch after the quota is known.

State: the reader's own count and its quota once known. A restore takes them back (no recount
when they are there; else the reader recounts its own share, O(T/G)), and in a run with an
agreement a restored reader still joins the new run's round (5 requests, no index read) so the
readers that had not settled theirs can. Without an agreement the first state after a batch
settles the quota (no one to wait for; what the plan did up front before), so a shard changed
between save and resume cannot change the epoch's count. An elastic resume's quota is pinned
(``pin``): its inputs, the old readers' states, are not at hand after a later restore, so a state
taken before it settled waits for it. With an agreement, a state taken before the background count
ended holds no count (the count is not waited for: a loader snapshots every step).
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
    """One reader's quota for one epoch: ``count()`` gives its own batches, ``settle(count)``
    the :class:`Settled` quota (agreeing with the other readers, or counting them all).
    ``background``: run both in a thread once :meth:`start` is called (a run with an agreement).
    ``info`` (the graph's ``metrics()["plan"]`` dict) is updated when it settles."""

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
