"""``kk``: the fewest bins, then loads balanced by pairwise Karmarkar–Karp differencing.

``bfd`` gives the bin count (a k-way search gives 0.6–0.9% more bins and grows superlinearly), with its slack piled into
the last bins; rounds of pairwise rebalancing spread it. Bins ranked by load are paired (even rounds lightest with
heaviest, odd rounds rank i with i + ⌈m/2⌉) and each pair re-split by 2-way Karmarkar–Karp, kept only if it lowers the
pair's larger load. At most ``2·bit_length(m) + 2`` rounds, ending once a round lowers the load variance by less than
2%: O(n log² n) time, O(n) memory (0.3–0.6 s at 1e6 compiled, ``benchmarks/bench_packing_scaling.py``). Layout: bins by
decreasing load, item indices ascending inside a bin. ``seed`` is unused.
"""

from __future__ import annotations

import heapq

import numpy as np

from streampack.packing._engine import Engine, IntBuffer, Packer
from streampack.packing.best_fit import bfd
from streampack.packing.result import PackResult

STOP_GAIN = 0.02
"""Rebalancing stops once two rounds lower the variance of the loads by less than this
share. Measured (lognormal, C = 4096): windows of 256–8192 items keep improving until the
round cap (14–24 rounds), 1e5 items stop after 20–24 of 30, 1e6 after 12–14 of 38."""


def _round_kernel(lengths: IntBuffer, first: IntBuffer, nxt: IntBuffer, loads: IntBuffer,
                  pairs_lo: IntBuffer, pairs_hi: IntBuffer, side: IntBuffer, min_gap: int) -> int:
    """One round: re-split each pair (lo, hi) of bins whose loads differ by ``min_gap`` or more by 2-way KK
    differencing, keeping a split only when it lowers the pair's larger load. Bin b's items are a linked list
    (``first[b]``, ``nxt[item]``, -1 ends it); ``loads``, ``first`` and ``nxt`` are updated, ``side`` is scratch
    ``[n]``. Returns how many pairs changed."""
    changed = 0
    heap = [(0, 0)]  # (-value, representative item); the element gives numba the type
    union = [0]
    merged = [0]  # items in the order they were set against another
    mate = [0]  # the item each of `merged` was set against
    for p in range(len(pairs_lo)):
        lo, hi = pairs_lo[p], pairs_hi[p]
        old = max(loads[lo], loads[hi])
        if old - min(loads[lo], loads[hi]) < min_gap:
            continue
        heap.clear()
        union.clear()
        for b in (lo, hi):
            item = first[b]
            while item >= 0:
                union.append(item)
                heap.append((-lengths[item], item))
                item = nxt[item]
        heapq.heapify(heap)
        merged.clear()
        mate.clear()
        while len(heap) > 1:  # the larger survives as the difference, the smaller goes opposite
            big, a = heapq.heappop(heap)
            small, b = heapq.heappop(heap)
            merged.append(b)
            mate.append(a)
            heapq.heappush(heap, (big - small, a))
        side[heap[0][1]] = 0
        for i in range(len(merged) - 1, -1, -1):  # every item after the one it was set against
            side[merged[i]] = 1 - side[mate[i]]
        total0 = total1 = 0
        for item in union:
            if side[item] == 0:
                total0 += lengths[item]
            else:
                total1 += lengths[item]
        if max(total0, total1) >= old:
            continue
        first[lo] = first[hi] = -1
        for item in union:
            b = lo if side[item] == 0 else hi
            nxt[item] = first[b]
            first[b] = item
        loads[lo], loads[hi] = total0, total1
        changed += 1
    return changed


def _kk(lengths: np.ndarray, capacity: int, seed: int, engine: Engine) -> PackResult:
    """Fewest bins (``bfd``'s), then pairwise KK rebalancing (see the module docstring)."""
    start = bfd.impl(lengths, capacity, seed, engine)
    m = start.num_bins
    loads = start.loads(lengths)
    if m > 1:
        bin_of, loads = _rebalance(lengths, start, loads, engine)
    else:
        bin_of = np.zeros(lengths.size, dtype=np.int64)
    rank = np.empty(m, dtype=np.int64)
    rank[np.argsort(-loads, kind="stable")] = np.arange(m)
    return engine.result(np.arange(lengths.size, dtype=np.int64), rank[bin_of], m)


def _rebalance(lengths: np.ndarray, start: PackResult, loads: np.ndarray,
               engine: Engine) -> tuple[np.ndarray, np.ndarray]:
    """Rounds of ``_round_kernel`` (see the module docstring); returns (bin of every item, loads)."""
    m, half = loads.size, loads.size // 2
    nxt = np.full(lengths.size, -1, dtype=np.int64)  # each bin's items, linked in `order`
    nxt[start.order[:-1]] = start.order[1:]
    nxt[start.order[start.offsets[1:] - 1]] = -1
    first = engine.buffer(start.order[start.offsets[:-1]])
    nxt_b, loads_b = engine.buffer(nxt), engine.buffer(loads)
    lengths_b, side = engine.buffer(lengths), engine.buffer(np.zeros(lengths.size, dtype=np.int64))
    kernel = engine.kernel(_round_kernel)
    variance = [float(np.var(loads))] * 2
    for r in range(2 * m.bit_length() + 2):
        now = np.asarray(loads_b, dtype=np.int64)
        ranks = np.argsort(now, kind="stable")
        gap = max(2, int(now[ranks[-1]] - now[ranks[0]]) // 4)  # leave the near-equal pairs
        hi = ranks[::-1][:half] if r % 2 == 0 else ranks[m - half:]  # fold, then shift
        kernel(lengths_b, first, nxt_b, loads_b, engine.buffer(ranks[:half]), engine.buffer(hi), side, gap)
        variance.append(float(np.var(np.asarray(loads_b, dtype=np.int64))))
        if variance[-1] > (1 - STOP_GAIN) * variance[-3]:
            break
    bin_of = engine.buffer(np.zeros(lengths.size, dtype=np.int64))
    engine.kernel(_unlink_kernel)(first, nxt_b, bin_of)
    return np.asarray(bin_of, dtype=np.int64), np.asarray(loads_b, dtype=np.int64)


def _unlink_kernel(first: IntBuffer, nxt: IntBuffer, bin_of: IntBuffer) -> None:
    """``bin_of[item]`` := the bin whose linked list holds it."""
    for b in range(len(first)):
        item = first[b]
        while item >= 0:
            bin_of[item] = b
            item = nxt[item]


kk = Packer(name="kk", impl=_kk)
