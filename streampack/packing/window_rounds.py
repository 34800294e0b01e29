"""One round of the window packer, on lengths alone: the rules both the node and a plan run.

:class:`~streampack.nodes.window_packer.WindowPacker` packs its window once per round and
:func:`choose` decides which packs leave; :func:`count_packs` runs the very same rounds over a
list of lengths, so an epoch plan (``epoch_plan``) counts exactly the packs the node will
emit — no second implementation to drift apart (``tests/unit/plan/test_topology_finite.py`` checks both
agree on random streams).

Warm-up. Round ``r`` refills the window to ``min(window, warmup * 2**r)`` samples (:meth:`PackerRules.size`),
and the carry rule keeps at most half of *that* many, so a fresh packer (a new stream, each epoch of a
finite one, an elastic resume's new reader) emits its first packs after ``warmup`` (64) samples instead
of ``window``: the first batch no longer waits for a whole window to be read and tokenized. The ramp
is a function of the round number, so the plan counts it and an exact resume replays it.

The warm-up costs at most 0.035 percentage points of fill over an epoch (lognormal lengths,
capacity 4096, ``count_packs``) and takes the first batch of 1,900-token documents at window
1024 from 23 s to 1.5 s (``benchmarks/bench_first_batch.py --windows 256,1024 --doc-tokens
600,1900``; the figures with the warm-up off are in ``docs/changelog.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.random  # noqa: F401 - at import: numpy loads it lazily, ~15 ms inside the first round

from streampack import packing
from streampack.packing import aot  # noqa: F401 - at import: the first pack call would load it
from streampack.packing.result import Bins

WARMUP = 64
"""Default :attr:`PackerRules.warmup` (see "Warm-up" in the module docstring)."""
WAIT_SAMPLES = 8192
"""The default ``max_wait`` bounds a sample's wait to about this many later samples (8 rounds of the default window
1024), whatever the window: a smaller window waits more rounds of fewer samples. Measured (lognormal mean 600 and the
heavy-tail mix, 100k documents, C = 4096, window 256, ``benchmarks/bench_packing_scaling.py``): 8 rounds left the online
fill 0.22 points below offline bfd (0.14 of it from ~70 packs forced out by age), 32 rounds 0.07–0.08."""


def default_max_wait(window: int) -> int:
    """``max_wait`` when none is given: ``max(8, WAIT_SAMPLES // window)`` rounds (8 at 1024 and above)."""
    return max(8, WAIT_SAMPLES // max(window, 1))


@dataclass(frozen=True, slots=True, kw_only=True)
class PackerRules:
    """The settings that decide which packs leave a round (shared by the node and
    :func:`count_packs`, so a plan counts exactly the packs the node will emit)."""

    capacity: int
    window: int = 1024
    algorithm: str = "bfd"
    align: int = 1
    seed: int = 0
    max_wait: int | None = None
    """Rounds after which a pack holding a sample that entered then leaves; None:
    :func:`default_max_wait` of the window (resolved here, so ``rules.max_wait`` is an int)."""
    slack: int | None = None
    warmup: int = WARMUP
    """Samples the window holds in round 0; each later round doubles it, up to ``window``."""

    def __post_init__(self) -> None:
        # the packing values were checked by their records (StreamConfig.packer_rules makes these);
        # warmup belongs to no record, so it is checked here
        if not isinstance(self.warmup, int) or self.warmup < 1:
            raise ValueError(f"warmup={self.warmup!r} must be an int >= 1 (samples in the first round; "
                             f">= window turns the warm-up off)")
        if self.max_wait is None:
            object.__setattr__(self, "max_wait", default_max_wait(self.window))

    @property
    def free_ok(self) -> int:
        return self.capacity // 256 if self.slack is None else self.slack

    def size(self, round_: int) -> int:
        """Samples the window is refilled to in round ``round_`` (see "Warm-up" above)."""
        if self.warmup >= self.window or round_ >= 32:  # 32: warmup << round_ is past any window
            return self.window
        return min(self.window, self.warmup << round_)


def worker_seed(seed: int, global_worker: int) -> int:
    """The packing seed of one global worker (its rounds use ``worker_seed + round``)."""
    return seed * 1_000_003 + global_worker


def choose(rules: PackerRules, bins: Bins, aligned: np.ndarray, entered: np.ndarray,
           round_: int, ended: bool) -> tuple[Sequence[np.ndarray], list[np.ndarray], dict[str, int]]:
    """Split one round's ``bins`` into (emit, keep) by the rules in the module docstring;
    also returns the counts of packs forced out (``forced_by_age`` / ``_carry``, ``flushed``)."""
    if ended:
        return bins, [], {"flushed": len(bins)}
    emit: list[np.ndarray] = []
    rest: list[tuple[int, np.ndarray]] = []
    forced = {"forced_by_age": 0, "forced_by_carry": 0}
    oldest = round_ - rules.max_wait + 1  # type: ignore[operator]  (resolved in __post_init__)
    # every bin's free room and earliest entry as two reductions over the flat packing (a sum and a min per bin
    # were ~5 µs a bin, ~4% of an in-process epoch)
    flat = bins.result
    free = (rules.capacity - flat.bin_sums(aligned)).tolist()
    aged = (np.minimum.reduceat(entered[flat.order], flat.offsets[:-1]) <= oldest).tolist() if len(bins) else []
    for b, room, old in zip(bins, free, aged):
        if room <= rules.free_ok:
            emit.append(b)
        elif old:
            emit.append(b)
            forced["forced_by_age"] += 1
        else:
            rest.append((room, b))
    carried = sum(len(b) for _, b in rest)
    limit = rules.size(round_) // 2
    if carried > limit:
        rest.sort(key=lambda fb: fb[0])  # fullest first; stable, so deterministic
        while carried > limit:
            _, b = rest.pop(0)
            emit.append(b)
            carried -= len(b)
            forced["forced_by_carry"] += 1
    return emit, [b for _, b in rest], forced


def aligned_lengths(rules: PackerRules, lengths: np.ndarray) -> np.ndarray:
    return -(-lengths // rules.align) * rules.align


def pack_round(rules: PackerRules, aligned: np.ndarray, round_: int) -> Bins:
    """The bins of one round's (aligned) lengths."""
    return packing.pack(aligned, rules.capacity, algorithm=rules.algorithm, seed=rules.seed + round_)


def emission_order(rules: PackerRules, round_: int, n: int, shuffle: bool) -> np.ndarray:
    """The order a round's ``n`` packs leave in: permuted by ``(seed, round)`` so the pack
    order does not follow length (or as packed, without ``shuffle``)."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng((rules.seed, round_)).permutation(n)


@dataclass(frozen=True, slots=True, kw_only=True)
class Round:
    """What one round emits, on lengths alone. Only indices are kept: a plan needs the pack
    count alone, and building every pack's arrays made planning ~30% slower."""

    number: int
    window: np.ndarray
    """int64 lengths in the window this round."""
    entered: np.ndarray
    """int64 round each of them entered the window."""
    emit: list[np.ndarray]
    """Window indices of each emitted pack's documents, as packed."""
    order: np.ndarray
    """Emission order of ``emit``."""

    @property
    def packs(self) -> list[np.ndarray]:
        """int64 lengths of each emitted pack's documents, in emission order."""
        return [self.window[self.emit[j]] for j in self.order]

    @property
    def waited(self) -> list[np.ndarray]:
        """int64 rounds each of those documents waited in the window (0: packed in its first round)."""
        return [self.number - self.entered[self.emit[j]] for j in self.order]


def run_rounds(rules: PackerRules, read: Callable[[int], np.ndarray], carry: np.ndarray | None = None,
               shuffle: bool = True) -> Iterator[Round]:
    """The rounds of a :class:`WindowPacker` with these rules, on lengths alone (what a plan
    and a simulation run). ``read(n)`` returns up to ``n`` further lengths of the stream
    (fewer: the stream ended); ``carry``: lengths already in the window."""
    window = np.zeros(0, dtype=np.int64) if carry is None else np.asarray(carry, dtype=np.int64)
    entered = np.zeros(len(window), dtype=np.int64)
    round_ = 0
    while True:
        take = max(rules.size(round_) - len(window), 0)
        new = np.asarray(read(take), dtype=np.int64) if take else np.zeros(0, dtype=np.int64)
        ended = len(new) < take
        window = np.concatenate([window, new])
        entered = np.concatenate([entered, np.full(len(new), round_, dtype=np.int64)])
        if not len(window):
            return
        aligned = aligned_lengths(rules, window)
        emit, keep, _ = choose(rules, pack_round(rules, aligned, round_), aligned, entered, round_, ended)
        yield Round(number=round_, window=window, entered=entered, emit=emit,
                    order=emission_order(rules, round_, len(emit), shuffle))
        kept = np.sort(np.concatenate(keep)) if keep else np.zeros(0, dtype=np.int64)
        window, entered = window[kept], entered[kept]
        round_ += 1


def count_packs(rules: PackerRules, stream: np.ndarray, carry: np.ndarray | None = None) -> int:
    """Packs a :class:`WindowPacker` with these rules emits for a finite stream of ``stream`` lengths (each ``<=
    capacity``), starting with ``carry`` lengths in its window: the same rounds, packing and choices as the node, on
    lengths alone. Cost-balanced emission (``balance``) reorders and regroups packs but never adds or drops one, so the
    count holds for it too."""
    stream = np.asarray(stream, dtype=np.int64)
    pos = 0

    def read(n: int) -> np.ndarray:
        nonlocal pos
        pos += n
        return stream[pos - n:pos]

    return sum(len(r.emit) for r in run_rounds(rules, read, carry, shuffle=False))
