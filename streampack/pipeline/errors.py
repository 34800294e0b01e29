"""Bad input: the error type, the raise/skip policy, per-reason counters, and field validators.

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

import numpy as np

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


def validate_tokens(value: Any, *, url: str, key: str) -> np.ndarray:
    """A json list or numpy array of token ids -> int64 ``[L]``, ``L >= 1``, all ids ``>= 0``.

    Strings, nested lists, booleans and integral floats are ``bad_dtype``; fractional floats
    are ``non_integer_id``.
    """
    if isinstance(value, np.ndarray):
        arr = value
        if arr.dtype.kind not in "iu":
            raise DataError("bad_dtype", f"token array has dtype {arr.dtype}", url=url, key=key, value=arr[:8].tolist())
        if arr.ndim != 1:
            raise DataError("bad_dtype", f"token array has shape {arr.shape}, want [L]", url=url, key=key, value=arr.shape)
        if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            raise DataError("bad_dtype", "token id overflows int64", url=url, key=key, value=int(arr.max()))
        arr = arr.astype(np.int64, copy=False)
    elif isinstance(value, list):
        arr = _json_ids(value, url=url, key=key)
    else:
        raise DataError("bad_dtype", f"tokens field is {type(value).__name__}, want a list of ints", url=url, key=key, value=value)
    if arr.shape[0] == 0:
        raise DataError("empty_sample", "sample has 0 tokens", url=url, key=key, value=[])
    if arr.min() < 0:
        bad = int(arr[np.argmax(arr < 0)])
        raise DataError("negative_id", "negative token id", url=url, key=key, value=bad)
    return arr


def _json_ids(values: list[Any], *, url: str, key: str) -> np.ndarray:
    for v in values:
        if type(v) is int:
            continue
        if type(v) is float and not v.is_integer():
            raise DataError("non_integer_id", "token id is not an integer", url=url, key=key, value=v)
        raise DataError("bad_dtype", f"token id of type {type(v).__name__}", url=url, key=key, value=v)
    try:
        return np.asarray(values, dtype=np.int64).reshape(-1)
    except OverflowError:
        raise DataError("bad_dtype", "token id overflows int64", url=url, key=key, value=max(values)) from None


def validate_text(value: Any, *, url: str, key: str) -> str:
    """Raw bytes (strict UTF-8) or str -> non-empty str."""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError("bad_utf8", str(e), url=url, key=key, value=value[max(0, e.start - 8) : e.end + 8]) from None
    if not isinstance(value, str):
        raise DataError("bad_dtype", f"text field is {type(value).__name__}, want str", url=url, key=key, value=value)
    if not value:
        raise DataError("empty_sample", "sample has empty text", url=url, key=key, value=value)
    return value


def validate_per_token(value: Any, length: int | None, *, what: str, url: str, key: str) -> np.ndarray:
    """``labels`` (int64) or ``loss_mask`` (bool) of the sample's token length."""
    reason = f"bad_{what}"
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError):
        raise DataError(reason, f"{what} is not an array", url=url, key=key, value=value) from None
    if arr.ndim != 1 or arr.dtype.kind not in "iub":
        raise DataError(reason, f"{what} must be a 1-D integer array, got {arr.dtype}{list(arr.shape)}", url=url, key=key, value=value)
    if length is not None and arr.shape[0] != length:
        raise DataError(reason, f"{what} has length {arr.shape[0]} != {length} tokens", url=url, key=key, value=arr.shape[0])
    if what == "loss_mask":
        if arr.size and not np.isin(arr, (0, 1)).all():
            raise DataError(reason, "loss_mask values must be 0/1", url=url, key=key, value=arr[:8].tolist())
        return arr.astype(bool)
    return arr.astype(np.int64)
