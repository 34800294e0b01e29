"""The cost histogram a balancing reader starts from: the same on every rank, before its first pack.

Cost-balanced emission (:mod:`streampack.packing.schedule`) turns each step's quantile into a cost level with the
histogram of pack costs the reader has counted; at step 0 every reader's is empty, and for the first ~2,000 packs the
levels differ between ranks. So every reader packs the same sample of document lengths, drawn from the data set's shard
indexes by the stream seed alone, with the packer's own rules (``window_rounds.run_rounds``), and counts its packs'
costs as ``SEED_WEIGHT`` packs: the levels agree from step 0 and still follow a drifting stream after about
``SEED_WEIGHT`` own packs. Straggler factor over steps 0-500 (``benchmarks/bench_balance_e2e.py``, 16 readers, capacity
131,072): cold 1.064, seeded 1.027.

**Cost per reader** (s samples per shard): the indexes of ``ceil(SEED_SAMPLES / s)`` shards (at most
``SEED_SHARDS``, one request each, the same on every reader), O(N) to draw them, and lengths-only
rounds of at most ``SEED_PACKS`` packs or ``SEED_ROUNDS`` rounds: 0.15 s for 4,096 packs at capacity
131,072. Paid once when a reader starts fresh (a restore brings its histogram); without known token
lengths the reader starts cold.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from streampack.packing.cost import CostModel
from streampack.packing.schedule import BINS, CostScale
from streampack.packing.window_rounds import PackerRules, run_rounds

SEED_SAMPLES = 1 << 15
"""Document lengths sampled (every reader the same ones)."""
SEED_SHARDS = 64
"""At most this many shard indexes read for them."""
SEED_PACKS = 4096
"""Packs made from the sample; their cost histogram is the seed."""
SEED_ROUNDS = 256
"""...or the packs of this many rounds, whichever comes first (bounds the cost for small windows:
window 1,024 at capacity 131,072 makes ~3,700 packs in 256 rounds)."""
SEED_WEIGHT = 20_000
"""Packs the seed counts as (the reader's own packs count 1 each)."""
MIN_SAMPLES = 256
"""Fewer known lengths than this: no seed (cold start)."""


def sample_lengths(num_shards: int, lengths_of: Callable[[int], np.ndarray], seed: int) -> np.ndarray:
    """int64 lengths of the samples in shards drawn by ``seed`` (the same on every reader) until ``SEED_SAMPLES`` are
    known; ``lengths_of(shard)`` gives a shard's index lengths (-1 or 0: unknown or refused, skipped)."""
    order = np.random.default_rng([int(seed), 0x5EED]).permutation(num_shards)[:SEED_SHARDS]
    found: list[np.ndarray] = []
    total = 0
    for shard in order.tolist():
        lengths = np.asarray(lengths_of(shard), dtype=np.int64)
        lengths = lengths[lengths > 0]
        found.append(lengths)
        total += lengths.size
        if total >= SEED_SAMPLES:
            break
    return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)


def seed_counts(lengths: np.ndarray, rules: PackerRules, model: CostModel, scale: CostScale, *,
                seed: int, cut: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray | None:
    """int64 ``[BINS]``: the histogram of ``SEED_PACKS`` packs the packer's ``rules`` make from ``lengths``
    (drawn by ``seed``, cut by ``cut``), scaled to ``SEED_WEIGHT`` packs; None below ``MIN_SAMPLES``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if cut is not None:
        lengths = cut(lengths)
    lengths = lengths[(lengths > 0) & (lengths <= rules.capacity)]
    if lengths.size < MIN_SAMPLES:
        return None
    rng = np.random.default_rng([int(seed), 0xC057])
    costs: list[float] = []
    for made in run_rounds(rules, lambda n: rng.choice(lengths, n)):
        costs += [model.pack_cost(p) for p in made.packs]
        if len(costs) >= SEED_PACKS or made.number + 1 >= SEED_ROUNDS:
            break
    costs = costs[:SEED_PACKS]
    counts = np.bincount(scale.bins(np.asarray(costs) / scale.full), minlength=BINS)
    return np.round(counts * (SEED_WEIGHT / len(costs))).astype(np.int64)
