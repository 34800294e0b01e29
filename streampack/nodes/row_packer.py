"""RowPacker: the window packer on document rows, for the contiguous fast path.

The rounds of :class:`~streampack.nodes.window_packer.WindowPacker` — refill to the round's
size, pack once with the registry algorithm, emit the packs the rules choose in the
``(seed, round)`` order, carry the rest — run here on a table of rows
(:mod:`streampack.plan.rows`) with the very same functions (``window_rounds.pack_round``,
``choose``, ``emission_order``), so the packs are the WindowPacker's, pack for pack. What
changes is the cost: the window is one array (a refill is one ``take`` from the
:class:`~streampack.nodes.chunker.ChunkNode`, a pack one fancy index), and a pack leaves as a
:class:`~streampack.plan.rows.PackRows` for the collate to copy from. Its state is a
WindowPacker state (kind, keys, reference table, pack sizes, round): either path restores the
other's. Cost-balanced emission (``balance``) stays on the WindowPacker: the graph builder
takes this packer only without it.

A restore does not re-read the window at once: the saved references become rows whose ids are
not read yet (``rows.UNREAD``; the packer needs lengths only), every shard they point into is
checked at the restore, and a pack's documents are re-read when it is about to leave,
:data:`READ_AHEAD` packs at a time (only those documents: :mod:`~streampack.plan.row_replay`).
So the first batch after a restore waits for its own ~55 documents, not the window's ~1,000
(``torch.load`` to first batch 21-28 ms here, where reading the whole window took ~35). A document that no longer re-reads as saved (a shard changed under an
identity that does not see it) raises when its pack is about to leave, not at the restore.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from streampack.nodes.chunker import ChunkNode
from streampack.nodes.window_packer import _METRIC_NAMES, WindowPacker
from streampack.packing.window_rounds import PackerRules, aligned_lengths, choose, emission_order, pack_round
from streampack.plan.row_replay import RowReplay
from streampack.plan.rows import (
    UNREAD,
    BlockStore,
    PackRows,
    cat,
    make_packs,
    put,
    ref_table,
    rows_of,
    take,
    unread_rows,
)
from streampack.plan.state import (
    record_of,
    record_text,
    refs_table,
    samples_from_state,
    table_refs,
    table_size,
    table_slice,
)

W = WindowPacker
READ_AHEAD = 8
"""Restored packs re-read at once (a batch of 8 packs): the first batch after a restore reads its
own ~55 documents, not the whole window (~1,000 documents from ~11 shards: 24-30 ms of a ~35 ms
resume on the loaded box); 16 cost the first batch ~1.5x the reads."""


class RowPacker(BaseNode[PackRows]):
    """Packs the rows of ``source``; yields one :class:`PackRows` per ``next``. Arguments as
    WindowPacker's (``rules`` from ``StreamConfig.packer_rules``; ``replay``: a :class:`RowReplay`;
    ``carry``: a reference table the window starts with)."""

    undelivered = WindowPacker.undelivered
    """What a saved state had not delivered (one layout for both packers: ``WindowPacker.undelivered``)."""

    def __init__(self, source: ChunkNode, *, rules: PackerRules, shuffle: bool = True, replay: RowReplay,
                 store: BlockStore, carry: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.source, self.replay, self.store, self.initial_carry = source, replay, store, carry
        self.rules = rules
        self.capacity, self.align, self.shuffle = rules.capacity, rules.align, shuffle
        self.reservoir = None  # no cost-balanced emission on this path
        self._clear()

    def _clear(self) -> None:
        self._carry = rows_of(0)
        self._entered = np.zeros(0, dtype=np.int64)
        self._round_rows = rows_of(0)  # every document of this round's packs, pack after pack
        self._packs: list[PackRows] = []
        self._sizes: list[int] = []
        self._emitted = 0
        self._round = 0
        self._cache: dict[str, Any] | None = None
        self.metrics = dict.fromkeys(_METRIC_NAMES, 0)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._clear()
        self.replay.forget()
        if initial_state is None:
            self.source.reset(None)
            if self.initial_carry is not None and table_size(self.initial_carry):
                self._carry = self._rows(self.initial_carry)
                self._entered = np.zeros(len(self._carry), dtype=np.int64)
            return
        if W.RESERVOIR_KEY in initial_state:
            raise ValueError("WindowPacker state saved with balance on restored into a packer with balance off")
        self.source.reset(initial_state[W.SOURCE_KEY])
        table, sizes = initial_state[W.TABLE_KEY], initial_state[W.SIZES_KEY].tolist()
        emitted = int(initial_state[W.EMITTED_KEY])
        start = sum(sizes[:emitted])
        rest = self._rows(table_slice(table, start, table_size(table)))
        self._set_packs(rest[:sum(sizes) - start], sizes, emitted)
        self._carry = rest[sum(sizes) - start:]
        self._entered = initial_state[W.ENTERED_KEY].numpy().astype(np.int64)
        self._round, self._emitted = int(initial_state[W.ROUND_KEY]), emitted
        kept = (W.SOURCE_KEY, W.TABLE_KEY, W.SIZES_KEY, W.ENTERED_KEY, W.ROUND_KEY)
        self._cache = {k: initial_state[k] for k in kept}
        self.metrics = record_of(initial_state[W.METRICS_KEY])

    def _rows(self, table: Mapping[str, Any]) -> np.ndarray:
        """A reference table's rows, not re-read yet: every shard they point into is checked now
        (a changed shard is refused at the restore, as on the per-sample path); each pack's
        documents are re-read when it is about to leave (:meth:`_read_ahead`), so the first batch
        after a restore waits for its own documents only. Tokens stored instead of references
        are refused (the contiguous path never saves them)."""
        if samples_from_state(table["stored"]):
            raise ValueError("this WindowPacker state holds carried samples as tokens (saved by a graph with a node "
                             "stage); the contiguous path re-reads them by reference only")
        if not table_size(table):
            return rows_of(0)
        refs = table_refs(table)
        self.replay.verify(refs)
        return unread_rows(refs, self.replay.spec.policy)

    def _set_packs(self, rows: np.ndarray, sizes: list[int], emitted: int) -> None:
        """This round's packs: ``sizes`` documents each, the first ``emitted`` already out
        (``rows`` holds the others, in order)."""
        blocks = self.store.subset(rows) if len(rows) else {}
        self._sizes = list(sizes)
        self._packs = [PackRows(rows=rows_of(0), blocks={}) for _ in range(emitted)]
        self._packs += make_packs(rows, list(sizes[emitted:]), blocks, align=self.align, rich=_rich(blocks))
        self._round_rows = rows

    def next(self) -> PackRows:
        if self._emitted >= len(self._packs):
            self._run_round()
            if not self._packs:
                raise StopIteration
        pack = self._packs[self._emitted]
        if pack.lazy:
            pack = self._read_ahead(self._emitted)
        self._emitted += 1
        m = self.metrics
        m["packs"] += 1
        m["docs"] += len(pack)
        m["slots"] += self.capacity
        m["tokens"] += pack.tokens
        m["aligned_tokens"] += pack.aligned
        return pack

    def _read_ahead(self, at: int) -> PackRows:
        """Re-read the documents of the next :data:`READ_AHEAD` restored packs from ``at`` (one
        replay: the block reads of one cluster serve all of them); returns pack ``at``."""
        end = min(at + READ_AHEAD, len(self._packs))
        todo = [j for j in range(at, end) if self._packs[j].lazy]
        rows = cat([self._packs[j].rows for j in todo])
        unread = rows["block"] == UNREAD
        put(rows, unread, self.replay(ref_table(take(rows, unread))))
        blocks = {k: v for j in todo for k, v in self._packs[j].blocks.items()}  # the documents read since
        blocks.update(self.store.subset(take(rows, unread)))
        packs = make_packs(rows, [len(self._packs[j]) for j in todo], blocks, align=self.align, rich=_rich(blocks))
        for j, pack in zip(todo, packs):
            self._packs[j] = pack
        if not any(p.lazy for p in self._packs[end:]) and not (self._carry["block"] == UNREAD).any():
            self.replay.forget()  # every carried document is read again
        return self._packs[at]

    def get_state(self) -> dict[str, Any]:
        if self._cache is None:
            import torch

            held = cat([self._round_rows, self._carry]) if len(self._carry) else self._round_rows
            self._cache = {
                W.SOURCE_KEY: self.source.state_dict(),
                W.TABLE_KEY: refs_table(ref_table(held)),
                W.SIZES_KEY: torch.tensor(self._sizes, dtype=torch.int64),
                W.ENTERED_KEY: torch.from_numpy(self._entered.copy()),
                W.ROUND_KEY: self._round,
            }
        return {W.KIND_KEY: W.KIND, **self._cache, W.EMITTED_KEY: self._emitted, W.METRICS_KEY: record_text(self.metrics)}

    def _run_round(self) -> None:
        """Refill, pack once, queue the packs to emit (in the round's order), carry the rest."""
        self._cache = None
        rules, round_ = self.rules, self._round
        need = rules.size(round_) - len(self._carry)
        new = self.source.take(need) if need > 0 else rows_of(0)
        ended = len(new) < need
        window = cat([self._carry, new]) if len(self._carry) else new
        entered = np.concatenate([self._entered, np.full(len(new), round_, dtype=np.int64)])
        self._carry, self._entered, self._packs, self._sizes, self._emitted = rows_of(0), entered[:0], [], [], 0
        self._round_rows = rows_of(0)
        if not len(window):
            return
        aligned = aligned_lengths(rules, window["length"])
        if int(aligned.max()) > self.capacity:
            i = int(aligned.argmax())
            key = PackRows(rows=window[i:i + 1], blocks=self.store.subset(window[i:i + 1])).doc_keys()[0]
            raise ValueError(f"sample {key!r} has {int(window['length'][i])} tokens ({int(aligned[i])} aligned), "
                             f"more than capacity={self.capacity}; apply an overlong policy before packing")
        emit, keep, forced = choose(rules, pack_round(rules, aligned, round_), aligned, entered, round_, ended)
        for name, n in forced.items():
            self.metrics[name] += n
        order = emission_order(rules, round_, len(emit), self.shuffle)
        ordered = [emit[j] for j in order]
        if ordered:
            out = np.concatenate(ordered)
            self.metrics["max_rounds_waited"] = max(self.metrics["max_rounds_waited"], int((round_ - entered[out]).max()))
            self._set_packs(take(window, out), [len(b) for b in ordered], 0)
        kept = np.sort(np.concatenate(keep)) if keep else np.zeros(0, dtype=np.int64)
        self._carry, self._entered = take(window, kept), entered[kept]
        self._round += 1
        self.metrics["rounds"] += 1
        self.store.keep(self._carry, self.source.pending)


def _rich(blocks: Mapping[int, Any]) -> bool:
    """Whether a block holds a per-sample reader's sample with more than ids (labels, a loss
    mask, extras, images): then the collate lays the pack out as the per-sample path does."""
    return any(b.samples is not None and any(s.labels is not None or s.loss_mask is not None or s.extras or s.images
                                             for s in b.samples) for b in blocks.values())


__all__ = ["RowPacker"]
