"""Bad input: the error type, the raise/skip policy and per-reason counters.

Every problem found in the data becomes a :class:`DataError` whose message names the shard URL,
the sample key and the offending value (webdataset-style: errors carry provenance). The reader
hands each one to an :class:`ErrorPolicy`: ``"raise"`` re-raises it, ``"skip"`` drops the sample
(or, for ``corrupt_shard``, the rest of the shard) and counts it in an :class:`ErrorCounter`.

Reasons used by the readers: ``corrupt_shard``, ``missing_shard``, ``unreachable_url``,
``empty_sample``, ``bad_utf8``, ``bad_json``, ``bad_dtype``, ``negative_id``,
``non_integer_id``, ``missing_field``, ``bad_labels``, ``bad_loss_mask``, ``duplicate_member``.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Literal

OnError = Literal["raise", "skip"]
ON_ERROR_CHOICES: tuple[str, ...] = ("raise", "skip")
_VALUE_REPR_CHARS = 80


class DataError(ValueError):
    """A bad shard or sample. ``reason`` is the counter key; ``url``/``key`` say where."""

    def __init__(self, reason: str, detail: str, *, url: str, key: str = "", value: Any = None) -> None:
        where = [f"shard={url!r}"]
        if key:  # shard-level errors (missing, unreachable) have no sample key
            where.append(f"key={key!r}")
        if value is not None and not (isinstance(value, str) and value == url):
            shown = repr(value)
            if len(shown) > _VALUE_REPR_CHARS:
                shown = shown[: _VALUE_REPR_CHARS - 3] + "..."
            where.append(f"value={shown}")
        super().__init__(f"{reason}: {detail} ({', '.join(where)})")
        self.reason = reason
        self.url = url
        self.key = key
        self.value = value


class ErrorCounter:
    """Counts of :class:`DataError` per reason plus the last ``keep`` messages.

    Shared freely between nodes; no node state holds it. ``PackedDataset`` saves it in the
    state's metrics and loads it back after a restore (see ``PackedDataset.__iter__``).
    """

    def __init__(self, keep: int = 8) -> None:
        if keep < 0:
            raise ValueError(f"{keep=} must be >= 0")
        self.counts: dict[str, int] = {}
        self.recent: deque[str] = deque(maxlen=keep)

    def record(self, err: DataError) -> None:
        self.counts[err.reason] = self.counts.get(err.reason, 0) + 1
        self.recent.append(str(err))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def as_dict(self) -> dict[str, Any]:
        """``{"counts": {reason: n}, "total": n, "recent": [message, ...]}`` (plain data)."""
        return {"counts": dict(self.counts), "total": self.total, "recent": list(self.recent)}

    def load(self, saved: dict[str, Any]) -> None:
        """Replace the counts (and recent messages) with an :meth:`as_dict` taken earlier."""
        self.counts = {str(k): int(v) for k, v in saved.get("counts", {}).items()}
        self.recent.clear()
        self.recent.extend(saved.get("recent", ()))

    def __repr__(self) -> str:
        return f"ErrorCounter({self.counts})"


class ErrorPolicy:
    """Applies ``on_error`` to a :class:`DataError`: always count it, then raise or not."""

    def __init__(self, on_error: str, errors: ErrorCounter | None) -> None:
        if on_error not in ON_ERROR_CHOICES:
            raise ValueError(f"{on_error=} must be one of {ON_ERROR_CHOICES}")
        self.on_error = on_error
        self.errors = errors if errors is not None else ErrorCounter()

    def handle(self, err: DataError) -> None:
        """Record ``err``; raise it under ``"raise"``, return (the caller skips) under ``"skip"``."""
        self.errors.record(err)
        if self.on_error == "raise":
            raise err
