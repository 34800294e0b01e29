"""Bad input: the error type, the raise/skip policy and per-reason counters.

Every problem found in the data becomes a :class:`DataError` naming the shard URL, the sample key and the offending
value; an :class:`ErrorPolicy` re-raises it (``"raise"``) or drops the sample, byte range or rest of the shard and
counts it (``"skip"``). The reasons are listed in ``docs/reliability.md``. torch's DataLoader re-raises a worker's
exception as ``type(exc)(formatted_traceback)``, so a :class:`DataError` built from one string parses ``reason`` /
``url`` / ``key`` back out of it: ``except DataError`` works in the training loop with ``num_workers > 0``.
"""

from __future__ import annotations

import ast
import re
from collections import deque
from typing import Any

from streampack.logs import get_logger, warn_every

ON_ERROR_CHOICES: tuple[str, ...] = ("raise", "skip")
_LOG = get_logger(__name__)
NOT_TOKENIZED = ("is not tokenized yet: it has text but no token ids; pass tokenizer= (a tokenizers.Tokenizer, "
                 "a tokenizer.json path or a str -> list[int] callable) to tokenize it, or tokens_key= naming "
                 "the field that holds token ids")
"""Why a text sample reached a stage that needs ids, and the two ways out (the same words wherever it is raised)."""
_VALUE_REPR_CHARS = 80
_VALUE_KEEP = 256  # a long str / bytes / list value is kept only this long on the exception
_WHERE = " (shard="
_LITERAL = r"""(?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")"""
_MESSAGE = re.compile(rf"(?P<reason>\w+): .*? \(shard=(?P<url>{_LITERAL})(?:, key=(?P<key>{_LITERAL}))?"
                      rf"(?:, value=.*)?\)", re.DOTALL)


class DataError(ValueError):
    """A bad shard or sample. ``reason`` is the counter key; ``url``/``key`` say where;
    ``skipped_bytes`` is how many bytes of the shard it made the reader pass over (0 if
    unknown). ``DataError(message)`` or ``DataError(message=...)`` rebuilds one from its formatted message (see
    above)."""

    def __init__(self, reason: str = "", detail: str | None = None, *, url: str | None = None, key: str = "",
                 value: Any = None, skipped_bytes: int = 0, message: str | None = None) -> None:
        if message is not None:
            reason = message
        if detail is None and url is None:
            self._from_message(reason)
            return
        if detail is None or url is None:
            raise TypeError("DataError(reason, detail, url=..., ...) needs both detail and url")
        detail = " ".join(detail.split()).replace(_WHERE, " (shard =")  # one line, parseable back
        if isinstance(value, (bytes, bytearray, memoryview)):
            # bytes are a file's content, and the file may not be what its name says (an image
            # path that leads to a password file): the error names it and never shows it
            value = f"<{len(value)} bytes>"
        where = [f"shard={url!r}"]
        if key:  # shard-level errors (missing, unreachable) have no sample key
            where.append(f"key={key!r}")
        if value is not None and not (isinstance(value, str) and value == url):
            shown = repr(value)
            if len(shown) > _VALUE_REPR_CHARS:
                shown = shown[: _VALUE_REPR_CHARS - 3] + "..."
            where.append(f"value={shown}")
        super().__init__(f"{reason}: {detail} ({', '.join(where)})")
        self.reason, self.detail, self.url, self.key = reason, detail, url, key
        self.value = value[:_VALUE_KEEP] if isinstance(value, (str, bytes, list)) else value
        self.skipped_bytes = skipped_bytes

    @property
    def message(self) -> str:
        """The formatted message. Being on the class, it makes torch's worker hand-over re-raise a worker's
        DataError as ``DataError(message=...)`` with no local variable holding it: the other spelling
        (``exception = exc_type(msg); raise exception``) ties the exception, its traceback and the loader iterator
        in those frames into a reference cycle, so the iterator outlives the caller's ``except`` until a garbage
        collection, which closes its queues before its ``__del__`` can send the workers their stop message, and
        the shutdown waits out torch's 5 s join timeout per worker (``tests/integration/test_worker_shutdown.py``)."""
        return str(self)

    def _from_message(self, message: str) -> None:
        super().__init__(message)
        self.reason, self.detail, self.url, self.key, self.value, self.skipped_bytes = "unknown", message, "", "", None, 0
        prefix = f"{DataError.__module__}.{DataError.__qualname__}: "
        lines = [ln[len(prefix):] for ln in message.splitlines() if ln.startswith(prefix)]
        m = _MESSAGE.fullmatch(lines[-1] if lines else message.strip())
        if m is None:
            return
        self.reason, self.url = m.group("reason"), ast.literal_eval(m.group("url"))  # literals only: safe
        self.key = ast.literal_eval(m.group("key")) if m.group("key") else ""
        self.detail = m.group(0)[len(self.reason) + 2 : m.start("url") - m.start() - len(_WHERE)]


class ErrorCounter:
    """Counts of :class:`DataError` per reason, the bytes each skipped, and the last ``keep`` messages
    (shared between nodes; saved in the dataset state's metrics)."""

    def __init__(self, keep: int = 8) -> None:
        if keep < 0:
            raise ValueError(f"{keep=} must be >= 0")
        self.counts: dict[str, int] = {}
        self.skipped_bytes: dict[str, int] = {}
        self.recent: deque[str] = deque(maxlen=keep)
        self.log_skips = False
        """Log each recorded error (rate-limited): set by an ``on_error="skip"`` policy, since
        under ``"raise"`` the exception itself is the report."""

    def record(self, err: DataError) -> None:
        self.counts[err.reason] = self.counts.get(err.reason, 0) + 1
        if err.skipped_bytes:
            self.skipped_bytes[err.reason] = self.skipped_bytes.get(err.reason, 0) + err.skipped_bytes
        self.recent.append(str(err))
        if self.log_skips:
            warn_every(_LOG, f"skip:{err.reason}", "skipped bad input (%d %s so far, in metrics()['errors']): %s",
                       self.counts[err.reason], err.reason, err)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def as_dict(self) -> dict[str, Any]:
        """``{"counts", "total", "skipped_bytes", "recent"}`` as plain data."""
        return {"counts": dict(self.counts), "total": self.total, "skipped_bytes": dict(self.skipped_bytes),
                "recent": list(self.recent)}

    def load(self, saved: dict[str, Any]) -> None:
        """Replace the counts (and recent messages) with an :meth:`as_dict` taken earlier."""
        self.counts = {str(k): int(v) for k, v in saved.get("counts", {}).items()}
        self.skipped_bytes = {str(k): int(v) for k, v in saved.get("skipped_bytes", {}).items()}
        self.recent.clear()
        self.recent.extend(saved.get("recent", ()))

    def __repr__(self) -> str:
        return f"ErrorCounter({self.counts})"


class ErrorPolicy:
    """Applies ``on_error`` to a :class:`DataError`: count it in ``errors``, then raise or not. The one
    check of an ``on_error`` value; a graph's nodes share one policy and so one counter."""

    __slots__ = ("errors", "on_error")

    def __init__(self, on_error: str = "raise", errors: ErrorCounter | None = None) -> None:
        if on_error not in ON_ERROR_CHOICES:
            raise ValueError(f"ErrorPolicy(on_error={on_error!r}): must be one of {ON_ERROR_CHOICES}")
        self.on_error = on_error
        self.errors = errors if errors is not None else ErrorCounter()
        self.errors.log_skips = self.errors.log_skips or on_error == "skip"

    def __repr__(self) -> str:
        return f"ErrorPolicy(on_error={self.on_error!r}, errors={self.errors!r})"

    def handle(self, err: DataError) -> None:
        """Record ``err``; raise it under ``"raise"``, return (the caller skips) under ``"skip"``."""
        self.errors.record(err)
        if self.on_error == "raise":
            raise err


def log_worker_error(err: BaseException, *, worker_id: int, num_workers: int, dp_rank: int) -> str:
    """Log (and return) one line saying what failed in a DataLoader worker: torch re-raises it with the
    whole traceback folded into the message (37-122 lines)."""
    where = f"DataLoader worker {worker_id} of {num_workers} (dp_rank {dp_rank})"
    if isinstance(err, DataError) and err.reason != "unknown":
        key = f" key={err.key!r}" if err.key else ""
        line = f"{where}: DataError {err.reason} in shard={err.url!r}{key}: {err.detail}"
    else:
        first = (str(err).strip().splitlines() or [""])[0]
        line = f"{where}: {type(err).__name__}: {first}" if first else f"{where}: {type(err).__name__}"
    _LOG.error("%s", line)
    return line
