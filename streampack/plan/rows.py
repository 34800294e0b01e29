"""Documents as table rows: what the contiguous fast path moves instead of Sample objects.

Between the block reader and the collate, a document is one row of an int64 ``[n, 13]`` table
whose columns are named by :data:`COLUMNS` (constants ``LENGTH`` .. ``CUT`` index them): its
length, its origin (exactly the fields of a :class:`~streampack.sample.SampleOrigin`, so a
resume state refers to it the same way) and where its ids are (``BLOCK``: an id in a
:class:`BlockStore`; ``DOC``: its index in that block; ``START``: its first id's element offset,
a chunk's included). A window of 1,024 documents is one array; taking, splitting and regrouping
documents are whole-array operations. (A structured dtype read the same, but numpy concatenates
those through Python: ~60 µs a call, 0.05 s of a 4M-token epoch.)

:class:`PackRows` is one pack as the packer emits it: its rows in layout order and the blocks
they point into (so the collate never looks a block up in a store that has moved on).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from streampack.io.token_block import TokenBlock
from streampack.plan.state import REF_COLUMNS
from streampack.sample import Sample, SampleOrigin

COLUMNS = ("length", "source", "shard", "offset", "number", "next_offset", "next_number", "epoch", "chunk",
           "block", "doc", "start", "cut")
"""One document: ``length``; its origin (``source`` .. ``chunk``, as ``SampleOrigin``); where its
ids are (``block``, ``doc``, ``start``); ``cut``: 1 when the overlong policy split it (its key
then ends in ``/<chunk>``)."""
LENGTH, SOURCE, SHARD, OFFSET, NUMBER, NEXT_OFFSET, NEXT_NUMBER, EPOCH, CHUNK, BLOCK, DOC, START, CUT = range(13)
_REF = [COLUMNS.index(c) for c in REF_COLUMNS]
UNREAD = -1
"""``BLOCK`` of a row known only by its reference (a restored window's document, not re-read yet)."""


def unread_rows(refs: np.ndarray, policy: str) -> np.ndarray:
    """Rows of references (``state.REF_COLUMNS``) whose ids are not read yet: what the packer
    needs (length, origin) is in the reference; ``CUT`` follows the chunk and ``policy``."""
    rows = np.zeros((refs.shape[0], len(COLUMNS)), dtype=np.int64)
    rows[:, _REF] = refs
    rows[:, BLOCK] = rows[:, DOC] = rows[:, START] = UNREAD
    rows[:, CUT] = (rows[:, CHUNK] >= 0) & (policy == "split")
    return rows


def rows_of(n: int) -> np.ndarray:
    return np.zeros((n, len(COLUMNS)), dtype=np.int64)


def ref_table(rows: np.ndarray) -> np.ndarray:
    """int64 ``[n, 7]``: each row as a reference (``state.REF_COLUMNS``)."""
    return np.ascontiguousarray(rows[:, _REF])


class BlockStore:
    """The token blocks rows point into, by id. Ids only grow; :meth:`keep` drops the blocks no
    live row points into (the packer calls it once per round)."""

    def __init__(self) -> None:
        self.blocks: dict[int, TokenBlock] = {}
        self._next = 0
        self._last: tuple[TokenBlock, int] | None = None

    def add(self, block: TokenBlock) -> int:
        """The id of ``block`` (a new one unless it is the block added last)."""
        if self._last is not None and self._last[0] is block:
            return self._last[1]
        bid = self._next
        self._next += 1
        self.blocks[bid] = block
        self._last = (block, bid)
        return bid

    def keep(self, *live: np.ndarray) -> None:
        """Forget every block but the ones ``live`` rows point into and the last added."""
        ids = {b for r in live for b in set(r[:, BLOCK].tolist())}  # UNREAD names no block
        if self._last is not None:
            ids.add(self._last[1])
        for bid in [b for b in self.blocks if b not in ids]:
            del self.blocks[bid]

    def subset(self, rows: np.ndarray) -> dict[int, TokenBlock]:
        return {bid: self.blocks[bid] for bid in set(rows[:, BLOCK].tolist()) if bid != UNREAD}


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class PackRows:
    """One pack: its documents' rows in layout order, the blocks they point into, and what the
    collate reads per document as Python lists (made for a whole round at once: :func:`make_packs`)."""

    rows: np.ndarray
    blocks: Mapping[int, TokenBlock]
    keys: list[str] = field(default_factory=list)
    """Each document's ``url#key`` (``/<chunk>`` added for a split chunk): ``Sample.doc_key``."""
    sources: list[np.ndarray] = field(default_factory=list)
    """The token array each document is a slice of."""
    starts: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    tokens: int = 0
    """Real tokens (the sum of its lengths)."""
    aligned: int = 0
    """Tokens after each document's alignment."""
    rich: bool = False
    """A document may carry labels, a loss mask, extras or images (it came from the per-sample
    reader): the collate lays the pack out as the per-sample path does."""
    lazy: bool = False
    """Some rows are references not yet re-read (``BLOCK`` is :data:`UNREAD`): a restored
    packer re-reads them when the pack is about to leave."""

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def doc_keys(self) -> list[str]:
        return self.keys

    def samples(self) -> list[Sample]:
        """The pack as the per-sample path's Samples (what a filler or a rich batch is laid out from)."""
        out = []
        for row in self.rows.tolist():
            length, source, shard, offset, number, next_offset, next_number, epoch, chunk, bid, doc, start, cut = row
            block = self.blocks[bid]
            origin = SampleOrigin(shard=shard, offset=offset, number=number, next_offset=next_offset,
                                  next_number=next_number, epoch=epoch, source=source, chunk=chunk)
            key = f"{block.key(doc)}/{chunk}" if cut else block.key(doc)
            if block.samples is None:
                out.append(Sample(key=key, url=block.url, tokens=block.tokens[start:start + length].astype(np.int64),
                                  origin=origin))
                continue
            s = block.samples[doc]
            lo = start - int(block.starts[doc])

            def part(a: np.ndarray | None, lo: int = lo, n: int = length) -> np.ndarray | None:
                return None if a is None else a[lo:lo + n]

            out.append(Sample(key=key, url=s.url, tokens=s.tokens[lo:lo + length], labels=part(s.labels),
                              loss_mask=part(s.loss_mask), extras={k: v[lo:lo + length] for k, v in s.extras.items()},
                              images=s.images, origin=origin))
        return out


def make_packs(rows: np.ndarray, sizes: list[int], blocks: Mapping[int, TokenBlock], *, align: int,
               rich: bool) -> list[PackRows]:
    """The packs of one round: ``rows`` holds them back to back, ``sizes[j]`` documents each.
    Every per-document list is made in one pass over the round (keys, token arrays, starts,
    lengths) and each pack's token sums in one ``reduceat``."""
    if not len(rows):
        return [PackRows(rows=rows, blocks=blocks) for _ in sizes]
    bounds = np.cumsum([0] + sizes).tolist()
    cut = bounds[:-1]
    tokens = np.add.reduceat(rows[:, LENGTH], cut).tolist()
    aligned = np.add.reduceat(-(-rows[:, LENGTH] // align) * align, cut).tolist()
    if (rows[:, BLOCK] == UNREAD).any():  # a restored window: the packer re-reads these when they leave
        return [PackRows(rows=rows[lo:hi], blocks=blocks, tokens=tokens[j], aligned=aligned[j], lazy=True)
                for j, (lo, hi) in enumerate(zip(cut, bounds[1:]))]
    bids, docs = rows[:, BLOCK].tolist(), rows[:, DOC].tolist()
    lists = {b: blocks[b].doc_keys() for b in set(bids)}
    arrays = {b: blocks[b].tokens for b in lists}
    if rows[:, CUT].any():
        keys = [f"{lists[b][d]}/{c}" if cut else lists[b][d]
                for b, d, cut, c in zip(bids, docs, rows[:, CUT].tolist(), rows[:, CHUNK].tolist())]
    else:
        keys = [lists[b][d] for b, d in zip(bids, docs)]
    sources = [arrays[b] for b in bids]
    starts, lengths = rows[:, START].tolist(), rows[:, LENGTH].tolist()
    return [PackRows(rows=rows[lo:hi], blocks=blocks, keys=keys[lo:hi], sources=sources[lo:hi], starts=starts[lo:hi],
                     lengths=lengths[lo:hi], tokens=tokens[j], aligned=aligned[j], rich=rich)
            for j, (lo, hi) in enumerate(zip(cut, bounds[1:]))]


__all__ = ["COLUMNS", "UNREAD", "BlockStore", "PackRows", "make_packs", "ref_table", "rows_of", "unread_rows"]
