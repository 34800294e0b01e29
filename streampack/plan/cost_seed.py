"""The cost histogram a balancing reader starts from: the same on every rank, before its first pack.

Cost-balanced emission (:mod:`streampack.packing.schedule`) turns each step's quantile into a cost level with the
histogram of pack costs the reader has counted; at step 0 every reader's is empty, and for the first ~2,000 packs the
levels differ between ranks. So every reader packs the same sample of document lengths, drawn from the data set's shard
indexes by the stream seed alone, with the packer's own rules (``window_rounds.run_rounds``), and counts its packs'
costs as ``SEED_WEIGHT`` packs: the levels agree from step 0 and still follow a drifting stream after about
``SEED_WEIGHT`` own packs. Straggler factor over steps 0-500 (``benchmarks/bench_balance_e2e.py``, 16 readers, capacity
131,072, FLOP model): cold 1.064, seeded 1.027, with or without a manifest.

Where the lengths come from (:func:`seed_levels`):

- a finite stream, or any stream given ``manifest=``: the manifest's stored shard indexes (the planner's);
- an infinite stream without one: the same shards' indexes, each loaded or built where the reader keeps its own
  (``cache_dir``), so both give the same seed;
- a mixture: each source's sample, drawn in proportion to its weight (its draw probability);
- cold (no seed): one reader alone (no rank to agree with), offline packs (no packer), and any source whose sampled
  index knows no token length — text that is tokenized on the fly: knowing its lengths means reading and tokenizing
  tens of thousands of documents on every reader before the first batch;
- cold, too, under a cost model with a vision encoder (``CostModel(vision=...)``): a shard index knows text lengths
  only, and each image's patches come from its header, so a seed would read the images of ``SEED_SAMPLES`` documents
  on every reader first (1.6 ms a sample on a local tar, ``benchmarks/bench_media.py``: ~50 s); a text-only seed
  would put every level below the packs' real costs.

**Cost per reader** (s samples per shard): the indexes of ``ceil(SEED_SAMPLES / s)`` shards per source (at most
``SEED_SHARDS``; the same shards on every reader; a source whose first sampled shard knows no length stops there),
each one stat and one index read when cached, else one scan written to the cache (tar: its headers; jsonl: the
shard read once; parquet: footer and token column), O(N) to draw them, and lengths-only rounds of at most
``SEED_PACKS`` packs or ``SEED_ROUNDS`` rounds. Measured (``benchmarks/bench_balance_e2e.py --data``, 18 tar
shards of 1,875 samples, capacity 131,072): 1.8 s of CPU with an empty index cache (once per cache directory),
0.18 s with a warm one, most of it the 4,096 packs. Paid once when a reader starts fresh (a restore brings its
histogram).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from streampack.io.index import index_decode, load_or_build_index
from streampack.io.retry import IOStats
from streampack.packing.cost import CostModel
from streampack.packing.schedule import BINS, CostScale
from streampack.packing.window_rounds import PackerRules, run_rounds
from streampack.plan.epoch_plan import chunk_lengths

if TYPE_CHECKING:
    from streampack.plan.epoch_plan import EpochPlanner
    from streampack.settings import Placement, ReadOptions, Sources, StreamConfig

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
UNKNOWN = -1
"""An index length that is not known without tokenizing (text)."""


def seed_levels(config: StreamConfig, sources: Sources, place: Placement, *, planner: Callable[[], EpochPlanner],
                io_stats: IOStats | None = None) -> np.ndarray | None:
    """The histogram (:func:`seed_counts`) every reader of ``config``'s stream starts from, or None for a cold
    start (see the module docstring for which streams); ``planner()`` gives the reader's planner (built on
    first use: only a finite stream or one given ``manifest=`` asks for it)."""
    balance, model = config.cost.balance, config.cost.model
    if (balance is None or not balance.seeded or model is None or model.vision is not None
            or place.global_workers == 1 or sources.packed is not None):
        return None
    if sources.mixture:
        lengths = mixture_lengths([(sources.mixture[name].urls, sources.weights[name])
                                   for name in sorted(sources.mixture)], config.read, config.seed, io_stats)
    elif config.epochs is not None or config.read.manifest is not None:
        plan = planner()  # its manifest stores every shard's index: one read each
        if not plan.shards.known_lengths():
            return None
        lengths = sample_lengths(plan.num_shards, lambda s: plan.samples(s).lengths, config.seed)
    else:
        assert sources.shards is not None
        lengths = sample_lengths(len(sources.shards.urls), index_lengths(sources.shards.urls, config.read, io_stats),
                                 config.seed)
    if lengths is None:
        return None
    scale = CostScale.of(model.linear, model.attention, config.capacity)
    return seed_counts(lengths, config.packer_rules(config.seed), model, scale, seed=config.seed,
                       cut=lambda n: chunk_lengths(n, config.capacity, config.packing.overlong))


def index_lengths(urls: Sequence[str], options: ReadOptions,
                  io_stats: IOStats | None = None) -> Callable[[int], np.ndarray]:
    """``lengths_of(shard)`` for :func:`sample_lengths` from the shard's own index, loaded from (or built into)
    ``options.cache_dir``, where the reader keeps the index it splits a shard by."""
    decode, opts = index_decode(options.decode()), options.open_options()
    return lambda shard: load_or_build_index(urls[shard], decode=decode, opts=opts, cache_dir=options.cache_dir,
                                             stats=io_stats).lengths


def mixture_lengths(sources: Sequence[tuple[Sequence[str], float]], options: ReadOptions, seed: int,
                    io_stats: IOStats | None = None) -> np.ndarray | None:
    """int64 lengths of a mixture's documents: from each ``(urls, weight)`` source, ``weight / sum`` of
    ``SEED_SAMPLES`` drawn from its own sample (a mixture draws each document's source by weight); None when
    any source's sample knows too few lengths (its share cannot be drawn)."""
    total = sum(weight for _, weight in sources)
    rng = np.random.default_rng([int(seed), 0x313])
    drawn: list[np.ndarray] = []
    for number, (urls, weight) in enumerate(sources):
        found = sample_lengths(len(urls), index_lengths(urls, options, io_stats), seed + number,
                               wanted=max(MIN_SAMPLES, round(SEED_SAMPLES * weight / total)))
        if found.size < MIN_SAMPLES:
            return None
        drawn.append(rng.choice(found, round(SEED_SAMPLES * weight / total)))
    return np.concatenate(drawn)


def sample_lengths(num_shards: int, lengths_of: Callable[[int], np.ndarray], seed: int, *,
                   wanted: int | None = None) -> np.ndarray:
    """int64 lengths of the samples in shards drawn by ``seed`` (the same on every reader) until ``wanted``
    (default ``SEED_SAMPLES``) are known; ``lengths_of(shard)`` gives a shard's index lengths (-1 or 0: unknown
    or refused, skipped). A shard whose every length is unknown ends the search: its data set is text tokenized on the
    fly, and reading more indexes (a jsonl index reads its whole shard) would find none either."""
    wanted = SEED_SAMPLES if wanted is None else wanted
    order = np.random.default_rng([int(seed), 0x5EED]).permutation(num_shards)[:SEED_SHARDS]
    found: list[np.ndarray] = []
    total = 0
    for shard in order.tolist():
        lengths = np.asarray(lengths_of(shard), dtype=np.int64)
        if lengths.size and (lengths == UNKNOWN).all():
            break
        lengths = lengths[lengths > 0]
        found.append(lengths)
        total += lengths.size
        if total >= wanted:
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
