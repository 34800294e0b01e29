"""One retry policy for every read: backoff with full jitter inside a time budget, and counters (docs/storage.md).

Full jitter (``uniform(0, min(max_backoff, backoff * 2**n))``) keeps every worker of every rank from retrying an outage
in lockstep; a connection refused by a host never answered gets ``refused_budget``: a wrong port is a mistake more
often than an outage.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from streampack.errors import DataError
from streampack.logs import get_logger, warn_every

T = TypeVar("T")
log = get_logger(__name__)
_rng = random.Random()  # jitter only: it never affects which data is read


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How long one read keeps trying before it gives up."""

    budget: float = 120.0
    """Seconds a run of consecutive failures of one read may last (then ``DataError``)."""
    retries: int | None = None
    """At most this many retries per run of failures; None: only ``budget`` bounds them."""
    backoff: float = 0.5
    """Upper bound of the first (jittered) wait, seconds; doubles after each failure."""
    max_backoff: float = 15.0
    """Cap of the doubled bound."""
    refused_budget: float = 5.0
    """Seconds a run of refused connections may last while the host has never answered."""

    def __post_init__(self) -> None:
        if not self.budget >= 0 or not self.backoff >= 0 or not self.max_backoff >= self.backoff:
            raise ValueError(f"need budget >= 0 and 0 <= backoff <= max_backoff; got {self.budget=} "
                             f"{self.backoff=} {self.max_backoff=}")
        if not self.refused_budget >= 0:
            raise ValueError(f"refused_budget={self.refused_budget!r} must be >= 0 (seconds)")
        if self.retries is not None and (isinstance(self.retries, bool) or not isinstance(self.retries, int)
                                         or self.retries < 0):
            raise ValueError(f"retries={self.retries!r} must be None or an int >= 0")

    def delay(self, failures: int) -> float:
        """The (jittered) wait after the ``failures``-th failure of a run (1-based)."""
        # the exponent is capped: 2.0 ** 1024 overflows, and an infinite budget retries that long
        return _rng.uniform(0.0, min(self.max_backoff, self.backoff * 2.0 ** min(failures - 1, 60)))


class IOStats:
    """Counts of reads, retries and faults by kind, shared by every stream of one graph and saved in
    the state's metrics (``metrics()["io"]``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # prefetch threads count too
        self.requests = 0
        """Read attempts sent (blocks, listings, ``HEAD`` s)."""
        self.retries = 0
        self.gave_up = 0
        """Reads that failed for the whole budget (each became a DataError)."""
        self.bytes = 0
        """Bytes received from remote stores."""
        self.faults: dict[str, int] = {}
        """Transient failures by kind (``"HTTP 503"``, ``"short_read"``, ``"timeout"``, ...)."""

    def count(self, *, requests: int = 0, retries: int = 0, gave_up: int = 0, nbytes: int = 0,
              fault: str | None = None) -> None:
        with self._lock:
            self.requests += requests
            self.retries += retries
            self.gave_up += gave_up
            self.bytes += nbytes
            if fault is not None:
                self.faults[fault] = self.faults.get(fault, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        """``{"requests", "retries", "gave_up", "bytes", "faults": {kind: n}}`` (plain data)."""
        with self._lock:
            return {"requests": self.requests, "retries": self.retries, "gave_up": self.gave_up,
                    "bytes": self.bytes, "faults": dict(self.faults)}

    def load(self, saved: dict[str, Any]) -> None:
        """Replace the counters with an :meth:`as_dict` taken earlier."""
        with self._lock:
            self.requests, self.retries = int(saved.get("requests", 0)), int(saved.get("retries", 0))
            self.gave_up, self.bytes = int(saved.get("gave_up", 0)), int(saved.get("bytes", 0))
            self.faults = {str(k): int(v) for k, v in saved.get("faults", {}).items()}

    def __repr__(self) -> str:
        return f"IOStats({self.as_dict()})"

    def __getstate__(self) -> dict[str, Any]:
        return self.as_dict()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._lock = threading.Lock()
        self.load(state)


class Transient(Exception):
    """Raised inside an attempt to ask :func:`with_retries` for another one."""

    def __init__(self, kind: str, cause: BaseException | None = None, detail: str = "",
                 retry_after: float | None = None) -> None:
        super().__init__(f"{kind}: {detail or repr(cause)}")
        self.kind = kind
        self.cause = cause
        self.retry_after = retry_after
        """Seconds the server asked to wait (``Retry-After``), if it did."""


REFUSED = "refused"
"""The :class:`Transient` kind of a refused connection."""
_answered: set[str] = set()  # hosts that answered at least once in this process
_answered_lock = threading.Lock()


def _host(url: str) -> str:
    return url.partition("://")[2].split("/", 1)[0]


def _budget(policy: RetryPolicy, url: str, last: Transient) -> float:
    if last.kind == REFUSED and _host(url) not in _answered:
        return min(policy.budget, policy.refused_budget)
    return policy.budget


def with_retries(attempt: Callable[[], T], *, url: str, policy: RetryPolicy, stats: IOStats | None = None,
                 what: str = "read", reason: str = "unreachable_url", first_failure: Transient | None = None) -> T:
    """``attempt()``, retried after :class:`Transient` failures per ``policy``; ``first_failure`` (one
    already counted, e.g. by a background prefetch) starts the run."""
    failures, started, last = 0, time.monotonic(), first_failure
    if last is not None:
        failures += 1
    while True:
        if last is not None:
            wait = max(policy.delay(failures), last.retry_after or 0.0)
            spent, budget = time.monotonic() - started, _budget(policy, url, last)
            if (policy.retries is not None and failures > policy.retries) or spent + wait > budget:
                if stats is not None:
                    stats.count(gave_up=1)
                tries = f"{failures} attempt(s) in {spent:.1f} s"
                asked = f"; the server asked to retry after {last.retry_after:g} s" if last.retry_after else ""
                raise DataError(reason, f"{what} failed after {tries} (retry budget {budget:g} s{asked}): {last}",
                                url=url, value=url) from last.cause
            warn_every(log, f"retry:{last.kind}", "retrying %s of %s after %s", what, url, last)
            time.sleep(wait)
            if stats is not None:
                stats.count(retries=1)
        try:
            result = attempt()
        except Transient as e:
            last, failures = e, failures + 1
            if stats is not None:
                stats.count(fault=e.kind)
            if e.kind.startswith("HTTP "):  # an HTTP status: the host is there
                _answered_by(url)
            continue
        _answered_by(url)
        return result


def _answered_by(url: str) -> None:
    host = _host(url)
    if host not in _answered:
        with _answered_lock:
            _answered.add(host)


__all__ = ["IOStats", "RetryPolicy", "Transient", "with_retries"]
