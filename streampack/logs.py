"""Logging under the ``streampack`` logger, with rate limits for events that repeat per sample.

A web-scale stream can skip thousands of bad samples or retry hundreds of reads an hour; one
log line each would drown the training log. :func:`warn_every` emits the first occurrence of a
kind of event at once and then at most one line per ``interval`` seconds per kind, saying how
many were suppressed in between. Exact counts are always in the metrics, never only in logs.

Configure it like any library logger, e.g. ``logging.getLogger("streampack").setLevel("INFO")``.
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
_lock = threading.Lock()


def warn_every(logger: logging.Logger, kind: str, message: str, *args: object,
               interval: float = DEFAULT_INTERVAL, level: int = logging.WARNING) -> bool:
    """Log ``message % args`` unless a ``kind`` event was logged less than ``interval`` seconds
    ago (then count it as suppressed); returns whether it was logged."""
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
    """Forget every window (tests; a fresh worker process starts empty anyway)."""
    with _lock:
        _windows.clear()
