"""Best-fit decreasing (``bfd``): each item, longest first, goes into the open bin with the
least remaining space that still holds it; ties go to the bin that reached that space last.

Items only shrink, so the bins split into two heaps: ``fit`` (room >= x, a min-heap) and ``low``
(room < x, a max-heap); every bin changes heap at most once per item placed in it, so the loop is
O(n log m) with one int key ``room·(n+1) + (n − step)``. ~60 ms at 1e6 compiled
(``benchmarks/bench_packing_scaling.py``); bin counts equal FFD's, within 0.01% of ceil(sum / C).
"""

from __future__ import annotations

import heapq

import numpy as np

from streampack.packing._common import decreasing_order
from streampack.packing._engine import Engine, IntBuffer, Packer
from streampack.packing.result import PackResult


def _bfd_kernel(xs: IntBuffer, capacity: int, bins: IntBuffer, bin_at_step: IntBuffer) -> int:
    """Place lengths ``xs`` (longest first) by best fit; ``bins[j]`` := bin of item j;
    ``bin_at_step`` is scratch ``[n + 1]``. Returns the number of bins."""
    n = len(xs)
    stride = n + 1
    fit = [capacity]  # the list's element type, for numba; removed on the next line
    fit.pop()
    low = [capacity]
    low.pop()
    num_bins = 0
    for j in range(n):
        x = xs[j]
        while low and -low[0] >= x * stride:  # rooms >= x now fit
            heapq.heappush(fit, -heapq.heappop(low))
        if fit:
            key = fit[0]
            room = key // stride - x
            b = bin_at_step[n - key % stride]
        else:
            key = -1  # no bin fits: open one
            b = num_bins
            num_bins += 1
            room = capacity - x
        bins[j] = b
        bin_at_step[j] = b
        new_key = room * stride + n - j
        if room >= x:  # still holds an item of this size: the bin stays in `fit`
            if key >= 0:
                heapq.heapreplace(fit, new_key)  # one sift instead of a pop and a push
            else:
                heapq.heappush(fit, new_key)
        else:
            if key >= 0:
                heapq.heappop(fit)
            if room > 0:
                heapq.heappush(low, -new_key)
    return num_bins


def _bfd(lengths: np.ndarray, capacity: int, seed: int, engine: Engine) -> PackResult:
    """Best-fit decreasing, O(n log n). Layout: bins in creation order, items in a bin
    longest first (placement order), equal lengths by index. ``seed`` is unused."""
    if capacity * (lengths.size + 1) >= 1 << 63:
        engine = Engine(compiled=False)  # the int64 heap keys would overflow
    order = decreasing_order(lengths)
    xs = lengths[order]
    bins = engine.buffer(np.zeros(xs.size, dtype=np.int64))
    scratch = engine.buffer(np.zeros(xs.size + 1, dtype=np.int64))
    num_bins = engine.kernel(_bfd_kernel)(engine.buffer(xs), capacity, bins, scratch)
    return engine.result(order, bins, num_bins)


bfd = Packer(name="bfd", impl=_bfd)
