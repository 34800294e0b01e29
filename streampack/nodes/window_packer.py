"""WindowPacker: a rolling window of samples -> packs of at most ``capacity`` aligned tokens.

One *round*: refill the window up to ``window`` samples, pack all of them once with a
registry algorithm (``bfd`` by default), emit every pack that is full enough, carry the
samples of the other packs into the next round. Packing once per round (not once per
emitted pack) keeps the cost at one ``pack()`` call per ~``window`` samples. A fresh packer
warms up: round ``r`` refills only to ``min(window, warmup * 2**r)`` samples (``warmup`` = 64),
so the first packs leave after 64 samples, not a whole window (window 1024, ~1,900-token text
documents, 2 workers: 1.5 s instead of 23 s to the first batch, fill cost <= 0.035 pp; see
:mod:`~streampack.packing.window_rounds`).

A pack is emitted when
  1. its free space is at most ``slack`` tokens (default ``capacity // 256``), or
  2. one of its samples entered the window ``max_wait`` rounds ago (bounded latency: a sample
     is emitted at the latest in the round ``max_wait`` rounds after the one it arrived in,
     i.e. before ``max_wait * window`` later samples are read; default ``max(8, 8192 // window)``
     rounds, so about 8,192 samples at any window up to 1024), or
  3. carrying it would leave less than half of this round's window for new samples (the
     fullest such packs go first), so every round makes progress even on a stream that never
     fills a pack, or
  4. the upstream is exhausted (flush: nothing is ever lost at the end of a finite stream).
The packs of a round are emitted in an order permuted by ``default_rng((seed, round))``, so
the pack order does not follow length. With ``balance`` (cost-balanced emission,
:mod:`streampack.packing.schedule`) they go to a reservoir of ready packs instead and leave in
the order a schedule shared by every rank picks, so each rank's step costs about the same; the
packs themselves, and so fill and pack counts, are the same. Its state adds the reservoir's
packs (as references, like the carry), their steps and a cost histogram.

Lengths are packed *aligned* (``ceil(L / align) * align``) so every pack still fits after
the collate pads each document to the CP/TP alignment.

State = the upstream state after the round's refill + the round's packs and carried samples as
a table of references (where to re-read each one, see :mod:`streampack.plan.replay`) + how
many packs of the round were already emitted (+ metrics). Restoring re-reads the samples of
the packs not yet emitted and of the carry and rebuilds exactly those packs (no re-packing);
``get_state`` is O(1) after its first call in a round (cached per round), which matters because
StatefulDataLoader snapshots after every batch. Size: 56 bytes per sample of the window
(~65 KB per worker at window 1024, measured at capacities 4k, 32k and 128k) whatever the
documents' lengths; without a replay function (a graph with a user node stage) the table
stores tokens instead (2 MB at capacity 4k, 63 MB at 128k: ``benchmarks/bench_state.py``). ``carry=`` starts the packer with samples already in its window
(an elastic resume hands each new worker its share of the old windows that way).

Defaults: ``slack = capacity // 256`` and 8 rounds of ``max_wait`` at window 1024 give 99.934%
fill against offline bfd's 99.995% (lognormal mean ~600, capacity 4096, 200k samples), because
packs forced out by age cost the most fill; ``benchmarks/bench_packing_scaling.py`` measures
the online fill against offline bfd by window, and the sweep is in ``docs/changelog.md``. For pre-tokenized tar / parquet shards
the graph builder runs the same rounds on rows of arrays instead
(:class:`~streampack.nodes.row_packer.RowPacker`, :mod:`streampack.graph.contiguous`); this
node serves every other stream.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from streampack.packing.cost import CostModel
from streampack.packing.reservoir import Reservoir
from streampack.packing.schedule import Balance, CostScale, Schedule
from streampack.packing.window_rounds import (
    PackerRules,
    aligned_lengths,
    choose,
    emission_order,
    pack_round,
)
from streampack.plan.cursor import Undelivered
from streampack.plan.state import (
    Replay,
    record_of,
    record_text,
    samples_from_table,
    samples_to_table,
    table_size,
    table_slice,
)
from streampack.sample import Sample

_METRIC_NAMES = ("rounds", "packs", "docs", "tokens", "aligned_tokens", "slots",
                 "forced_by_age", "forced_by_carry", "flushed", "max_rounds_waited")
_BALANCE_METRICS = ("forced_by_hold", "held_steps", "max_held_steps")


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


class WindowPacker(BaseNode[list[Sample]]):
    """Packs a stream of tokenized samples; yields one pack (a list of samples) per ``next``.

    ``rules``: capacity, alignment, window, algorithm, waits and seed, made from the checked
    records by ``StreamConfig.packer_rules`` (the same rules a plan counts with).
    ``replay`` re-reads samples from their origins (a :class:`~streampack.plan.replay.Replayer`):
    with it the state holds references, without it tokens. ``carry`` is a table
    (``state.samples_to_table``) of samples the window starts with. ``balance``: cost-balanced
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

    def __init__(self, source: BaseNode[Sample], *, rules: PackerRules, shuffle: bool = True,
                 replay: Replay | None = None, carry: Mapping[str, Any] | None = None,
                 balance: Balancing | None = None) -> None:
        super().__init__()
        self.source, self.rules = source, rules
        self.capacity, self.window, self.algorithm = rules.capacity, rules.window, rules.algorithm
        self.align, self.seed, self.max_wait, self.shuffle = rules.align, rules.seed, rules.max_wait, shuffle
        self.slack = rules.free_ok
        self.replay, self.initial_carry = replay, carry
        self.balance = None if balance is None else balance.balance
        self.cost_model = None if balance is None else balance.cost_model
        self.schedule = Schedule() if balance is None else balance.schedule
        self.first_batch, self.levels = (0, None) if balance is None else (balance.first_batch, balance.levels)
        if self.cost_model is not None:
            self.scale = CostScale.of(self.cost_model.linear, self.cost_model.attention, self.capacity)
        self._clear()

    def _clear(self) -> None:
        self._carry: list[Sample] = []
        self._entered: list[int] = []
        self._packs: list[list[Sample]] = []  # every pack of the current round, in emission order
        self._emitted = 0
        self._round = 0
        self._cache: dict[str, Any] | None = None  # this round's state (without emitted / metrics)
        self._ended = False
        self.metrics = dict.fromkeys(_METRIC_NAMES + (_BALANCE_METRICS if self.balance is not None else ()), 0)
        self.reservoir: Reservoir[list[Sample]] | None = None
        if self.balance is not None:
            self.reservoir = Reservoir(self.balance, self.schedule, self.scale, first_batch=self.first_batch,
                                       counts=None if callable(self.levels) else self.levels)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._clear()
        if initial_state is None:
            if self.reservoir is not None and callable(self.levels):
                seeded = self.levels()
                if seeded is not None:
                    self.reservoir.load(counts=seeded, first_batch=self.first_batch, emitted=0)
            self.source.reset(None)
            if self.initial_carry is not None and table_size(self.initial_carry):
                self._carry = samples_from_table(self.initial_carry, self.replay)
                self._entered = [0] * len(self._carry)
            return
        self.source.reset(initial_state[self.SOURCE_KEY])
        table, sizes = initial_state[self.TABLE_KEY], initial_state[self.SIZES_KEY].tolist()
        emitted = int(initial_state[self.EMITTED_KEY])
        start = sum(sizes[:emitted])
        rest = samples_from_table(table_slice(table, start, table_size(table)), self.replay)
        self._packs = [[] for _ in range(emitted)]
        for n in sizes[emitted:]:
            self._packs.append(rest[:n])
            rest = rest[n:]
        self._carry = rest
        self._entered = initial_state[self.ENTERED_KEY].tolist()
        self._round, self._emitted = int(initial_state[self.ROUND_KEY]), emitted
        if (self.RESERVOIR_KEY in initial_state) != (self.reservoir is not None):
            raise ValueError(f"WindowPacker state saved with balance {'on' if self.reservoir is None else 'off'} "
                             f"restored into a packer with balance {'off' if self.reservoir is None else 'on'}")
        kept = (self.SOURCE_KEY, self.TABLE_KEY, self.SIZES_KEY, self.ENTERED_KEY, self.ROUND_KEY)
        self._cache = {k: initial_state[k] for k in kept + ((self.RESERVOIR_KEY,) if self.reservoir is not None else ())}
        self.metrics = record_of(initial_state[self.METRICS_KEY])
        if self.reservoir is not None:
            self._restore_reservoir(initial_state[self.RESERVOIR_KEY])

    def _restore_reservoir(self, saved: Mapping[str, Any]) -> None:
        """The reservoir's packs are the state's packs (re-read above); its counters are saved."""
        res = self.reservoir
        assert res is not None
        res.load(counts=saved["counts"].numpy(), first_batch=saved["first_batch"], emitted=saved["emitted"])
        res.add(self._packs, self._costs(self._packs), born=saved["born"].tolist(), count=False)
        self._packs, self._emitted = [], 0

    def next(self) -> list[Sample]:
        if self.reservoir is not None:
            return self._next_balanced(self.reservoir)
        if self._emitted >= len(self._packs):
            self._run_round()
            if not self._packs:
                raise StopIteration
        pack = self._packs[self._emitted]
        self._emitted += 1
        self._count(pack)
        return pack

    def _next_balanced(self, res: Reservoir[list[Sample]]) -> list[Sample]:
        """Keep ``reservoir`` packs ready (rounds as usual), emit the one the schedule picks."""
        while len(res) < self.balance.reservoir and not self._ended:  # type: ignore[union-attr]
            self._run_round()
            res.add(self._packs, self._costs(self._packs))
            self._packs = []
        if not len(res):
            raise StopIteration
        self._cache = None
        pack, waited, forced = res.take()
        m = self.metrics
        m["forced_by_hold"] += forced
        m["held_steps"] += waited
        m["max_held_steps"] = max(m["max_held_steps"], waited)
        self._count(pack)
        return pack

    def _costs(self, packs: list[list[Sample]]) -> np.ndarray:
        """Normalized estimated cost of each pack (real document lengths)."""
        assert self.cost_model is not None
        full = self.scale.full
        return np.array([self.cost_model.pack_cost(np.fromiter((len(s) for s in p), np.int64, len(p))) / full
                         for p in packs], dtype=np.float64)

    def get_state(self) -> dict[str, Any]:
        if self._cache is None:
            import torch

            held = self.reservoir.items if self.reservoir is not None else self._packs
            samples = [s for p in held for s in p] + self._carry
            self._cache = {
                self.SOURCE_KEY: self.source.state_dict(),  # the upstream rests between rounds
                self.TABLE_KEY: samples_to_table(samples, by_reference=self.replay is not None),
                self.SIZES_KEY: torch.tensor([len(p) for p in held], dtype=torch.int64),
                self.ENTERED_KEY: torch.tensor(self._entered, dtype=torch.int64),
                self.ROUND_KEY: self._round,
            }
            if self.reservoir is not None:
                res = self.reservoir
                self._cache[self.RESERVOIR_KEY] = {
                    "born": torch.tensor(res.born, dtype=torch.int64), "counts": torch.from_numpy(res.counts.copy()),
                    "emitted": res.emitted, "first_batch": res.first_batch}
        return {self.KIND_KEY: self.KIND, **self._cache, self.EMITTED_KEY: self._emitted,
                self.METRICS_KEY: record_text(self.metrics)}

    @classmethod
    def undelivered(cls, state: Mapping[str, Any]) -> Undelivered:
        """What a saved state (this packer's or a ``RowPacker``'s: one layout) had not delivered:
        the window's carry, the packs of its round not emitted yet and the samples carried to the
        next, in that order, as a table (references, or tokens where it stored them)."""
        start = sum(state[cls.SIZES_KEY].tolist()[:int(state[cls.EMITTED_KEY])])
        table = state[cls.TABLE_KEY]
        return Undelivered(pulled=None, carry=table_slice(table, start, table_size(table)))

    def _run_round(self) -> None:
        """Refill, pack once, queue the packs to emit (shuffled), carry the rest."""
        self._cache = None
        samples, entered = self._carry, self._entered
        ended = False
        while len(samples) < self.rules.size(self._round):
            try:
                samples.append(next(self.source))
            except StopIteration:
                ended = True
                break
            entered.append(self._round)
        self._carry, self._entered, self._packs, self._emitted = [], [], [], 0
        self._ended = ended or not samples
        if not samples:
            return
        lengths = np.fromiter((len(s) for s in samples), dtype=np.int64, count=len(samples))
        aligned = aligned_lengths(self.rules, lengths)
        if int(aligned.max()) > self.capacity:
            i = int(aligned.argmax())
            raise ValueError(f"sample {samples[i].doc_key!r} has {int(lengths[i])} tokens "
                             f"({int(aligned[i])} aligned), more than {self.capacity=}; "
                             f"apply an overlong policy before packing")
        emit, keep, forced = choose(self.rules, pack_round(self.rules, aligned, self._round), aligned, np.asarray(entered, dtype=np.int64),
                                    self._round, ended)
        for name, n in forced.items():
            self.metrics[name] += n
        order = emission_order(self.rules, self._round, len(emit), self.shuffle)
        self._packs = [[samples[i] for i in emit[j].tolist()] for j in order]
        waited = [self._round - entered[i] for b in emit for i in b.tolist()]
        self.metrics["max_rounds_waited"] = max(self.metrics["max_rounds_waited"], *waited, 0)
        kept = np.sort(np.concatenate(keep)) if keep else np.zeros(0, dtype=np.int64)
        self._carry = [samples[i] for i in kept.tolist()]
        self._entered = [entered[i] for i in kept.tolist()]
        self._round += 1
        self.metrics["rounds"] += 1

    def _count(self, pack: list[Sample]) -> None:
        m = self.metrics
        m["packs"] += 1
        m["docs"] += len(pack)
        m["slots"] += self.capacity
        for s in pack:
            n = len(s)
            m["tokens"] += n
            m["aligned_tokens"] += -(-n // self.align) * self.align


def fill(metrics: dict[str, int]) -> float:
    """Real tokens / pack slots from a :class:`WindowPacker` metrics dict."""
    return metrics["tokens"] / metrics["slots"] if metrics["slots"] else 0.0
