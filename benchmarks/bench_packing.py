"""Benchmark the packers: bins, fill, bins over the lower bound, and wall time.

    python benchmarks/bench_packing.py --sizes 1e4 1e5 1e6 --capacity 4096 \
        --dists lognormal uniform --out packing.md

Lengths: lognormal with mean 600 (sigma 1) clipped to [1, capacity], or uniform over
[1, capacity]; fixed seed. Times are the best of 3 after one warm-up call, one core.
Baselines, measured in the same run: a plain-Python O(n·m) first-fit decreasing (n <= 1e5,
one run, abandoned after 60 s); the greedy knapsack over a sorted list that the fastest public
packers use (repeatedly take the longest remaining item that fits; O(n²) list deletions);
"pad to max" (every item in its own row of the longest length) and "pad per batch of 8"
(data order, each batch of 8 padded to its own longest item).
"""

from __future__ import annotations

import argparse
import bisect
import time
from collections.abc import Callable

import numpy as np

from streampack.packing import ALGORITHMS

SEED = 1234
NAIVE_MAX_N = 100_000
NAIVE_TIME_CAP_S = 60.0
KK_MAX_N = 10_000  # kk re-partitions O(log n) times at O(n·k) each: window-sized inputs only


def make_lengths(dist: str, n: int, capacity: int, seed: int = SEED) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dist == "lognormal":
        raw = rng.lognormal(np.log(600.0) - 0.5, 1.0, n)
        return np.clip(np.round(raw), 1, capacity).astype(np.int64)
    if dist == "uniform":
        return rng.integers(1, capacity + 1, n, dtype=np.int64)
    raise ValueError(f"unknown distribution {dist!r}; valid: lognormal, uniform")


def naive_ffd(lengths: np.ndarray, capacity: int, deadline: float = float("inf")) -> list[list[int]]:
    """First-fit decreasing by scanning every open bin, the O(n·m) way peers do it.

    Raises ``TimeoutError`` once ``time.perf_counter()`` passes ``deadline``.
    """
    remaining: list[int] = []
    bins: list[list[int]] = []
    for j, i in enumerate(sorted(range(len(lengths)), key=lambda i: -int(lengths[i]))):
        if j % 1024 == 0 and time.perf_counter() > deadline:
            raise TimeoutError
        x = int(lengths[i])
        for b, room in enumerate(remaining):
            if room >= x:
                remaining[b] -= x
                bins[b].append(i)
                break
        else:
            remaining.append(capacity - x)
            bins.append([i])
    return bins


def _best_time(fn: Callable[[], object], repeats: int = 3) -> tuple[float, object]:
    result = fn()  # warm-up (and numba cache load)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def sorted_greedy_knapsack(lengths: np.ndarray, capacity: int, seed: int = 0) -> list[list[int]]:
    """Reference: fill one bin at a time with the longest remaining item that fits."""
    order = sorted(range(len(lengths)), key=lambda i: int(lengths[i]))
    keys = [int(lengths[i]) for i in order]
    bins: list[list[int]] = []
    while order:
        room, members = capacity, []
        while order:
            j = bisect.bisect_right(keys, room) - 1
            if j < 0:
                break
            room -= keys.pop(j)
            members.append(order.pop(j))
        bins.append(members)
    return bins


def pad_per_batch_slots(lengths: np.ndarray, batch: int = 8) -> int:
    """Tokens computed when each batch of ``batch`` items (data order) is padded to its longest."""
    n = len(lengths) - len(lengths) % batch
    full = int(lengths[:n].reshape(-1, batch).max(axis=1).sum()) * batch
    rest = lengths[n:]
    return full + (int(rest.max()) * len(rest) if len(rest) else 0)


def run(sizes: list[int], capacity: int, dists: list[str]) -> list[dict]:
    """One row per (distribution, n, algorithm): bins, fill %, bins / lower bound, seconds."""
    rows: list[dict] = []
    for dist in dists:
        for n in sizes:
            lengths = make_lengths(dist, n, capacity)
            tokens = int(lengths.sum())
            lower = -(-tokens // capacity)
            base = {"dist": dist, "n": n, "capacity": capacity, "lower_bound": lower}

            def row(name: str, bins: int, seconds: float | None, slots: int) -> dict:
                return {**base, "algorithm": name, "bins": bins, "fill_pct": 100.0 * tokens / slots,
                        "bins_over_lb": bins / lower, "seconds": seconds}

            pad = int(lengths.max())
            rows.append(row("pad to max (ref)", n, None, n * pad))
            per_batch = pad_per_batch_slots(lengths)
            rows.append({**row("pad per batch of 8 (ref)", n, None, per_batch),
                         "bins": -(-n // 8), "bins_over_lb": per_batch / (lower * capacity)})
            start = time.perf_counter()
            bins = sorted_greedy_knapsack(lengths, capacity)  # one run: O(n²), ~15 s at 1e6
            rows.append(row("sorted greedy knapsack (ref)", len(bins), time.perf_counter() - start,
                            len(bins) * capacity))
            packers: dict[str, Callable] = dict(ALGORITHMS)
            if n <= NAIVE_MAX_N:
                packers["naive O(n·m) FFD (ref)"] = naive_ffd
            for name, fn in packers.items():
                if name == "kk" and n > KK_MAX_N:
                    continue
                if name.startswith("naive"):  # one timed run, abandoned past the cap
                    start = time.perf_counter()
                    try:
                        bins = fn(lengths, capacity, deadline=start + NAIVE_TIME_CAP_S)
                    except TimeoutError:
                        rows.append({**row(name, 0, None, 1), "bins": None, "fill_pct": None,
                                     "bins_over_lb": None, "note": f"> {NAIVE_TIME_CAP_S:.0f} s"})
                        continue
                    seconds = time.perf_counter() - start
                else:
                    seconds, bins = _best_time(lambda: fn(lengths, capacity, seed=SEED))
                rows.append(row(name, len(bins), seconds, len(bins) * capacity))
    return rows


def to_markdown(rows: list[dict]) -> str:
    lines = ["| dist | n | algorithm | bins | fill % | bins / LB | time |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        if r["bins"] is None:
            lines.append(f"| {r['dist']} | {r['n']:.0e} | {r['algorithm']} | – | – | – | {r['note']} |")
            continue
        t = "–" if r["seconds"] is None else f"{r['seconds'] * 1e3:.1f} ms"
        lines.append(f"| {r['dist']} | {r['n']:.0e} | {r['algorithm']} | {r['bins']} | "
                     f"{r['fill_pct']:.2f} | {r['bins_over_lb']:.5f} | {t} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", type=float, default=[1e4, 1e5, 1e6])
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--dists", nargs="+", default=["lognormal", "uniform"])
    parser.add_argument("--out", type=str, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    table = to_markdown(run([int(s) for s in args.sizes], args.capacity, args.dists))
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
