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

Log (lognormal mean ~600 sigma 1, capacity 4096, split policy; 2-core shared CPU box):

- slack / max_wait sweep, window 1024, 200k samples (offline bfd fill 99.995%): slack 8 /
  max_wait 4 -> 99.886%; 16/4 -> 99.899%; 32/4 -> 99.876%; 8/8 -> 99.944%; 16/8 -> 99.934%;
  32/8 -> 99.916%. Packs forced out by age cost the most fill, so max_wait defaults to 8
  and slack to capacity // 256 (= 16). slack 0 (emit only perfectly full packs) is worse
  (99.80%): half-empty packs then wait until forced.
- fill by window (40k samples, benchmarks/bench_pipeline.py; offline bfd 99.99%): 64 -> 99.16%,
  256 -> 99.75%, 1024 -> 99.94%, 4096 -> 99.97%.
- 2026-11-25, max_wait by window: with 8 rounds at every window a small window forced packs out
  after few samples (window 256: 8 x 256 = 2,048 later samples), which made most of its fill
  loss. The default is now ``window_rounds.default_max_wait``: ``max(8, 8192 // window)``
  rounds, the same bound in samples as window 1024's 8 rounds. Window 256, 100k documents
  (``benchmarks/bench_packing_scaling.py``, online vs offline bfd): lognormal 0.216 -> 0.084
  points below, heavy-tail 0.220 -> 0.068; slack 8 with 32 rounds: 0.063 / 0.053 (but 8x the
  packs forced out by age); windows >= 1024 unchanged.
- the packer alone (in-memory source) runs at 140–230 M tokens/s; end to end the reader and
  the collate dominate.
- 2026-11-27: for pre-tokenized tar / parquet shards the graph builder runs the same rounds on
  rows of arrays instead (:class:`~streampack.nodes.row_packer.RowPacker`, the contiguous fast
  path: :mod:`streampack.graph.contiguous`); this node serves every other stream.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from streampack import packing
from streampack.packing.cost import CostModel
from streampack.packing.reservoir import Reservoir
from streampack.packing.schedule import Balance, CostScale, Schedule
from streampack.packing.window_rounds import (
    WARMUP,
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


class WindowPacker(BaseNode[list[Sample]]):
    """Packs a stream of tokenized samples; yields one pack (a list of samples) per ``next``.

    ``replay`` re-reads samples from their origins (a :class:`~streampack.plan.replay.Replayer`):
    with it the state holds references, without it tokens. ``carry`` is a table
    (``state.samples_to_table``) of samples the window starts with.

    ``balance`` (with ``cost_model``) turns on cost-balanced emission: the round's packs go to
    a :class:`~streampack.packing.reservoir.Reservoir` and leave in the order the rank-shared
    ``schedule`` picks (see :mod:`streampack.packing.schedule`); the packs themselves are the
    same. ``first_batch`` / ``levels``: batches this reader yielded earlier in the pass and
    the cost histogram it had then (an epoch carries on from the previous one); ``levels`` may
    be a function giving it (or None), called only when the packer starts fresh — a restore
    brings its own histogram — so a seed (:mod:`~streampack.plan.cost_seed`) costs a resume
    nothing. ``warmup``:
    samples in the first round, doubling each round up to ``window`` (``>= window``: no warm-up).
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

    def __init__(self, source: BaseNode[Sample], *, capacity: int, window: int = 1024,
                 algorithm: str = "bfd", align: int = 1, seed: int = 0, max_wait: int | None = None,
                 slack: int | None = None, shuffle: bool = True, replay: Replay | None = None,
                 carry: Mapping[str, Any] | None = None, balance: Balance | None = None,
                 cost_model: CostModel | None = None, schedule: Schedule | None = None,
                 first_batch: int = 0, levels: np.ndarray | Callable[[], np.ndarray | None] | None = None,
                 warmup: int = WARMUP) -> None:
        super().__init__()
        if window < 1:
            raise ValueError(f"{window=} must be >= 1")
        if warmup < 1:
            raise ValueError(f"{warmup=} must be >= 1 (samples in the first round; >= window turns the warm-up off)")
        if max_wait is not None and max_wait < 1:
            raise ValueError(f"{max_wait=} must be None (the window's default) or >= 1")
        if align < 1 or capacity < 1:
            raise ValueError(f"need {capacity=} >= 1 and {align=} >= 1")
        if capacity % align:
            raise ValueError(f"{capacity=} must be a multiple of {align=} (the per-document alignment: "
                             f"2*cp_size*tp_size with context parallelism, tp_size with sequence "
                             f"parallelism, combined with align_multiple)")
        packing.get_algorithm(algorithm)  # unknown names fail here, not mid-stream
        if balance is not None and cost_model is None:
            raise ValueError("balance needs a cost_model (a CostModel, or a model shape for CostModel.from_shape)")
        self.source = source
        self.rules = PackerRules(capacity=capacity, window=window, algorithm=algorithm, align=align,
                                 seed=seed, max_wait=max_wait, slack=slack, warmup=warmup)
        self.capacity, self.window, self.algorithm = capacity, window, algorithm
        self.align, self.seed, self.max_wait, self.shuffle = align, seed, self.rules.max_wait, shuffle
        self.slack = self.rules.free_ok
        self.replay, self.initial_carry = replay, carry
        self.balance, self.cost_model = balance, cost_model
        self.schedule = schedule if schedule is not None else Schedule()
        self.first_batch, self.levels = first_batch, levels
        if cost_model is not None:
            self.scale = CostScale.of(cost_model.linear, cost_model.attention, capacity)
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
