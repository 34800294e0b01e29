"""The manifest file's columns: string columns held as bytes, and every field checked on load.

A manifest is input like any shard: :func:`checked_fields` refuses a truncated, hand-edited or foreign file with one
``ValueError`` naming the file and the field. In memory it is four int64 columns and three :class:`StringColumn` (URL,
tag, digest) that keep per shard only the bytes not shared with every other string's start and end plus a 4-byte offset:
122 B per shard where a ``str`` per shard and column costs 339 B (``benchmarks/bench_manifest_memory.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

_UTF8 = ("utf-8", "surrogateescape")  # a URL that is not UTF-8 still round-trips byte for byte


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class StringColumn:
    """``N`` strings as bytes: the ``head`` and ``tail`` every string shares stored once, the rest back to
    back in ``body`` (uint8), string ``i`` ending at ``ends[i]``; indexing decodes one string."""

    head: bytes
    tail: bytes
    body: np.ndarray
    ends: np.ndarray

    @classmethod
    def of(cls, strings: Iterable[str]) -> StringColumn:
        encoded = [s.encode(*_UTF8) for s in strings]
        ends = np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)))
        return cls.packed(np.frombuffer(b"".join(encoded), dtype=np.uint8), ends)

    @classmethod
    def packed(cls, blob: np.ndarray, ends: np.ndarray) -> StringColumn:
        """The column of the strings stored back to back in ``blob`` (uint8) ending at ``ends``
        (non-decreasing, the last ``len(blob)``: the caller checked)."""
        ends = np.asarray(ends, dtype=np.int64)
        if not len(ends):
            return cls(head=b"", tail=b"", body=np.zeros(0, np.uint8), ends=np.zeros(0, np.uint32))
        starts = np.concatenate([[0], ends[:-1]])
        shortest = int((ends - starts).min())
        head = _shared(blob, starts, shortest, 1)
        tail = _shared(blob, ends - 1, shortest - head, -1)
        first = int(ends[0])
        shared = (blob[:head].tobytes(), blob[first - tail:first].tobytes())
        if head or tail:  # numpy only: a Python object per string left the heap fragmented (RSS, not traced)
            body = blob[~_in_ranges(len(blob), np.concatenate([starts, ends - tail]),
                                    np.concatenate([starts + head, ends]))]
            ends = ends - np.arange(1, len(ends) + 1, dtype=np.int64) * (head + tail)
        else:
            body = blob
        small = np.uint32 if len(body) < 2**32 else np.int64
        return cls(head=shared[0], tail=shared[1], body=body, ends=ends.astype(small))

    def __len__(self) -> int:
        return int(self.ends.shape[0])

    def __getitem__(self, i: int) -> str:
        n = len(self)
        j = int(i) + n if i < 0 else int(i)
        if not 0 <= j < n:
            raise IndexError(f"string {i} of a column of {n}")
        start = int(self.ends[j - 1]) if j else 0
        return (self.head + self.body[start:int(self.ends[j])].tobytes() + self.tail).decode(*_UTF8)

    def __iter__(self) -> Iterator[str]:
        raw, start = self.body.tobytes(), 0
        for end in self.ends.tolist():
            yield (self.head + raw[start:end] + self.tail).decode(*_UTF8)
            start = end

    def joined(self, sep: bytes) -> np.ndarray:
        """uint8: the strings' UTF-8 bytes joined by ``sep`` (``sep.join(s.encode() for s in
        self)``), made with numpy alone."""
        n = len(self)
        if not n:
            return np.zeros(0, np.uint8)
        h, t, k = len(self.head), len(self.tail), len(sep)
        lengths = np.diff(self.ends.astype(np.int64), prepend=0) + h + t
        stops = np.cumsum(lengths + k) - k
        starts = stops - lengths
        out = np.empty(int(stops[-1]), dtype=np.uint8)
        fixed = _in_ranges(len(out), np.concatenate([starts, stops - t]),
                           np.concatenate([starts + h, np.minimum(stops + k, len(out))]))
        out[~fixed] = self.body
        if h + t + k:  # what is not a string's own part, in order: head, tail, sep; head, tail, sep; ...
            out[fixed] = np.frombuffer((self.head + self.tail + sep) * n, dtype=np.uint8)[:len(out) - len(self.body)]
        return out

    def hash_into(self, digest: Any, sep: bytes, per: int = 4096) -> None:
        """Feed ``joined(sep)`` to ``digest`` ``per`` strings at a time (a whole column at once leaves ~4 MB
        of freed temporaries as RSS at 10^5 shards)."""
        for lo in range(0, len(self), per):
            digest.update((sep if lo else b"") + self._part(lo, lo + per).joined(sep).tobytes())

    def _part(self, lo: int, hi: int) -> StringColumn:
        """Strings ``lo:hi`` (sharing this column's bytes)."""
        hi = min(hi, len(self))
        a, b = int(self.ends[lo - 1]) if lo else 0, int(self.ends[hi - 1])
        return StringColumn(head=self.head, tail=self.tail, body=self.body[a:b],
                            ends=self.ends[lo:hi].astype(np.int64) - a)

    def blob(self) -> tuple[np.ndarray, np.ndarray]:
        """(uint8 bytes back to back, int64 end offsets): the file's layout."""
        lengths = np.diff(self.ends.astype(np.int64), prepend=0) + len(self.head) + len(self.tail)
        return (self.joined(b"") if self.head or self.tail else self.body), np.cumsum(lengths)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringColumn):
            return (len(self) == len(other) and self.head == other.head and self.tail == other.tail
                    and np.array_equal(self.ends, other.ends) and np.array_equal(self.body, other.body))
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(self) == len(other) and all(self._part(lo, lo + 4096).same(other[lo:lo + 4096])
                                                   for lo in range(0, len(self), 4096))
        return NotImplemented

    def same(self, strings: Sequence[str]) -> bool:
        """Whether ``strings`` are this column's: their bytes and lengths compared as arrays."""
        encoded = [str(s).encode(*_UTF8) for s in strings]
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        mine = np.diff(self.ends.astype(np.int64), prepend=0) + len(self.head) + len(self.tail)
        return bool(np.array_equal(lengths, mine)) and self.joined(b"").tobytes() == b"".join(encoded)

    __hash__ = None  # type: ignore[assignment]  # equal by value, and mutable arrays inside

    def __repr__(self) -> str:
        return f"StringColumn({len(self)} strings{f', first {self[0]!r}' if len(self) else ''})"


def _in_ranges(length: int, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """bool ``[length]``: True inside any of the disjoint ranges ``[starts[i], stops[i])``. Empty
    ranges are dropped first, so no two ranges share a start or a stop and plain fancy
    assignment marks the edges (``np.add.at`` took ~1 s at 10^5 strings)."""
    keep = starts < stops
    edges = np.zeros(length + 1, dtype=np.int8)
    edges[starts[keep]] += 1
    edges[stops[keep]] -= 1
    return np.cumsum(edges[:-1], dtype=np.int8) > 0


def _shared(blob: np.ndarray, anchors: np.ndarray, limit: int, step: int) -> int:
    """How many bytes every string has in common with the first, reading from ``anchors`` (each
    string's first byte, ``step`` 1; or last byte, ``step`` -1), at most ``limit``. Strings are
    compared a block at a time, so the gathered ``[block, limit]`` positions stay near 512 KiB."""
    if limit <= 0 or not len(anchors):
        return 0
    offsets = np.arange(limit, dtype=np.int64) * step
    first = blob[anchors[0] + offsets]
    block = max(1, 2**16 // limit)
    for lo in range(0, len(anchors), block):
        rows = blob[anchors[lo:lo + block, None] + offsets[None, :limit]]
        differ = (rows != first[:limit]).any(axis=0)
        if differ.any():
            limit = int(np.argmax(differ))
            if not limit:
                return 0
    return limit


# ------------------------------------------------------------------ checking a loaded file

INT_COLUMNS = {"sizes": -1, "samples": 0, "tokens": -1, "byte_costs": 0}
"""The per-shard int64 columns and the least value each may hold (-1: the store did not say / a
sample's length is unknown)."""
STRING_COLUMNS = {"urls": "url_ends", "tags": "tag_ends", "digests": "digest_ends"}
LIMITS = ("max_line_bytes", "max_member_bytes", "max_sample_bytes", "max_json_depth")


def checked_fields(path: str, data: Mapping[str, np.ndarray], version: int) -> dict[str, Any]:
    """The ``Manifest`` fields of the arrays ``data`` read from ``path``, each checked for its
    type, shape, length and range; ``ValueError`` naming ``path`` and the field otherwise."""
    def bad(name: str, why: str) -> ValueError:
        return ValueError(f"the manifest {path!r} is not valid: field {name!r} {why}: rebuild it with "
                          f"`streampack index URLS --out DIR`")

    def field(name: str) -> np.ndarray:
        if name not in data:
            raise bad(name, "is missing")
        return data[name]

    found = _scalar(field("version"), "i", bad, "version")
    if found != version:
        raise ValueError(f"the manifest {path!r} has version {found}, this streampack reads {version}: "
                         f"rebuild it with `streampack index`")
    tokens_key = _scalar(field("tokens_key"), "U", bad, "tokens_key")
    if not tokens_key:
        raise bad("tokens_key", "is empty")
    ends = field("url_ends")
    n = len(ends) if isinstance(ends, np.ndarray) and ends.ndim == 1 else -1
    if n < 0:
        raise bad("url_ends", "is not a 1-d array")
    out: dict[str, Any] = {"tokens_key": tokens_key, "settings": _scalar(field("settings"), "U", bad, "settings")}
    for name, least in INT_COLUMNS.items():
        out[name] = _ints(field(name), n, least, bad, name)
    for name, ends_name in STRING_COLUMNS.items():
        # digests may be absent as a whole (zero strings), never for some shards only
        out[name] = _strings(field(name), field(ends_name), n, bad, name, ends_name, optional=name == "digests")
    empty = np.flatnonzero(np.diff(data["url_ends"].astype(np.int64), prepend=0) == 0)
    if len(empty):
        raise bad("urls", f"holds an empty URL at entry {int(empty[0])}")
    if (out["byte_costs"] < out["samples"]).any():  # every sample costs at least one byte
        shard = int(np.argmax(out["byte_costs"] < out["samples"]))
        raise bad("byte_costs", f"is below the sample count at shard {shard} "
                                f"({int(out['byte_costs'][shard])} < {int(out['samples'][shard])})")
    limits = _ints(field("limits"), len(LIMITS), 1, bad, "limits")
    out["limits"] = {name: int(v) for name, v in zip(LIMITS, limits)}
    return out


def _scalar(value: np.ndarray, kind: str, bad: Any, name: str) -> Any:
    if not isinstance(value, np.ndarray) or value.shape != () or value.dtype.kind not in (
            "iu" if kind == "i" else kind):
        raise bad(name, f"is not a single {'integer' if kind == 'i' else 'string'}")
    return int(value) if kind == "i" else str(value)


def _ints(value: np.ndarray, n: int, least: int, bad: Any, name: str) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "iu" or value.ndim != 1:
        raise bad(name, "is not a 1-d integer array")
    if len(value) != n:
        raise bad(name, f"has {len(value)} entries, the manifest lists {n} shards")
    if value.dtype == np.uint64 and len(value) and int(value.max()) >= 2**63:
        raise bad(name, "holds a value past int64")
    value = value.astype(np.int64, copy=False)
    low = np.flatnonzero(value < least)
    if len(low):
        raise bad(name, f"holds {int(value[low[0]])} at entry {int(low[0])} ({len(low)} entries below {least})")
    return value


def _strings(blob: np.ndarray, ends: np.ndarray, n: int, bad: Any, name: str, ends_name: str, *,
             optional: bool) -> StringColumn:
    if not isinstance(blob, np.ndarray) or blob.dtype != np.uint8 or blob.ndim != 1:
        raise bad(name, "is not a 1-d uint8 array")
    if not isinstance(ends, np.ndarray) or ends.dtype.kind not in "iu" or ends.ndim != 1:
        raise bad(ends_name, "is not a 1-d integer array")
    if len(ends) != n and not (optional and len(ends) == 0):
        raise bad(ends_name, f"has {len(ends)} entries, the manifest lists {n} shards")
    ends = ends.astype(np.int64, copy=False)
    if len(ends) and (ends[0] < 0 or (np.diff(ends) < 0).any()):
        raise bad(ends_name, "is not a non-decreasing list of offsets")
    if (int(ends[-1]) if len(ends) else 0) != len(blob):
        raise bad(ends_name, f"ends at {int(ends[-1]) if len(ends) else 0}, its {name!r} bytes at {len(blob)}")
    return StringColumn.packed(blob, ends)


__all__ = ["INT_COLUMNS", "LIMITS", "STRING_COLUMNS", "StringColumn", "checked_fields"]
