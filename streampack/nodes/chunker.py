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

from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from streampack.nodes.block_reader import BlockReader, DocRun
from streampack.nodes.overlong import OverlongCounters, OverlongNode
from streampack.options.packing import OVERLONG_POLICIES
from streampack.plan.rows import (
    BLOCK,
    CHUNK,
    CUT,
    DOC,
    EPOCH,
    LENGTH,
    NEXT_NUMBER,
    NEXT_OFFSET,
    NUMBER,
    OFFSET,
    SHARD,
    SOURCE,
    START,
    BlockStore,
    rows_of,
)
from streampack.plan.state import record_of, record_text, samples_from_state, samples_to_state

_LAST = [SOURCE, SHARD, EPOCH, OFFSET, NUMBER, NEXT_OFFSET, NEXT_NUMBER]  # OverlongNode.LAST_COLUMNS


def base_rows(run: DocRun, k: int, store: BlockStore) -> np.ndarray:
    """The first ``k`` documents of ``run`` as rows (whole documents: chunk -1)."""
    block, lo = run.block, run.lo
    rows = np.empty((k, CUT + 1), dtype=np.int64)
    rows[:, LENGTH] = block.lengths[lo:lo + k]
    rows[:, SOURCE], rows[:, SHARD], rows[:, EPOCH] = run.source, run.shard, run.epoch
    rows[:, OFFSET] = block.offsets[lo:lo + k]
    rows[:, NUMBER] = block.numbers[lo:lo + k]
    rows[:, NEXT_OFFSET] = block.next_offsets[lo:lo + k]
    rows[:, NEXT_NUMBER] = block.next_numbers[lo:lo + k]
    rows[:, CHUNK] = -1
    rows[:, BLOCK] = store.add(block)
    rows[:, DOC] = np.arange(lo, lo + k)
    rows[:, START] = block.starts[lo:lo + k]
    rows[:, CUT] = 0
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
    lengths = rows[:, LENGTH]
    counts = chunk_counts(lengths, max_len, policy)
    over = lengths > max_len
    if not over.any():
        return rows, counts
    out = np.repeat(rows, counts, axis=0)
    mine = np.repeat(over, counts)
    if policy == "truncate":
        out[mine, CHUNK] = 0
        out[mine, LENGTH] = max_len
        return out, counts
    # split: chunk j of a document starts j * max_len tokens in
    j = np.arange(out.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)
    out[:, CHUNK] = np.where(mine, j, out[:, CHUNK])
    out[:, START] += np.where(mine, j * max_len, 0)
    out[:, LENGTH] = np.where(mine, np.minimum(max_len, out[:, LENGTH] - j * max_len), out[:, LENGTH])
    out[:, CUT] = mine
    return out, counts


class ChunkNode(BaseNode[np.ndarray]):
    """Rows of at most ``max_len`` tokens after ``policy`` (see the module docstring).
    ``replay(ref)`` re-reads every chunk of the sample at ``[source, shard, offset, number,
    epoch]`` as rows (a :class:`~streampack.plan.row_replay.RowReplay`'s ``chunks``)."""

    SOURCE_KEY, PENDING_KEY, COUNTERS_KEY, LAST_KEY = (OverlongNode.SOURCE_KEY, OverlongNode.PENDING_KEY,
                                                       OverlongNode.COUNTERS_KEY, OverlongNode.LAST_KEY)
    KIND_KEY, KIND = OverlongNode.KIND_KEY, OverlongNode.KIND

    def __init__(self, source: BlockReader, max_len: int, policy: str = "split", *, replay: Any, store: BlockStore) -> None:
        super().__init__()
        # max_len and policy come checked (StreamConfig.capacity, PackOptions.overlong): only the
        # graph builder makes this node
        self.source, self.max_len, self.policy, self.replay, self.store = source, max_len, policy, replay, store
        self._clear()

    def _clear(self) -> None:
        self.counters = OverlongCounters()
        self.pending = rows_of(0)
        self._split: tuple[list[int], int, int] | None = None  # ref, chunks, tokens of the sample split
        self._last: dict[int, list[int]] = {}

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._clear()
        if initial_state is None:
            self.source.reset(None)
            return
        self.source.reset(initial_state[self.SOURCE_KEY])
        self.counters = OverlongCounters(**record_of(initial_state[self.COUNTERS_KEY]))
        self._last = {row[0]: row for row in initial_state[self.LAST_KEY].tolist()}
        pending = initial_state[self.PENDING_KEY]
        if "ref" not in pending:
            samples = samples_from_state(pending)
            if samples:
                raise ValueError("this OverlongNode state holds its pending chunks as tokens (saved by a graph with "
                                 "a node stage); the contiguous path re-reads them by reference only")
            return
        ref, nxt, count, tokens = pending["ref"].tolist(), pending["next"], pending["count"], pending["tokens"]
        chunks = self.replay(ref)
        if len(chunks) != count or int(chunks[:, LENGTH].sum()) != tokens:
            raise ValueError(f"split sample at {ref} re-read as {len(chunks)} chunks, {count} when the state "
                             f"was saved: the shard changed, or a stage is not a pure function")
        self._split = (ref, count, tokens)
        self.pending = chunks[nxt:]

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
                r = rows[-1].tolist()
                self._split = ([r[SOURCE], r[SHARD], r[OFFSET], r[NUMBER], r[EPOCH]], last_count,
                               int(rows[-last_count:, LENGTH].sum()))
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else rows_of(0)

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
        last = rows[-1, _LAST].tolist()
        self._last[last[0]] = last
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
        import torch

        last = [self._last[s] for s in sorted(self._last)]
        if len(self.pending) and self._split is not None:
            ref, count, tokens = self._split
            pending: dict[str, Any] = {"ref": torch.tensor(ref, dtype=torch.int64), "next": count - len(self.pending),
                                       "count": count, "tokens": tokens}
        else:
            pending = samples_to_state([])
        return {self.KIND_KEY: self.KIND, self.SOURCE_KEY: self.source.state_dict(), self.PENDING_KEY: pending,
                self.COUNTERS_KEY: record_text(self.counters.as_dict()),
                self.LAST_KEY: torch.tensor(last, dtype=torch.int64).reshape(-1, len(OverlongNode.LAST_COLUMNS))}


assert OVERLONG_POLICIES == ("split", "truncate", "drop", "error")
__all__ = ["ChunkNode", "base_rows", "chunk_counts", "expand"]
