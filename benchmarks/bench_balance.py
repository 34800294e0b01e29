"""Simulator: 1,024 data-parallel ranks, token-only vs cost-balanced packing.

    PYTHONPATH=. python benchmarks/bench_balance.py              # benchmarks/README.md's simulator table (~10 min)
    PYTHONPATH=. python benchmarks/bench_balance.py --quick      # 128 ranks, fewer steps (~1 min)
    PYTHONPATH=. python benchmarks/bench_balance.py --out balance.md

Every rank reads its own stream of document lengths from the same distribution and runs the
library's own packer rounds on it (``window_rounds.run_rounds``: window 1024, ``bfd``, the
default ``max_wait`` and ``slack``) — the very rounds :class:`~streampack.nodes.window_packer.
WindowPacker` runs, on lengths alone. The packs each rank makes feed two consumers:

* *token-only* (today's packer): packs leave in the order the packer emits them (each round's
  packs shuffled), ``packs_per_batch`` consecutive packs per batch;
* *cost-balanced*: the same packs go through a :class:`~streampack.packing.reservoir.Reservoir`
  (the node's own emission logic) with the step schedule every rank shares.

Lengths: 98% lognormal (median 1,000 tokens, sigma 1.2) and 2% Pareto (alpha 1.2, from 8,000
tokens), clipped to the capacity (so no document needs the overlong policy; at 128k about
0.07% of documents fill a pack alone). Cost model: Llama-3-8B's shape (hidden 4096, 32 layers,
32 query / 8 key-value heads, FFN 14336, vocabulary 128256, gated, training FLOPs;
``CostModel.from_shape``). A batch's cost is the sum of its packs' ``linear · tokens +
attention · Σ L²``.

Reported per mode: the straggler factor (per step, max over ranks of the batch cost / mean over
ranks; averaged over the measured steps, and its 99th percentile), fill (real tokens / slots of
the packs emitted), latency (rounds a document waits in the packer's window — the same packs in
both modes — and steps a made pack waits before it is emitted), packs forced out by the
reservoir's hold limit, and the packer's resume state measured on a real ``WindowPacker``.

Each balanced variant starts every reader's cost histogram with ``warm`` pack costs drawn
from a pool of packs the same packer made from an independent stream: what a reader has
counted after ``warm / packs_per_batch`` steps of training (the steady state of a long run).
*cold* rows start from nothing (``Balance(seeded=False)``); *seeded* rows start
every rank from the same seed histogram, as the library does by default
(:mod:`streampack.plan.cost_seed`: the packs of one shared sample of lengths). Fill is the packer's (every pack each
rank made): the balance reorders packs, it never changes them.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import emit  # noqa: E402  (benchmarks/report.py; this folder is on sys.path)

from streampack.packing import CostModel  # noqa: E402
from streampack.packing.reservoir import Reservoir  # noqa: E402
from streampack.packing.schedule import BINS, Balance, CostScale, Schedule  # noqa: E402
from streampack.packing.window_rounds import PackerRules, run_rounds  # noqa: E402

LLAMA3_8B = {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 128256}


@dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    capacity: int
    packs_per_batch: int = 1
    ranks: int = 1024
    steps: int = 400
    window: int = 1024
    seed: int = 0
    variants: dict[str, tuple[Balance, int]] = field(
        default_factory=lambda: {"cost-balanced": (Balance(), 20_000), "cost-balanced, cold start": (Balance(), 0)})
    """Balanced consumers to run on the same packs: name -> (options, packs counted before)."""


def doc_lengths(rng: np.random.Generator, n: int, capacity: int) -> np.ndarray:
    """The long-tail distribution of the module docstring (int64 ``[n]``, 1..capacity)."""
    body = rng.lognormal(np.log(1000), 1.2, n)
    tail = 8000 * (1 - rng.random(n)) ** (-1 / 1.2)
    lengths = np.where(rng.random(n) < 0.02, tail, body)
    return np.clip(np.round(lengths), 1, capacity).astype(np.int64)


class Packs:
    """One rank's packs in the order its packer makes them (cost, tokens, documents, round)."""

    def __init__(self, setup: Setup, rank: int, model: CostModel, scale: CostScale) -> None:
        rng = np.random.default_rng((setup.seed, rank))
        rules = PackerRules(capacity=setup.capacity, window=setup.window, seed=rank)  # per-worker seeds
        self.rounds = run_rounds(rules, lambda n: doc_lengths(rng, n, setup.capacity))
        self.model, self.scale = model, scale
        self.cost: list[float] = []
        self.tokens: list[int] = []
        self.docs: list[int] = []
        self.round: list[int] = []
        self.made: list[range] = []  # the packs of each round
        self.waited: list[np.ndarray] = []  # rounds each document waited in the window

    def __len__(self) -> int:
        return len(self.cost)

    def more(self) -> range:
        """Run the next round; the indices of the packs it made."""
        start = len(self.cost)
        made = next(self.rounds)
        r = len(self.waited)
        for lengths in made.packs:
            self.cost.append(self.model.pack_cost(lengths))
            self.tokens.append(int(lengths.sum()))
            self.docs.append(len(lengths))
            self.round.append(r)
        self.waited.append(np.concatenate(made.waited) if made.waited else np.zeros(0, dtype=np.int64))
        self.made.append(range(start, len(self.cost)))
        return self.made[-1]

    def of_round(self, r: int) -> range:
        while len(self.made) <= r:
            self.more()
        return self.made[r]


def pack_pool(setup: Setup, model: CostModel, scale: CostScale, n: int) -> np.ndarray:
    """Normalized costs of ``n`` packs of an independent stream (for warm histograms)."""
    packs = Packs(replace(setup, seed=setup.seed + 1), setup.ranks, model, scale)  # no rank reads it
    while len(packs) < n:
        packs.more()
    return np.asarray(packs.cost[:n]) / scale.full


SEEDED = -1
"""``warm`` of a variant whose readers all start from the library's seed (``plan.cost_seed``):
the packs of one shared sample of ``SEED_SAMPLES`` lengths, the same histogram on every rank."""


def seed_of(setup: Setup, model: CostModel, scale: CostScale) -> np.ndarray:
    """The seed histogram every rank starts from, made the node's way from one sample of lengths
    (of an independent stream: the shard indexes' lengths, not any rank's own documents)."""
    from streampack.plan.cost_seed import SEED_SAMPLES, seed_counts

    sample = doc_lengths(np.random.default_rng((setup.seed, 0x5EED)), SEED_SAMPLES, setup.capacity)
    rules = PackerRules(capacity=setup.capacity, window=setup.window, seed=setup.seed)
    counts = seed_counts(sample, rules, model, scale, seed=setup.seed)
    assert counts is not None
    return counts


def simulate(setup: Setup, model: CostModel) -> list[dict[str, Any]]:
    """One row per consumer: token-only and each balanced variant."""
    k, started = setup.packs_per_batch, time.perf_counter()
    scale = CostScale.of(model.linear, model.attention, setup.capacity)
    warmest = max((w for _, w in setup.variants.values()), default=0)
    pool = pack_pool(setup, model, scale, 4 * warmest) if warmest else np.zeros(0)
    rng = np.random.default_rng(setup.seed + 2)
    seeded = seed_of(setup, model, scale)
    names = ["token-only", *setup.variants]
    options = [None, *setup.variants.values()]
    cost = {n: np.zeros((setup.steps, setup.ranks)) for n in names}
    waits, forced, made = {n: [] for n in names}, dict.fromkeys(names, 0), [0, 0]
    for r in range(setup.ranks):
        packs = Packs(setup, r, model, scale)
        sched = Schedule(seed=setup.seed, packs_per_batch=k, ranks=setup.ranks)
        consumers = []
        for name, option in zip(names, options):
            if option is None:
                consumers.append((name, _TokenOnly(packs, k)))
                continue
            balance, warm = option
            res: Reservoir[int] = Reservoir(balance, sched, scale)
            if warm == SEEDED:
                res.counts += seeded
            elif warm:
                res.counts += np.bincount(scale.bins(rng.choice(pool, warm)), minlength=BINS)
            consumers.append((name, _Balanced(packs, res, balance.reservoir, scale)))
        for name, consumer in consumers:
            for step in range(setup.steps):
                for _ in range(k):
                    i, waited, was_forced = consumer.take(step)
                    cost[name][step, r] += packs.cost[i]
                    waits[name].append(waited)
                    forced[name] += was_forced
        window = np.concatenate(packs.waited)
        made[0] += sum(packs.tokens)
        made[1] += len(packs) * setup.capacity
    rows = []
    for name in names:
        sf = cost[name].max(1) / cost[name].mean(1)
        w = np.asarray(waits[name])
        rows.append({"capacity": setup.capacity, "packs_per_batch": k, "ranks": setup.ranks,
                     "steps": setup.steps, "mode": name,
                     "reservoir": "-" if name == "token-only" else setup.variants[name][0].reservoir,
                     "warm": "-" if name == "token-only" else
                     "seed" if setup.variants[name][1] == SEEDED else setup.variants[name][1],
                     "straggler": round(float(sf.mean()), 4),
                     "straggler_p99": round(float(np.quantile(sf, 0.99)), 4),
                     "fill_%": round(100 * made[0] / made[1], 3),
                     "window_rounds_mean": round(float(window.mean()), 2), "window_rounds_max": int(window.max()),
                     "held_steps_mean": round(float(w.mean()), 1), "held_steps_max": int(w.max()),
                     "forced_by_hold": forced[name], "seconds": round(time.perf_counter() - started, 1)})
    return rows


class _TokenOnly:
    """Today's order: the packer's packs as they come (steps waited: since the round that
    made the pack first reached this consumer)."""

    def __init__(self, packs: Packs, k: int) -> None:
        self.packs, self.k, self.next, self.seen = packs, k, 0, {}

    def take(self, step: int) -> tuple[int, int, bool]:
        while self.next >= len(self.packs):
            self.packs.more()
        i = self.next
        self.next += 1
        first = self.seen.setdefault(self.packs.round[i], step)
        return i, step - first, False


class _Balanced:
    """A reservoir fed from the same packs; ``take`` is the node's ``Reservoir.take``."""

    def __init__(self, packs: Packs, res: Reservoir[int], size: int, scale: CostScale) -> None:
        self.packs, self.res, self.size, self.scale, self.round = packs, res, size, scale, 0

    def take(self, step: int) -> tuple[int, int, bool]:
        while len(self.res) < self.size:  # the node runs rounds until the reservoir is full
            new = self.packs.of_round(self.round)
            self.round += 1
            self.res.add(list(new), np.asarray([self.packs.cost[i] for i in new]) / self.scale.full)
        return self.res.take()


def state_bytes(setup: Setup, model: CostModel, balance: Balance | None, steps: int = 200) -> int:
    """Bytes of a real ``WindowPacker`` state (carried samples as references) after ``steps``
    batches of one rank's stream."""
    from torchdata.nodes import IterableWrapper

    from streampack.nodes.window_packer import Balancing, WindowPacker
    from streampack.plan.state import state_nbytes
    from streampack.sample import Sample, SampleOrigin

    rng = np.random.default_rng(setup.seed)
    lengths = doc_lengths(rng, 200 * setup.window, setup.capacity)

    def docs() -> Any:
        for i, n in enumerate(lengths.tolist()):
            origin = SampleOrigin(shard=0, offset=i, number=i, next_offset=i + 1, next_number=i + 1)
            yield Sample(key=f"d{i}", tokens=np.zeros(n, dtype=np.int64), origin=origin)

    class NoReplay:  # with a replay the state holds references (what is measured); nothing is restored here
        def forget(self) -> None:
            pass

        def __call__(self, refs: np.ndarray, store: Any) -> np.ndarray:
            raise AssertionError("not restored here")

    balancing = None if balance is None else Balancing(balance=balance, cost_model=model,
                                                       schedule=Schedule(packs_per_batch=setup.packs_per_batch))
    packer = WindowPacker(IterableWrapper(docs()), rules=PackerRules(capacity=setup.capacity, window=setup.window),
                          replay=NoReplay(), balance=balancing)
    packer.reset()
    for _ in range(steps * setup.packs_per_batch):
        next(packer)
    return state_nbytes(packer.state_dict())


def setups(quick: bool) -> list[Setup]:
    ranks, steps, warm = (128, 120, 5_000) if quick else (1024, 400, 20_000)
    out = []
    for capacity in (32768, 131072):
        for k in (1, 4):
            variants = {"cost-balanced": (Balance(), warm), "cost-balanced, cold start": (Balance(), 0),
                        "cost-balanced, seeded (the default)": (Balance(), SEEDED)}
            if capacity == 131072 and k == 1 and not quick:  # the trade-offs: reservoir size, warm-up
                variants.update({f"cost-balanced, reservoir {r}": (Balance(reservoir=r), warm) for r in (16, 32, 128)})
                variants["cost-balanced, histogram of 2,000 packs"] = (Balance(), 2_000)
            out.append(Setup(capacity=capacity, packs_per_batch=k, ranks=ranks, steps=steps, variants=variants))
    return out


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Rows for ``benchmarks/run_all.py``: every setup, both modes, plus the state sizes."""
    model = CostModel.from_shape(**LLAMA3_8B)
    rows = []
    for setup in setups(quick):
        found = simulate(setup, model)
        sizes = {None: state_bytes(setup, model, None, steps=50 if quick else 200)}
        for row in found:
            res = row["reservoir"]
            balance = None if res == "-" else Balance(reservoir=int(res))
            if balance not in sizes:
                sizes[balance] = state_bytes(setup, model, balance, steps=50 if quick else 200)
            row["state_KB"] = round(sizes[balance] / 1024, 1)
        rows += found
        print(f"bench_balance: capacity {setup.capacity}, {setup.packs_per_batch} packs per batch done "
              f"({found[-1]['seconds']} s)", file=sys.stderr, flush=True)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    cols = ["capacity", "packs_per_batch", "mode", "reservoir", "warm", "straggler", "straggler_p99", "fill_%",
            "window_rounds_mean", "window_rounds_max", "held_steps_mean", "held_steps_max", "forced_by_hold",
            "state_KB"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="128 ranks, 120 steps")
    p.add_argument("--out", help="also write the markdown table here")
    args = p.parse_args(argv)
    rows = run(quick=args.quick)
    head = (f"{rows[0]['ranks']} ranks, {rows[0]['steps']} steps measured, cost model: Llama-3-8B shape "
            f"(training FLOPs)")
    text = head + "\n\n" + markdown(rows)
    return emit(text, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
