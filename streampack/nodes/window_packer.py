"""WindowPacker: a rolling window of samples -> packs of at most ``capacity`` aligned tokens.

One *round*: refill the window up to ``window`` samples (a fresh packer warms up:
:mod:`~streampack.packing.window_rounds`), pack all of them once with a registry algorithm (``bfd`` by default), emit
every pack that is full enough and carry the samples of the other packs into the next round: one ``pack()`` call per
~``window`` samples. A pack is emitted when
  1. its free space is at most ``slack`` tokens (default ``capacity // 256``), or
  2. one of its samples entered the window ``max_wait`` rounds ago (bounded latency; default ``max(8, 8192 // window)``
     rounds, so about 8,192 samples at any window up to 1024), or
  3. carrying it would leave less than half of this round's window for new samples (the fullest such packs go
     first), so every round makes progress even on a stream that never fills a pack, or
  4. the upstream is exhausted (flush: nothing is ever lost at the end of a finite stream).
A round's packs leave in an order permuted by ``default_rng((seed, round))``, so the order does not follow length;
with ``balance`` (:mod:`streampack.packing.schedule`) they leave a reservoir in the order a schedule shared by every
rank picks, and the packs themselves are the same. Lengths are packed aligned (``ceil(L / align) * align``) so every
pack still fits after the collate pads each document. The defaults give 99.934% fill against offline bfd's 99.995%
(lognormal mean ~600, capacity 4096; ``benchmarks/bench_packing_scaling.py`` measures it by window).

The window is a table of rows (:mod:`streampack.plan.rows`). State = the upstream state after the round's refill +
the round's packs and carry as references (:mod:`streampack.plan.state`) + the packs emitted + metrics (+ the
reservoir's packs, steps and cost histogram), cached per round. A restore rebuilds exactly the saved packs from rows
not read yet (``rows.UNREAD``) and re-reads each pack's documents when it is about to leave, :data:`READ_AHEAD` packs
at a time. ``carry=`` starts the window with documents (an elastic resume's share of the old windows).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torchdata.nodes import BaseNode

from streampack.media.options import MediaOptions
from streampack.media.stage import vision_segments
from streampack.nodes.overlong import OverlongNode
from streampack.packing.cost import CostModel
from streampack.packing.reservoir import Reservoir
from streampack.packing.schedule import Balance, CostScale, Schedule
from streampack.packing.window_rounds import PackerRules, aligned_lengths, choose, emission_order, pack_round
from streampack.plan.cursor import Undelivered
from streampack.plan.rows import (
    NO_ORIGIN,
    UNREAD,
    BlockStore,
    PackRows,
    cat,
    make_packs,
    put,
    ref_table,
    rows_of,
    sample_rows,
    take,
    unread_rows,
)
from streampack.plan.state import (
    make_table,
    record_of,
    record_text,
    samples_from_state,
    table_refs,
    table_size,
    table_slice,
)
from streampack.sample import Sample

if TYPE_CHECKING:  # plan.replay re-reads through the overlong node's cut, which imports this package
    from streampack.plan.replay import Replayer

_METRIC_NAMES = ("rounds", "packs", "docs", "tokens", "aligned_tokens", "slots",
                 "forced_by_age", "forced_by_carry", "flushed", "max_rounds_waited")
_BALANCE_METRICS = ("forced_by_hold", "held_steps", "max_held_steps")
READ_AHEAD = 8
"""Restored packs re-read at once (a batch of 8 packs): the first batch after a restore reads its
own ~55 documents, not the whole window (~1,000 documents from ~11 shards: 24-30 ms of a ~35 ms
resume on the loaded box); 16 cost the first batch ~1.5x the reads."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Balancing:
    """Cost-balanced emission, the packer's part of ``CostOptions`` (``graph.build`` makes it):
    the round's packs go to a :class:`~streampack.packing.reservoir.Reservoir` and leave in the
    order the rank-shared ``schedule`` picks (see :mod:`streampack.packing.schedule`)."""

    balance: Balance
    """The reservoir's size and hold (``CostOptions.balance``)."""
    cost_model: CostModel
    """What a pack costs (``CostOptions.model``; ``CostOptions`` refuses a balance without one)."""
    schedule: Schedule = Schedule()
    """Which lane of which rank takes which step."""
    first_batch: int = 0
    """Batches this reader yielded earlier in the pass (an epoch carries on from the previous one)."""
    levels: np.ndarray | Callable[[], np.ndarray | None] | None = None
    """The cost histogram it had then; or a function giving it (or None), called only when the
    packer starts fresh — a restore brings its own histogram — so a seed
    (:mod:`~streampack.plan.cost_seed`) costs a resume nothing."""
    media: MediaOptions | None = None
    """The stream's media (``config.media``): with ``cost_model.vision`` each pack's images are priced from their
    headers (:func:`~streampack.media.stage.vision_segments`), and the histogram spans their most costly pack."""


def _scale(balance: Balancing, capacity: int) -> CostScale:
    """The histogram's scale: a full pack's text cost, plus, with a vision encoder, the most its images can add."""
    model = balance.cost_model
    scale = CostScale.of(model.linear, model.attention, capacity)
    if model.vision is None:
        return scale
    if balance.media is None:
        raise ValueError("CostModel(vision=VisionCost(...)) prices the images of a media stream, but this packer's "
                         "Balancing has no media= (PackedDataset(media=MediaOptions(...)), or drop vision=)")
    full = scale.full + balance.media.vision_bound(model.vision, capacity)
    return CostScale(full=full, lo=0.5 * model.linear * capacity / full)


class WindowPacker(BaseNode[PackRows]):
    """Packs the documents of ``source`` (an :class:`~streampack.nodes.overlong.OverlongNode`, or
    any node yielding Samples that fit); yields one :class:`PackRows` per ``next``.

    ``rules``: capacity, alignment, window, algorithm, waits and seed, made from the checked
    records by ``StreamConfig.packer_rules`` (the same rules a plan counts with).
    ``replay`` re-reads documents from their origins (a :class:`~streampack.plan.replay.Replayer`):
    with it the state holds references, without it tokens. ``carry`` is a table
    (``state.samples_to_table``) of documents the window starts with. ``balance``: cost-balanced
    emission (:class:`Balancing`); the packs themselves are the same.
    """

    SOURCE_KEY = "source"
    TABLE_KEY = "table"
    SIZES_KEY = "pack_sizes"
    ENTERED_KEY = "entered"
    ROUND_KEY = "round"
    EMITTED_KEY = "emitted"
    METRICS_KEY = "metrics"
    KIND_KEY = "kind"
    RESERVOIR_KEY = "reservoir"
    KIND = "WindowPacker"

    def __init__(self, source: BaseNode[Any], *, rules: PackerRules, shuffle: bool = True,
                 replay: Replayer | None = None, carry: Mapping[str, Any] | None = None,
                 balance: Balancing | None = None) -> None:
        super().__init__()
        self.source, self.rules, self.shuffle, self.replay, self.initial_carry = source, rules, shuffle, replay, carry
        self.capacity, self.align = rules.capacity, rules.align
        # the overlong node's rows point into its store; Samples from any other node go into ours
        self._overlong = source if isinstance(source, OverlongNode) else None
        self.store = self._overlong.store if self._overlong is not None else BlockStore()
        self.balancing = balance
        if balance is not None:
            self.scale = _scale(balance, self.capacity)
        self._clear()

    def _clear(self) -> None:
        self._carry = rows_of(0)
        self._entered = np.zeros(0, dtype=np.int64)
        self._round_rows = rows_of(0)  # every document of this round's packs, pack after pack
        self._packs: list[PackRows] = []
        self._emitted = 0
        self._round = 0
        self._ended = False
        self._cache: dict[str, Any] | None = None  # this round's state (without emitted / metrics)
        b = self.balancing
        self.metrics = dict.fromkeys(_METRIC_NAMES + (_BALANCE_METRICS if b is not None else ()), 0)
        self.reservoir: Reservoir[PackRows] | None = None
        if b is not None:
            self.reservoir = Reservoir(b.balance, b.schedule, self.scale, first_batch=b.first_batch,
                                       counts=None if callable(b.levels) else b.levels)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._clear()
        if self.replay is not None:
            self.replay.forget()
        if initial_state is None:
            b = self.balancing
            if self.reservoir is not None and b is not None and callable(b.levels):
                seeded = b.levels()
                if seeded is not None:
                    self.reservoir.load(counts=seeded, first_batch=b.first_batch, emitted=0)
            self.source.reset(None)
            if self.initial_carry is not None and table_size(self.initial_carry):
                self._carry = self._rows(self.initial_carry)
                self._entered = np.zeros(len(self._carry), dtype=np.int64)
            return
        if (self.RESERVOIR_KEY in initial_state) != (self.reservoir is not None):
            raise ValueError(f"WindowPacker state saved with balance {'on' if self.reservoir is None else 'off'} "
                             f"restored into a packer with balance {'off' if self.reservoir is None else 'on'}")
        self.source.reset(initial_state[self.SOURCE_KEY])
        table, sizes = initial_state[self.TABLE_KEY], initial_state[self.SIZES_KEY].tolist()
        emitted = int(initial_state[self.EMITTED_KEY])
        start = sum(sizes[:emitted])
        rest = self._rows(table_slice(table, start, table_size(table)))
        self._set_packs(rest[:sum(sizes) - start], sizes, emitted)
        self._carry = rest[sum(sizes) - start:]
        self._entered = initial_state[self.ENTERED_KEY].numpy().astype(np.int64)
        self._round, self._emitted = int(initial_state[self.ROUND_KEY]), emitted
        kept = (self.SOURCE_KEY, self.TABLE_KEY, self.SIZES_KEY, self.ENTERED_KEY, self.ROUND_KEY)
        self._cache = {k: initial_state[k] for k in kept + ((self.RESERVOIR_KEY,) if self.reservoir is not None else ())}
        self.metrics = record_of(initial_state[self.METRICS_KEY])
        if self.reservoir is not None:
            self._restore_reservoir(self.reservoir, initial_state[self.RESERVOIR_KEY])

    def _restore_reservoir(self, res: Reservoir[PackRows], saved: Mapping[str, Any]) -> None:
        """The reservoir's packs are the state's packs (re-read at once: the schedule may take any
        of them next); its counters are saved."""
        res.load(counts=saved["counts"].numpy(), first_batch=saved["first_batch"], emitted=saved["emitted"])
        self._packs = self._read(self._packs)
        res.add(self._packs, self._costs(self._packs), born=saved["born"].tolist(), count=False)
        self._packs, self._emitted = [], 0

    def _rows(self, table: Mapping[str, Any]) -> np.ndarray:
        """A table's rows: stored samples as rows of their own block; references as rows not
        re-read yet, every shard they point into checked now (a changed shard is refused at the
        restore); each pack's documents are re-read when it is about to leave (:meth:`_read`)."""
        n = table_size(table)
        if not n:
            return rows_of(0)
        is_ref = table["is_ref"].numpy()
        out = rows_of(n)
        if not is_ref.all():
            put(out, ~is_ref, sample_rows(samples_from_state(table["stored"]), self.store))
        if is_ref.any():
            if self.replay is None:
                raise ValueError("this state holds carried samples by reference but the graph cannot re-read "
                                 "them (it has a user node stage); it was saved by another graph")
            refs = table_refs(table)
            self.replay.verify(refs)
            put(out, is_ref, unread_rows(refs, self.replay.spec.policy))
        return out

    def _set_packs(self, rows: np.ndarray, sizes: list[int], emitted: int) -> None:
        """This round's packs: ``sizes`` documents each, the first ``emitted`` already out
        (``rows`` holds the others, in order)."""
        blocks = self.store.subset(rows) if len(rows) else {}
        self._packs = [PackRows(rows=rows_of(0), blocks={}) for _ in range(emitted)]
        self._packs += make_packs(rows, list(sizes[emitted:]), blocks, align=self.align)
        self._round_rows = rows

    def next(self) -> PackRows:
        if self.reservoir is not None:
            return self._count(self._next_balanced(self.reservoir))
        if self._emitted >= len(self._packs):
            self._run_round()
            if not self._packs:
                raise StopIteration
        at = self._emitted
        if self._packs[at].lazy:  # the next READ_AHEAD packs' documents in one re-read
            end = min(at + READ_AHEAD, len(self._packs))
            self._packs[at:end] = self._read(self._packs[at:end])
            self._forget_if_read()
        self._emitted += 1
        return self._count(self._packs[at])

    def _next_balanced(self, res: Reservoir[PackRows]) -> PackRows:
        """Keep ``reservoir`` packs ready (rounds as usual), emit the one the schedule picks."""
        while len(res) < res.balance.reservoir and not self._ended:
            self._run_round()
            if self.balancing is not None and self.balancing.cost_model.vision is not None:
                self._packs = self._read(self._packs)  # a restored carry's images are priced from their headers
                self._forget_if_read()
            res.add(self._packs, self._costs(self._packs))
            self._packs = []
        if not len(res):
            raise StopIteration
        self._cache = None
        pack, waited, forced = res.take()
        if pack.lazy:  # a restored carry document in a pack made since
            (pack,) = self._read([pack])
            self._forget_if_read()
        m = self.metrics
        m["forced_by_hold"] += forced
        m["held_steps"] += waited
        m["max_held_steps"] = max(m["max_held_steps"], waited)
        return pack

    def _count(self, pack: PackRows) -> PackRows:
        m = self.metrics
        m["packs"] += 1
        m["docs"] += len(pack)
        m["slots"] += self.capacity
        m["tokens"] += pack.tokens
        m["aligned_tokens"] += pack.aligned
        return pack

    def _costs(self, packs: list[PackRows]) -> np.ndarray:
        """Normalized estimated cost of each pack (real document lengths; with a vision encoder, its images'
        segments from their headers, as the collate's ``est_cost`` prices them after decoding)."""
        b = self.balancing
        assert b is not None
        model, media, empty = b.cost_model, b.media, np.zeros(0, np.int64)
        if model.vision is None:
            return np.array([model.pack_cost(p.rows["length"]) / self.scale.full for p in packs], dtype=np.float64)
        assert media is not None  # _scale refused a vision encoder without media
        return np.array([model.pack_cost(p.rows["length"], segments=np.concatenate(
            [empty] + [vision_segments(s, media) for s in p.samples()]) if p.rich else empty) / self.scale.full
            for p in packs], dtype=np.float64)

    def _read(self, packs: list[PackRows]) -> list[PackRows]:
        """``packs`` with the documents of the restored ones re-read (one replay: the block reads
        of one cluster serve all of them)."""
        lazy = [p for p in packs if p.lazy]
        if not lazy:
            return packs
        assert self.replay is not None  # only a restore by reference makes lazy packs
        rows = cat([p.rows for p in lazy])
        unread = rows["block"] == UNREAD
        put(rows, unread, self.replay(ref_table(take(rows, unread)), self.store))
        blocks = {k: v for p in lazy for k, v in p.blocks.items()}  # the documents read since
        blocks.update(self.store.subset(take(rows, unread)))
        read = iter(make_packs(rows, [len(p) for p in lazy], blocks, align=self.align))
        return [next(read) if p.lazy else p for p in packs]

    def _forget_if_read(self) -> None:
        """Let the replay drop what it kept for carried documents once none is left unread."""
        held = self._packs + (self.reservoir.items if self.reservoir is not None else [])
        if self.replay is not None and not any(p.lazy for p in held) and not (self._carry["block"] == UNREAD).any():
            self.replay.forget()

    def get_state(self) -> dict[str, Any]:
        if self._cache is None:
            res = self.reservoir
            if res is not None:
                held_packs = res.items
                held = cat([p.rows for p in held_packs] + [self._carry])
            else:
                held_packs = self._packs
                held = cat([self._round_rows, self._carry]) if len(self._carry) else self._round_rows
            self._cache = {
                self.SOURCE_KEY: self.source.state_dict(),  # the upstream rests between rounds
                self.TABLE_KEY: self._table(held, held_packs),
                self.SIZES_KEY: torch.tensor([len(p) for p in held_packs], dtype=torch.int64),
                self.ENTERED_KEY: torch.from_numpy(self._entered.copy()),
                self.ROUND_KEY: self._round,
            }
            if res is not None:
                self._cache[self.RESERVOIR_KEY] = {
                    "born": torch.tensor(res.born, dtype=torch.int64), "counts": torch.from_numpy(res.counts.copy()),
                    "emitted": res.emitted, "first_batch": res.first_batch}
        return {self.KIND_KEY: self.KIND, **self._cache, self.EMITTED_KEY: self._emitted,
                self.METRICS_KEY: record_text(self.metrics)}

    def _table(self, held: np.ndarray, packs: list[PackRows]) -> dict[str, Any]:
        """The held documents as references (56 bytes each, whatever their length), and as their
        tokens where they cannot be re-read (no replay, or a Sample without an origin): what
        ``state.samples_to_table`` makes of their Samples."""
        is_ref = held["shard"] != NO_ORIGIN if self.replay is not None else np.zeros(len(held), dtype=bool)
        stored = take(held, ~is_ref)
        samples: list[Sample] = []
        if len(stored):
            blocks = {k: v for p in packs for k, v in p.blocks.items()}  # the store keeps only the carry's
            blocks.update({b: self.store.blocks[b] for b in set(stored["block"].tolist()) - blocks.keys()})
            samples = PackRows(rows=stored, blocks=blocks).samples()
        return make_table(is_ref, ref_table(take(held, is_ref)), samples)

    @classmethod
    def undelivered(cls, state: Mapping[str, Any]) -> Undelivered:
        """What a saved state had not delivered: the window's carry, the packs of its round not
        emitted yet and the samples carried to the next, in that order, as a table (references,
        or tokens where it stored them)."""
        start = sum(state[cls.SIZES_KEY].tolist()[:int(state[cls.EMITTED_KEY])])
        table = state[cls.TABLE_KEY]
        return Undelivered(pulled=None, carry=table_slice(table, start, table_size(table)))

    def _refill(self, need: int) -> np.ndarray:
        """Up to ``need`` more documents (fewer: the stream ended)."""
        if self._overlong is not None:
            return self._overlong.take(need)
        samples: list[Sample] = []
        while len(samples) < need:
            try:
                samples.append(next(self.source))
            except StopIteration:
                break
        return sample_rows(samples, self.store)

    def _run_round(self) -> None:
        """Refill, pack once, queue the packs to emit (in the round's order), carry the rest."""
        self._cache = None
        rules, round_ = self.rules, self._round
        need = rules.size(round_) - len(self._carry)
        new = self._refill(need) if need > 0 else rows_of(0)
        ended = len(new) < need
        window = cat([self._carry, new]) if len(self._carry) else new
        entered = np.concatenate([self._entered, np.full(len(new), round_, dtype=np.int64)])
        self._carry, self._entered, self._packs, self._emitted = rows_of(0), entered[:0], [], 0
        self._round_rows = rows_of(0)
        self._ended = ended or not len(window)
        if not len(window):
            return
        aligned = aligned_lengths(rules, window["length"])
        if int(aligned.max()) > self.capacity:
            i = int(aligned.argmax())
            one = window[i:i + 1]
            (pack,) = make_packs(one, [1], self.store.subset(one), align=self.align)
            raise ValueError(f"sample {pack.keys[0]!r} has {int(window['length'][i])} tokens "
                             f"({int(aligned[i])} aligned), more than capacity={self.capacity}; "
                             f"apply an overlong policy before packing")
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
        self.store.keep(self._carry, *(() if self._overlong is None else (self._overlong.pending,)))


def fill(metrics: dict[str, int]) -> float:
    """Real tokens / pack slots from a :class:`WindowPacker` metrics dict."""
    return metrics["tokens"] / metrics["slots"] if metrics["slots"] else 0.0


__all__ = ["READ_AHEAD", "Balancing", "WindowPacker", "fill"]
