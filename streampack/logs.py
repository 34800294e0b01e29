"""Logging under the ``streampack`` logger, with rate limits for events that repeat per sample.

:func:`warn_every` logs the first event of a kind at once, then at most one line per ``interval`` seconds per kind with
how many were suppressed; every call also counts its ``kind`` (:func:`event_counts`), and each batch carries its
reader's counts (``batch.stats.events``), so exact counts never live only in logs. ``slow_batch`` fires when a reader
takes more than ``STREAMPACK_SLOW_BATCH_SECONDS`` (default 30) to build one batch.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

ROOT = "streampack"
DEFAULT_INTERVAL = 30.0


def get_logger(name: str) -> logging.Logger:
    """The ``streampack.<name>`` logger (``name`` is usually the module's ``__name__``)."""
    return logging.getLogger(name if name.startswith(ROOT) else f"{ROOT}.{name}")


@dataclass(slots=True)
class _Window:
    last: float
    suppressed: int = 0


_windows: dict[tuple[str, str], _Window] = {}
_counts: dict[str, int] = {}
_lock = threading.Lock()


def count(kind: str, n: int = 1) -> None:
    """Count ``n`` events of ``kind`` in this process without logging."""
    with _lock:
        _counts[kind] = _counts.get(kind, 0) + n


def event_counts() -> dict[str, int]:
    """Events counted in this process so far, by kind (a copy)."""
    with _lock:
        return dict(_counts)


def warn_every(logger: logging.Logger, kind: str, message: str, *args: object,
               interval: float = DEFAULT_INTERVAL, level: int = logging.WARNING) -> bool:
    """Count a ``kind`` event and log ``message % args`` unless a ``kind`` event was logged less
    than ``interval`` seconds ago (then count it as suppressed); returns whether it was logged."""
    count(kind)
    if not logger.isEnabledFor(level):
        return False
    now = time.monotonic()
    key = (logger.name, kind)
    with _lock:
        window = _windows.get(key)
        if window is not None and now - window.last < interval:
            window.suppressed += 1
            return False
        suppressed = window.suppressed if window is not None else 0
        _windows[key] = _Window(last=now)
    if suppressed:
        message = f"{message} ({suppressed} more {kind} event(s) suppressed in the last {interval:g} s)"
    logger.log(level, message, *args)
    return True


def reset_rate_limits() -> None:
    """Forget every window and count (tests; a fresh worker process starts empty anyway)."""
    with _lock:
        _windows.clear()
        _counts.clear()
