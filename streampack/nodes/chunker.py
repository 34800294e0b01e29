"""ChunkNode: the overlong policy on document rows, for the contiguous fast path.

What :class:`~streampack.nodes.overlong.OverlongNode` does sample by sample, on runs of rows
(:mod:`streampack.plan.rows`): :meth:`ChunkNode.take` hands out the next ``n`` documents after
the policy (``split`` into ``capacity``-token chunks keyed ``/0``, ``/1``, ...; ``truncate``;
``drop``; ``error``), pulling from the :class:`~streampack.nodes.block_reader.BlockReader`
exactly the documents the per-sample node would have pulled to give ``n`` (the chunk counts of
a run are a cumulative sum; one ``searchsorted`` says how many to consume), so the reader's
position, the chunks left of a split document and the counters are the per-sample node's. Its
state is an OverlongNode state (same kind, keys and values): either path restores the other's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from streampack.nodes.block_reader import BlockReader, DocRun
from streampack.nodes.overlong import OverlongCounters, OverlongNode
from streampack.options.packing import OVERLONG_POLICIES
from streampack.plan.cursor import (
    POSITION_FIELDS,
    PULLED_FIELDS,
    Position,
    Pulled,
    Split,
    pulled_from_state,
    pulled_to_state,
)
from streampack.plan.rows import BlockStore, cat, repeat, rows_of
from streampack.plan.state import record_of, record_text, samples_from_state, samples_to_state


def base_rows(run: DocRun, k: int, store: BlockStore) -> np.ndarray:
    """The first ``k`` documents of ``run`` as rows (whole documents: chunk -1)."""
    block, lo = run.block, run.lo
    rows = rows_of(k)
    rows["length"] = block.lengths[lo:lo + k]
    rows["source"], rows["shard"], rows["epoch"] = run.source, run.shard, run.epoch
    rows["offset"] = block.offsets[lo:lo + k]
    rows["number"] = block.numbers[lo:lo + k]
    rows["next_offset"] = block.next_offsets[lo:lo + k]
    rows["next_number"] = block.next_numbers[lo:lo + k]
    rows["chunk"] = -1
    rows["block"] = store.add(block)
    rows["doc"] = np.arange(lo, lo + k)
    rows["start"] = block.starts[lo:lo + k]
    return rows


def chunk_counts(lengths: np.ndarray, max_len: int, policy: str) -> np.ndarray:
    """Documents each of ``lengths`` becomes under ``policy`` (``apply_overlong``)."""
    if policy == "split":
        return np.maximum(-(-lengths // max_len), 1)
    if policy == "drop":
        return (lengths <= max_len).astype(np.int64)
    return np.ones(lengths.shape[0], dtype=np.int64)


def expand(rows: np.ndarray, max_len: int, policy: str) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` after the overlong policy (every chunk), and the chunk count of each."""
    lengths = rows["length"]
    counts = chunk_counts(lengths, max_len, policy)
    over = lengths > max_len
    if not over.any():
        return rows, counts
    out = repeat(rows, counts)
    mine = np.repeat(over, counts)
    if policy == "truncate":
        out["chunk"][mine] = 0
        out["length"][mine] = max_len
        return out, counts
    # split: chunk j of a document starts j * max_len tokens in
    j = np.arange(out.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)
    out["chunk"] = np.where(mine, j, out["chunk"])
    out["start"] += np.where(mine, j * max_len, 0)
    out["length"] = np.where(mine, np.minimum(max_len, out["length"] - j * max_len), out["length"])
    out["cut"] = mine
    return out, counts


class ChunkNode(BaseNode[np.ndarray]):
    """Rows of at most ``max_len`` tokens after ``policy`` (see the module docstring).
    ``replay(position)`` re-reads every chunk of the sample at a ``cursor.Position`` as rows
    (a :class:`~streampack.plan.row_replay.RowReplay`'s ``chunks``)."""

    SOURCE_KEY, PENDING_KEY, COUNTERS_KEY, LAST_KEY = (OverlongNode.SOURCE_KEY, OverlongNode.PENDING_KEY,
                                                       OverlongNode.COUNTERS_KEY, OverlongNode.LAST_KEY)
    KIND_KEY, KIND = OverlongNode.KIND_KEY, OverlongNode.KIND
    undelivered = OverlongNode.undelivered
    """What a saved state had not delivered (one layout for both nodes: ``OverlongNode.undelivered``)."""

    def __init__(self, source: BlockReader, max_len: int, policy: str = "split", *, replay: Any, store: BlockStore) -> None:
        super().__init__()
        # max_len and policy come checked (StreamConfig.capacity, PackOptions.overlong): only the
        # graph builder makes this node
        self.source, self.max_len, self.policy, self.replay, self.store = source, max_len, policy, replay, store
        self._clear()

    def _clear(self) -> None:
        self.counters = OverlongCounters()
        self.pending = rows_of(0)
        self._split: Split | None = None  # the sample split (``next`` unset: the chunks left are ``pending``)
        self._last: dict[int, Pulled] = {}

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._clear()
        if initial_state is None:
            self.source.reset(None)
            return
        self.source.reset(initial_state[self.SOURCE_KEY])
        self.counters = OverlongCounters(**record_of(initial_state[self.COUNTERS_KEY]))
        self._last = {p.source: p for p in pulled_from_state(initial_state[self.LAST_KEY])}
        pending = initial_state[self.PENDING_KEY]
        split = Split.from_state(pending)
        if split is None:
            if samples_from_state(pending):
                raise ValueError("this OverlongNode state holds its pending chunks as tokens (saved by a graph with "
                                 "a node stage); the contiguous path re-reads them by reference only")
            return
        chunks = self.replay(split.at)
        if len(chunks) != split.count or int(chunks["length"].sum()) != split.tokens:
            raise ValueError(f"split sample at {split.at} re-read as {len(chunks)} chunks, {split.count} when the "
                             f"state was saved: the shard changed, or a stage is not a pure function")
        self._split = split
        self.pending = chunks[split.next:]

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` rows (fewer only when the stream ended)."""
        parts = []
        if len(self.pending):
            parts.append(self.pending[:n])
            self.pending = self.pending[n:]
        have = sum(len(p) for p in parts)
        while have < n:
            run = self.source.run()
            if run is None:
                break
            rows, last_count = self._pull(run, n - have)
            parts.append(rows[:n - have])
            self.pending = rows[n - have:]
            have += min(len(rows), n - have)
            if len(self.pending):
                self._split = Split(at=_position(rows[-1]), next=0, count=last_count,
                                    tokens=int(rows["length"][-last_count:].sum()))
        if len(parts) == 1:
            return parts[0]
        return cat(parts)

    def _pull(self, run: DocRun, want: int) -> tuple[np.ndarray, int]:
        """Consume the documents of ``run`` the per-sample node would pull to give ``want`` rows;
        their rows, and the chunk count of the last one."""
        lengths = run.block.lengths[run.lo:run.hi]
        counts = chunk_counts(lengths, self.max_len, self.policy)
        k = 1 if run.consumed else min(int(np.searchsorted(np.cumsum(counts), want)) + 1, len(run))
        over = lengths[:k] > self.max_len
        bad = int(over.argmax()) if self.policy == "error" and over.any() else -1
        if bad >= 0:
            k = bad + 1
        if not run.consumed:
            self.source.consume(k)
        rows = base_rows(run, k, self.store)
        last = Pulled(**{name: int(rows[-1][name]) for name in PULLED_FIELDS})
        self._last[last.source] = last
        if bad >= 0:
            key = run.block.key(run.lo + bad)
            raise ValueError(f"sample {run.block.url + '#' + key if run.block.url else key!r} has {int(lengths[bad])} "
                             f"tokens, more than the capacity {self.max_len} (overlong='error'; use 'split', 'truncate' "
                             f"or 'drop')")
        if over.any():
            self._count(lengths[:k][over], counts[:k][over])
        out, counts = expand(rows, self.max_len, self.policy)
        return out, int(counts[-1])

    def _count(self, lengths: np.ndarray, counts: np.ndarray) -> None:
        c, n, total = self.counters, len(lengths), int(lengths.sum())
        if self.policy == "split":
            c.samples_split += n
            c.tokens_split += total
            c.chunks_created += int(counts.sum())
        elif self.policy == "truncate":
            c.samples_truncated += n
            c.tokens_truncated += total - n * self.max_len
        elif self.policy == "drop":
            c.samples_dropped += n
            c.tokens_dropped += total

    def next(self) -> np.ndarray:
        rows = self.take(1)
        if not len(rows):
            raise StopIteration
        return rows

    def get_state(self) -> dict[str, Any]:
        if len(self.pending) and self._split is not None:
            pending = replace(self._split, next=self._split.count - len(self.pending)).to_state()
        else:
            pending = samples_to_state([])
        return {self.KIND_KEY: self.KIND, self.SOURCE_KEY: self.source.state_dict(), self.PENDING_KEY: pending,
                self.COUNTERS_KEY: record_text(self.counters.as_dict()),
                self.LAST_KEY: pulled_to_state(self._last.values())}


def _position(row: np.void) -> Position:
    return Position(**{name: int(row[name]) for name in POSITION_FIELDS})


assert OVERLONG_POLICIES == ("split", "truncate", "drop", "error")
__all__ = ["ChunkNode", "base_rows", "chunk_counts", "expand"]
