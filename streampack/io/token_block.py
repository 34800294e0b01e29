"""A run of pre-tokenized documents read in one piece: one token array, per-document arrays.

A :class:`TokenBlock` holds many documents' ids in one integer array and says, per document,
where its ids sit and where its sample started in the shard (what a resume state refers to).
Documents are never copied out of the block; the collate copies each once, into the batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from streampack.sample import Sample


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class TokenBlock:
    """``n`` consecutive documents of one shard range: document ``i`` is ``tokens[starts[i]:starts[i] + lengths[i]]``,
    sample ``numbers[i]`` at ``offsets[i]``, followed by ``next_offsets[i]`` / ``next_numbers[i]``."""

    url: str
    tokens: np.ndarray
    """1-D array of native-order integers (int32 for most shards; never copied from the read
    buffer when the layout allows a view)."""
    starts: np.ndarray
    """int64 ``[n]``: element offset of each document in ``tokens``."""
    lengths: np.ndarray
    """int64 ``[n]``: token count of each document (>= 1)."""
    offsets: np.ndarray
    """int64 ``[n]``."""
    next_offsets: np.ndarray
    """int64 ``[n]``."""
    numbers: np.ndarray
    """int64 ``[n]``."""
    next_numbers: np.ndarray
    """int64 ``[n]``."""
    done: bool
    """The range ends with this block's last document (the per-sample reader's ``at_end``)."""
    key_bytes: bytes = b""
    """Where tar keys are read from (the block's raw bytes): key ``i`` is
    ``key_bytes[key_at[i]:key_at[i] + key_len[i]]``; empty: the key is the sample number."""
    key_at: np.ndarray | None = None
    key_len: np.ndarray | None = None
    samples: tuple[Sample, ...] | None = None
    """The samples themselves, for a block made from the per-sample reader's output (they may
    carry labels or a loss mask, which the fast layout does not handle)."""
    _doc_keys: list[str] = field(default_factory=list, repr=False)

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def key(self, i: int) -> str:
        """The sample key of document ``i`` (what ``Sample.key`` is when it is read sample by sample)."""
        if self.samples is not None:
            return self.samples[i].key
        if self.key_at is None:
            return str(int(self.numbers[i]))
        at = int(self.key_at[i])
        return self.key_bytes[at:at + int(self.key_len[i])].decode("utf-8", "surrogateescape")

    def doc_keys(self) -> list[str]:
        """Every document's ``url#key`` (``Sample.doc_key``), made on first use (one pass over the block: a key read
        per document through numpy scalars cost ~6 µs)."""
        keys = self._doc_keys
        if not keys:
            if self.samples is not None:
                keys += [s.doc_key for s in self.samples]
            elif self.key_at is None:
                keys += [f"{self.url}#{n}" if self.url else str(n) for n in self.numbers.tolist()]
            else:
                raw, url = self.key_bytes, self.url
                keys += [f"{url}#{raw[a:a + n].decode('utf-8', 'surrogateescape')}" if url
                         else raw[a:a + n].decode("utf-8", "surrogateescape")
                         for a, n in zip(self.key_at.tolist(), self.key_len.tolist())]
        return keys

    def ids(self, i: int) -> np.ndarray:
        """int64 ids of document ``i`` (a copy)."""
        s = int(self.starts[i])
        return self.tokens[s:s + int(self.lengths[i])].astype(np.int64)

    @classmethod
    def numbered(cls, url: str, tokens: np.ndarray, bounds: np.ndarray, first: int, *, done: bool) -> TokenBlock:
        """Documents ``tokens[bounds[k]:bounds[k + 1]]`` numbered from ``first``, each one's position its number (a
        parquet or Arrow row, a Megatron document)."""
        numbers = np.arange(first, first + bounds.size - 1, dtype=np.int64)
        return cls(url=url, tokens=tokens, starts=bounds[:-1], lengths=np.diff(bounds), offsets=numbers,
                   next_offsets=numbers + 1, numbers=numbers, next_numbers=numbers + 1, done=done)

    @classmethod
    def of_samples(cls, samples: list[Sample], *, done: bool) -> TokenBlock:
        """A block of samples made by nodes that yield Samples (a sample without an origin, made
        by a stage or by hand, has -1 where its origin would be: it cannot be re-read)."""
        lengths = np.array([len(s) for s in samples], dtype=np.int64)
        starts = np.zeros(len(samples), dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        where = np.array([(o.offset, o.next_offset, o.number, o.next_number) if o is not None else (-1, -1, -1, -1)
                          for o in (s.origin for s in samples)], dtype=np.int64).reshape(-1, 4)
        tokens = np.concatenate([s.tokens for s in samples]) if samples else np.zeros(0, np.int64)
        return cls(url=samples[0].url if samples else "", tokens=tokens, starts=starts, lengths=lengths,
                   offsets=where[:, 0], next_offsets=where[:, 1], numbers=where[:, 2], next_numbers=where[:, 3],
                   done=done, samples=tuple(samples))

def byte_runs(nbytes: np.ndarray, readable: np.ndarray, cap: int) -> Iterator[tuple[int, int]]:
    """Runs ``[i, j)`` of consecutive documents read together: ``readable`` ones whose ``nbytes`` sum to at most
    ``cap`` (a bigger one alone); a document that is not ``readable`` is a run alone (its reader says why). One
    search a run, not a test a document (a per-document check cost ~2 µs: a third of a token array's read)."""
    ends = np.zeros(len(nbytes) + 1, np.int64)
    np.cumsum(nbytes, out=ends[1:])
    unreadable = np.flatnonzero(~readable)
    i, n = 0, len(nbytes)
    while i < n:
        if not readable[i]:
            yield i, i + 1
            i += 1
            continue
        k = int(np.searchsorted(unreadable, i))
        stop = int(unreadable[k]) if k < unreadable.size else n
        j = int(np.searchsorted(ends, ends[i] + cap, side="right")) - 1
        j = min(max(j, i + 1), stop)
        yield i, j
        i = j


__all__ = ["TokenBlock", "byte_runs"]
