"""Documents as table rows: the one form a document travels in from the overlong node to the collate.

A document is one record of a structured array of :data:`ROW` (13 int64 fields, read by name: ``rows["length"]``):
its length, its origin (the fields of a :class:`~streampack.sample.SampleOrigin`, so a resume state refers to it the
same way) and where its ids are (``block``: an id in a :class:`BlockStore`; ``doc``: its index in that block;
``start``: its first id's element offset, a chunk's included). Documents read as blocks point into the block they
were read in; documents that arrive as Samples point into a block made of those Samples (:func:`sample_rows`), which
keeps each Sample whole for the collate. Taking, splitting and regrouping documents are whole-array operations; what
numpy does record by record on a structured array (``concatenate``: ~110 µs for 1,300 rows against ~5; a fancy
``take``: ~60 µs against ~11) goes through the plain int64 view of the same memory (:func:`cat`, :func:`take`,
:func:`put`, :func:`repeat`). :class:`PackRows` is one pack as the packer emits it: its rows in layout order and the
blocks they point into (so the collate never looks a block up in a store that has moved on).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from streampack.io.token_block import TokenBlock
from streampack.plan.state import REF, REF_COLUMNS
from streampack.sample import Sample, SampleOrigin

COLUMNS = ("length", "source", "shard", "offset", "number", "next_offset", "next_number", "epoch", "chunk",
           "block", "doc", "start", "cut")
"""One document: ``length``; its origin (``source`` .. ``chunk``, as ``SampleOrigin``); where its
ids are (``block``, ``doc``, ``start``); ``cut``: 1 when the overlong policy split it (its key
then ends in ``/<chunk>``)."""
ROW = np.dtype([(name, np.int64) for name in COLUMNS])
"""The record of one document (the fields of :data:`COLUMNS`)."""
_PLAIN = (np.int64, len(COLUMNS))  # the same memory as an int64 [n, 13] matrix, for whole-row copies
UNREAD = -1
"""``block`` of a row known only by its reference (a restored window's document, not re-read yet)."""
NO_ORIGIN = -1
"""``shard`` of a row whose Sample has no origin (made by a stage or by hand): it is carried in a
state by its tokens, never by reference."""


def rows_of(n: int) -> np.ndarray:
    return np.zeros(n, dtype=ROW)


def _plain(rows: np.ndarray) -> np.ndarray:
    return rows.view(_PLAIN) if rows.flags.c_contiguous else np.ascontiguousarray(rows).view(_PLAIN)


def _records(plain: np.ndarray) -> np.ndarray:
    return plain.view(ROW).reshape(-1)


def cat(parts: Sequence[np.ndarray]) -> np.ndarray:
    """``np.concatenate`` of row arrays, at a plain matrix's speed."""
    parts = [p for p in parts if p.shape[0]]  # an empty one may have strides no view accepts
    return _records(np.concatenate([_plain(p) for p in parts])) if parts else rows_of(0)


def take(rows: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``rows[index]`` (integer or boolean ``index``), at a plain matrix's speed."""
    return _records(_plain(rows)[index])


def put(rows: np.ndarray, index: np.ndarray, values: np.ndarray) -> None:
    """``rows[index] = values``, at a plain matrix's speed (``rows`` C-contiguous)."""
    _plain(rows)[index] = _plain(values)


def repeat(rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Row ``i`` of ``rows`` ``counts[i]`` times, in order."""
    return _records(np.repeat(_plain(rows), counts, axis=0))


def unread_rows(refs: np.ndarray, policy: str) -> np.ndarray:
    """Rows of references (an array of ``state.REF``) whose ids are not read yet: what the packer
    needs (length, origin) is in the reference; ``cut`` follows the chunk and ``policy``."""
    rows = rows_of(refs.shape[0])
    for name in REF_COLUMNS:
        rows[name] = refs[name]
    rows["block"] = rows["doc"] = rows["start"] = UNREAD
    rows["cut"] = (rows["chunk"] >= 0) & (policy == "split")
    return rows


def block_rows(block: TokenBlock, docs: slice | np.ndarray, store: BlockStore, *, source: int, shard: int,
               epoch: int = 0) -> np.ndarray:
    """Documents ``docs`` of ``block`` (a slice on the reading path, indices on a re-read) as
    whole-document rows: chunk -1, pointing into ``block`` (added to ``store``)."""
    rows = rows_of(len(block.lengths[docs]))
    rows["length"] = block.lengths[docs]
    rows["source"], rows["shard"], rows["epoch"], rows["chunk"] = source, shard, epoch, -1
    rows["offset"], rows["number"] = block.offsets[docs], block.numbers[docs]
    rows["next_offset"], rows["next_number"] = block.next_offsets[docs], block.next_numbers[docs]
    rows["block"] = store.add(block)
    rows["doc"] = np.arange(docs.start, docs.stop) if isinstance(docs, slice) else docs
    rows["start"] = block.starts[docs]
    return rows


def sample_rows(samples: Sequence[Sample], store: BlockStore) -> np.ndarray:
    """Rows of ``samples`` (each one document, as the overlong policy left it), pointing into
    one new block of them: their origins become the rows' origin fields."""
    rows = block_rows(TokenBlock.of_samples(list(samples), done=False), slice(0, len(samples)), store, source=0,
                      shard=0)
    rows["source"], rows["shard"], rows["epoch"], rows["chunk"] = np.array(
        [(o.source, o.shard, o.epoch, o.chunk) if o is not None else (0, NO_ORIGIN, 0, -1) for o in
         (s.origin for s in samples)], dtype=np.int64).reshape(-1, 4).T
    return rows


def ref_table(rows: np.ndarray) -> np.ndarray:
    """Each row's reference (an array of ``state.REF``)."""
    out = np.empty(rows.shape[0], dtype=REF)
    for name in REF_COLUMNS:
        out[name] = rows[name]
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
        ids = {b for r in live for b in set(r["block"].tolist())}  # UNREAD names no block
        if self._last is not None:
            ids.add(self._last[1])
        for bid in [b for b in self.blocks if b not in ids]:
            del self.blocks[bid]

    def subset(self, rows: np.ndarray) -> dict[int, TokenBlock]:
        return {bid: self.blocks[bid] for bid in set(rows["block"].tolist()) if bid != UNREAD}


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
    """Some document arrived as a Sample (it may carry labels, a loss mask, extras or images): the
    collate lays the pack out from :meth:`samples`."""
    lazy: bool = False
    """Some rows are references not yet re-read (``block`` is :data:`UNREAD`): a restored
    packer re-reads them when the pack is about to leave."""

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.samples())

    def samples(self) -> list[Sample]:
        """The pack as Samples (what ``pack_batch`` lays out a batch with a Sample-borne document from)."""
        out = []
        for values in _plain(self.rows).tolist():
            r = dict(zip(COLUMNS, values))  # by name: a tuple unpack would silently follow the field order
            length, chunk, doc, start = r["length"], r["chunk"], r["doc"], r["start"]
            block = self.blocks[r["block"]]
            origin = None if r["shard"] == NO_ORIGIN else SampleOrigin(
                shard=r["shard"], offset=r["offset"], number=r["number"], next_offset=r["next_offset"],
                next_number=r["next_number"], epoch=r["epoch"], source=r["source"], chunk=chunk)
            key = f"{block.key(doc)}/{chunk}" if r["cut"] else block.key(doc)
            if block.samples is None:
                out.append(Sample(key=key, url=block.url, tokens=block.tokens[start:start + length].astype(np.int64),
                                  origin=origin))
                continue
            s = block.samples[doc]
            lo = start - int(block.starts[doc])
            if not r["cut"] and lo == 0 and length == len(s):  # the Sample as it arrived
                out.append(s)
                continue

            def part(a: np.ndarray | None, lo: int = lo, n: int = length) -> np.ndarray | None:
                return None if a is None else a[lo:lo + n]

            out.append(Sample(key=key, url=s.url, tokens=s.tokens[lo:lo + length], labels=part(s.labels),
                              loss_mask=part(s.loss_mask), extras={k: v[lo:lo + length] for k, v in s.extras.items()},
                              images=s.images, origin=origin))
        return out


def make_packs(rows: np.ndarray, sizes: list[int], blocks: Mapping[int, TokenBlock], *, align: int) -> list[PackRows]:
    """The packs of one round: ``rows`` holds them back to back, ``sizes[j]`` documents each.
    Every per-document list is made in one pass over the round (keys, token arrays, starts,
    lengths) and each pack's token sums in one ``reduceat``."""
    if not len(rows):
        return [PackRows(rows=rows, blocks=blocks) for _ in sizes]
    bounds = np.cumsum([0] + sizes).tolist()
    cut = bounds[:-1]
    tokens = np.add.reduceat(rows["length"], cut).tolist()
    aligned = np.add.reduceat(-(-rows["length"] // align) * align, cut).tolist()
    if (rows["block"] == UNREAD).any():  # a restored window: the packer re-reads these when they leave
        return [PackRows(rows=rows[lo:hi], blocks=blocks, tokens=tokens[j], aligned=aligned[j], lazy=True)
                for j, (lo, hi) in enumerate(zip(cut, bounds[1:]))]
    bids, docs = rows["block"].tolist(), rows["doc"].tolist()
    rich = any(blocks[b].samples is not None for b in set(bids))
    lists = {b: blocks[b].doc_keys() for b in set(bids)}
    arrays = {b: blocks[b].tokens for b in lists}
    if rows["cut"].any():
        keys = [f"{lists[b][d]}/{c}" if cut else lists[b][d]
                for b, d, cut, c in zip(bids, docs, rows["cut"].tolist(), rows["chunk"].tolist())]
    else:
        keys = [lists[b][d] for b, d in zip(bids, docs)]
    sources = [arrays[b] for b in bids]
    starts, lengths = rows["start"].tolist(), rows["length"].tolist()
    return [PackRows(rows=rows[lo:hi], blocks=blocks, keys=keys[lo:hi], sources=sources[lo:hi], starts=starts[lo:hi],
                     lengths=lengths[lo:hi], tokens=tokens[j], aligned=aligned[j], rich=rich)
            for j, (lo, hi) in enumerate(zip(cut, bounds[1:]))]


__all__ = ["COLUMNS", "NO_ORIGIN", "ROW", "UNREAD", "BlockStore", "PackRows", "block_rows", "cat", "make_packs", "put",
           "ref_table", "repeat", "rows_of", "sample_rows", "take", "unread_rows"]
