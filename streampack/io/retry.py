"""One retry policy for every remote read: how many attempts, how long to wait, and the loop.

Each transport (HTTP, S3) classifies its own failures: a transient one (a connection error, a
5xx, a throttle) is raised as :class:`Transient` inside the attempt and retried here with
exponential backoff; anything else propagates at once. When the attempts run out the last
failure becomes ``DataError("unreachable_url")`` naming the URL.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from streampack.errors import DataError

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenOptions:
    """How shards are opened; passed as one value from the reader to the sources."""

    retries: int = 3
    """Extra attempts after a failed connection to an ``http(s)`` or ``s3`` URL."""
    backoff: float = 0.5
    """Seconds before the first retry; doubled after each."""
    timeout: float = 30.0
    """Socket timeout of one HTTP / S3 request, seconds."""
    allow_pipe: bool = False
    """Accept ``pipe:`` URLs (runs a shell command)."""

    def __post_init__(self) -> None:
        if self.retries < 0 or self.backoff < 0 or self.timeout <= 0:
            raise ValueError(f"need retries >= 0, backoff >= 0, timeout > 0; got {self.retries=} {self.backoff=} {self.timeout=}")


class Transient(Exception):
    """Raised inside an attempt to ask :func:`with_retries` for another one."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(repr(cause))
        self.cause = cause


def with_retries(attempt: Callable[[], T], *, url: str, opts: OpenOptions) -> T:
    """``attempt()``, retried after :class:`Transient` failures per ``opts``."""
    last: BaseException | None = None
    for n in range(opts.retries + 1):
        if n:
            time.sleep(opts.backoff * 2 ** (n - 1))
        try:
            return attempt()
        except Transient as e:
            last = e.cause
    raise DataError("unreachable_url", f"failed after {opts.retries + 1} attempts: {last}", url=url, value=url)
