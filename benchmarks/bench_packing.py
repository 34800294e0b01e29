"""Benchmark the packers: bins against the lower bound, fill, load balance, time and memory.

    PYTHONPATH=. python benchmarks/bench_packing.py --sizes 1e4 1e5 1e6 --capacity 4096 \
        --dists lognormal heavy_tail --out /tmp/packing_results.md

Lengths (fixed seed, clipped to [1, capacity]):
- ``lognormal``: lognormal with mean 600 and sigma 1 (median 364), rounded;
- ``heavy_tail``, real-text-like: 70% short documents (lognormal, median 200, sigma 0.8) and
  30% long ones from a Pareto tail (alpha 1.2, scale 400), so ~2% sit at the capacity as if
  truncated — many tiny items, a fat tail of long ones;
- ``uniform``: uniform over [1, capacity].

Each algorithm runs through ``pack_flat`` with ``backend="auto"`` (plain Python below
``THRESHOLD`` items, compiled above). Time: best wall and best CPU time of 3 calls
(``--repeats``) after one warm-up call, so compiling is excluded (bench_packing_cold.py
reports it, and this script appends its tables, then bench_packing_scaling.py's table of
``pack_flat`` / ``pack`` / first call in a fresh process against a plain numba BFD). Peak
extra memory: in a fresh process, the rise of the peak RSS (Linux ``VmHWM``, reset before
the call) over the RSS before it, so numba's allocations count too; it includes the result
(order + offsets, ~9 MB at 1e6). Load CV: std / mean of bin loads.
References, measured in the same run: "pad to max" and "pad per batch of 8" (fill only), the
greedy knapsack over a sorted list that the fastest public packers use (O(n²)), and a
plain-Python O(n·m) first-fit decreasing (n <= 1e5, abandoned after 60 s).
"""

from __future__ import annotations

import argparse
import bisect
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from streampack.packing import ALGORITHMS, pack_flat

SEED = 1234
ROOT = Path(__file__).resolve().parent.parent
NAIVE_MAX_N = 100_000
NAIVE_TIME_CAP_S = 60.0


def make_lengths(dist: str, n: int, capacity: int, seed: int = SEED) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dist == "lognormal":
        raw = rng.lognormal(np.log(600.0) - 0.5, 1.0, n)  # mean exp(mu + sigma²/2) = 600
    elif dist == "heavy_tail":
        short = rng.lognormal(np.log(200.0), 0.8, n)
        long = (rng.pareto(1.2, n) + 1.0) * 400.0
        raw = np.where(rng.random(n) < 0.7, short, long)
    elif dist == "uniform":
        return rng.integers(1, capacity + 1, n, dtype=np.int64)
    else:
        raise ValueError(f"unknown distribution {dist!r}; valid: lognormal, heavy_tail, uniform")
    return np.clip(np.round(raw), 1, capacity).astype(np.int64)


def naive_ffd(lengths: np.ndarray, capacity: int, deadline: float = float("inf")) -> int:
    """Bins of first-fit decreasing by scanning every open bin, the O(n·m) way peers do it.

    Raises ``TimeoutError`` once ``time.perf_counter()`` passes ``deadline``.
    """
    remaining: list[int] = []
    for j, x in enumerate(sorted(lengths.tolist(), reverse=True)):
        if j % 1024 == 0 and time.perf_counter() > deadline:
            raise TimeoutError
        for b, room in enumerate(remaining):
            if room >= x:
                remaining[b] -= x
                break
        else:
            remaining.append(capacity - x)
    return len(remaining)


def sorted_greedy_knapsack(lengths: np.ndarray, capacity: int) -> int:
    """Bins when each bin, one at a time, takes the longest remaining item that fits."""
    keys = sorted(lengths.tolist())
    bins = 0
    while keys:
        room = capacity
        bins += 1
        while keys:
            j = bisect.bisect_right(keys, room) - 1
            if j < 0:
                break
            room -= keys.pop(j)
    return bins


def pad_per_batch_slots(lengths: np.ndarray, batch: int = 8) -> int:
    """Tokens computed when each batch of ``batch`` items (data order) is padded to its longest."""
    n = len(lengths) - len(lengths) % batch
    full = int(lengths[:n].reshape(-1, batch).max(axis=1).sum()) * batch
    rest = lengths[n:]
    return full + (int(rest.max()) * len(rest) if len(rest) else 0)


def best_time(fn: Callable[[], object], repeats: int = 3) -> tuple[float, float]:
    """(best wall seconds, best CPU seconds) of ``repeats`` calls after a warm-up (which
    compiles or loads kernels). On a shared machine the CPU time is the steadier number: the
    packers are single-threaded, so uncontended wall time equals it."""
    fn()
    wall = cpu = float("inf")
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
    return wall, cpu


MEMORY_PROBE = """
import json, re, sys
from pathlib import Path
sys.path.insert(0, {bench_dir!r})
from bench_packing import make_lengths
from streampack.packing import THRESHOLD, pack_flat

def status_kb(field):
    return int(re.search(field + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1))

lengths = make_lengths({dist!r}, {n}, {capacity})
pack_flat(lengths[:min({n}, THRESHOLD)], {capacity}, {name!r})  # load kernels, warm caches
Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
before = status_kb("VmRSS")
pack_flat(lengths, {capacity}, {name!r}, {seed})
print(json.dumps((status_kb("VmHWM") - before) / 1024))
"""


def peak_extra_mb(dist: str, n: int, capacity: int, name: str) -> float | None:
    """Peak RSS above the RSS before one ``pack_flat`` call, in MB, measured in a fresh
    process (Linux only; None elsewhere). A fixed glibc mmap threshold makes every large
    block come from, and go back to, the OS, so earlier frees cannot hide the peak."""
    if not Path("/proc/self/clear_refs").exists():
        return None
    code = MEMORY_PROBE.format(bench_dir=str(Path(__file__).resolve().parent), dist=dist, n=n,
                               capacity=capacity, name=name, seed=SEED)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    return float(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None


def _row(base: dict, name: str, bins: int | None, seconds: float | None, **extra: object) -> dict:
    lower, tokens, capacity = base["lower_bound"], base["tokens"], base["capacity"]
    return {**base, "algorithm": name, "bins": bins,
            "fill_pct": None if bins is None else 100.0 * tokens / (bins * capacity),
            "bins_over_lb": None if bins is None else bins / lower, "seconds": seconds, **extra}


def reference_rows(base: dict, lengths: np.ndarray, capacity: int) -> list[dict]:
    """Rows for padding and for the slow packers that public tools use."""
    n, tokens = lengths.size, base["tokens"]
    rows = [{**_row(base, "pad to max (ref)", n, None),
             "fill_pct": 100.0 * tokens / (n * int(lengths.max()))}]
    per_batch = pad_per_batch_slots(lengths)
    rows.append({**_row(base, "pad per batch of 8 (ref)", -(-n // 8), None),
                 "fill_pct": 100.0 * tokens / per_batch,
                 "bins_over_lb": per_batch / (base["lower_bound"] * capacity)})
    start = time.perf_counter()
    bins = sorted_greedy_knapsack(lengths, capacity)  # one run: O(n²), ~10 s at 1e6
    rows.append(_row(base, "sorted greedy knapsack (ref)", bins, time.perf_counter() - start))
    if n <= NAIVE_MAX_N:
        start = time.perf_counter()
        try:
            bins = naive_ffd(lengths, capacity, deadline=start + NAIVE_TIME_CAP_S)
            rows.append(_row(base, "naive O(n·m) FFD (ref)", bins, time.perf_counter() - start))
        except TimeoutError:
            rows.append(_row(base, "naive O(n·m) FFD (ref)", None, None,
                             note=f"> {NAIVE_TIME_CAP_S:.0f} s"))
    return rows


def run(sizes: list[int], capacity: int, dists: list[str], refs: bool = True,
        repeats: int = 3) -> list[dict]:
    """One row per (distribution, n, algorithm)."""
    rows: list[dict] = []
    for dist in dists:
        for n in sizes:
            lengths = make_lengths(dist, n, capacity)
            tokens = int(lengths.sum())
            base = {"dist": dist, "n": n, "capacity": capacity, "tokens": tokens,
                    "lower_bound": -(-tokens // capacity)}
            if refs:
                rows += reference_rows(base, lengths, capacity)
            for name in ALGORITHMS:
                seconds, cpu = best_time(lambda: pack_flat(lengths, capacity, name, SEED), repeats)
                result = pack_flat(lengths, capacity, name, SEED)
                loads = result.loads(lengths)
                memory = peak_extra_mb(dist, n, capacity, name)
                rows.append(_row(base, name, result.num_bins, seconds, cpu_seconds=cpu,
                                 load_cv=float(loads.std() / loads.mean()), peak_mb=memory))
            print(f"  {dist} n={n}: done", file=sys.stderr, flush=True)
    return rows


def to_markdown(rows: list[dict]) -> str:
    lines = ["| dist | n | algorithm | bins | bins / LB | fill % | load CV | time | CPU time "
             "| peak extra MB |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["bins"] is None:
            lines.append(f"| {r['dist']} | {r['n']:.0e} | {r['algorithm']} | – | – | – | – | "
                         f"{r['note']} | – | – |")
            continue
        t = "–" if r["seconds"] is None else f"{r['seconds'] * 1e3:.1f} ms"
        c = "–" if r.get("cpu_seconds") is None else f"{r['cpu_seconds'] * 1e3:.1f} ms"
        cv = "–" if r.get("load_cv") is None else f"{r['load_cv']:.5f}"
        mb = "–" if r.get("peak_mb") is None else f"{r['peak_mb']:.1f}"
        lines.append(f"| {r['dist']} | {r['n']:.0e} | {r['algorithm']} | {r['bins']} | "
                     f"{r['bins_over_lb']:.5f} | {r['fill_pct']:.2f} | {cv} | {t} | {c} | {mb} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", type=float, default=[1e4, 1e5, 1e6])
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--dists", nargs="+", default=["lognormal", "heavy_tail"])
    parser.add_argument("--no-refs", action="store_true", help="skip the slow reference packers")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per cell (best kept)")
    parser.add_argument("--no-cold", action="store_true", help="skip compile / window-size tables")
    parser.add_argument("--no-scaling", action="store_true",
                        help="skip the algorithm x size table against a plain numba BFD")
    parser.add_argument("--out", type=str, default=None,
                        help="also write the tables here (default: print them only)")
    args = parser.parse_args(argv)
    report = to_markdown(run([int(s) for s in args.sizes], args.capacity, args.dists,
                             refs=not args.no_refs, repeats=args.repeats))
    if not args.no_cold:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_packing_cold

        report += "\n" + bench_packing_cold.report(args.capacity)
    if not args.no_scaling:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_packing_scaling

        report += "\n" + bench_packing_scaling.to_markdown(bench_packing_scaling.run())
    print(report)
    if args.out:
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
