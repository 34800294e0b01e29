"""Documents as table rows: what the contiguous fast path moves instead of Sample objects.

Between the block reader and the collate, a document is one row of :data:`ROW` (a structured
numpy dtype: every field named, 96 bytes): its length, its origin (exactly the fields of a
:class:`~streampack.sample.SampleOrigin`, so a resume state refers to it the same way) and
where its ids are (``block``: an id in a :class:`BlockStore`; ``doc``: its index in that
block; ``start``: its first id's element offset, a chunk's included). A window of 1,024
documents is one array; taking, splitting and regrouping documents are whole-array
operations.

:class:`PackRows` is one pack as the packer emits it: its rows in layout order and the blocks
they point into (so the collate never looks a block up in a store that has moved on).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from streampack.io.token_block import TokenBlock
from streampack.sample import Sample, SampleOrigin
from streampack.state import REF_COLUMNS

ROW = np.dtype([(name, np.int64) for name in (
    "length", "source", "shard", "offset", "number", "next_offset", "next_number", "epoch", "chunk",
    "block", "doc", "start")] + [("cut", np.int64)])
"""One document: ``length``; its origin (``source`` .. ``chunk``, as ``SampleOrigin``); where its
ids are (``block``, ``doc``, ``start``); ``cut``: 1 when the overlong policy split it (its key
then ends in ``/<chunk>``)."""
_REF = list(REF_COLUMNS)


def rows_of(n: int) -> np.ndarray:
    return np.zeros(n, dtype=ROW)


def ref_table(rows: np.ndarray) -> np.ndarray:
    """int64 ``[n, 7]``: each row as a reference (``state.REF_COLUMNS``)."""
    out = np.empty((rows.shape[0], len(_REF)), dtype=np.int64)
    for j, name in enumerate(_REF):
        out[:, j] = rows[name]
    return out


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
        ids = set(np.unique(np.concatenate([r["block"] for r in live])).tolist()) if live else set()
        if self._last is not None:
            ids.add(self._last[1])
        for bid in [b for b in self.blocks if b not in ids]:
            del self.blocks[bid]

    def subset(self, rows: np.ndarray) -> dict[int, TokenBlock]:
        return {bid: self.blocks[bid] for bid in np.unique(rows["block"]).tolist()}


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class PackRows:
    """One pack: its documents' rows in layout order and the blocks they point into."""

    rows: np.ndarray
    blocks: Mapping[int, TokenBlock]
    rich: bool = False
    """A document may carry labels, a loss mask, extras or images (it came from the per-sample
    reader): the collate lays the pack out as the per-sample path does."""

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def doc_keys(self) -> list[str]:
        """Each document's ``url#key`` (``/<chunk>`` added for a split chunk), as the per-sample
        path's ``Sample.doc_key``."""
        out = []
        blocks = self.blocks
        for bid, doc, cut, chunk in zip(self.rows["block"].tolist(), self.rows["doc"].tolist(),
                                        self.rows["cut"].tolist(), self.rows["chunk"].tolist()):
            block = blocks[bid]
            key = block.key(doc)
            out.append(f"{block.url}#{key}/{chunk}" if cut else f"{block.url}#{key}")
        return out

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


__all__ = ["ROW", "BlockStore", "PackRows", "ref_table", "rows_of"]
