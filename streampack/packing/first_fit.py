"""First-fit packers: ``ffd`` (longest first) and ``ffs`` (first-fit shuffle).

"The leftmost bin whose room is >= x" is one O(log m) descent of a max-tree over the rooms, where a scan of the open
bins is O(n·m) (48 s for 1e5 lengths in NeMo-RL's code). The tree is sized by the any-fit bound (``2·sum // C + 2``),
unopened bins at the right with room C, so bins are numbered in creation order. ``mffd`` reuses the kernel.
"""

from __future__ import annotations

import numpy as np

from streampack.packing._common import any_fit_bin_bound, decreasing_order, shuffled_order
from streampack.packing._engine import Engine, IntBuffer, Packer
from streampack.packing.result import PackResult


def room_tree(rooms: np.ndarray, num_leaves: int, capacity: int) -> np.ndarray:
    """Max-tree (root at 1, leaves from ``size``) over ``num_leaves`` bins: the first ones
    with ``rooms``, the rest unopened (room = C). Padding leaves hold 0, which fits nothing."""
    size = 1 << max(num_leaves - 1, 0).bit_length()
    tree = np.zeros(2 * size, dtype=np.int64)
    tree[size:size + num_leaves] = capacity
    tree[size:size + rooms.size] = rooms
    lo = size
    while lo > 1:  # one vectorised pass per level
        tree[lo // 2:lo] = np.maximum(tree[lo:2 * lo:2], tree[lo + 1:2 * lo:2])
        lo //= 2
    return tree


def first_fit_kernel(xs: IntBuffer, tree: IntBuffer, bins: IntBuffer, num_bins: int, limit: int) -> int:
    """Place lengths ``xs`` in order, each into the leftmost bin of ``tree`` with room. ``bins[j]`` := its bin, or -1
    (item left out) when that bin is ``>= limit``. Returns the number of bins opened, starting from ``num_bins``."""
    size = len(tree) // 2
    for j in range(len(xs)):
        x = xs[j]
        if tree[1] < x:
            raise RuntimeError("first-fit tree exhausted: any-fit bin bound violated")
        node = 1
        while node < size:
            node += node
            if tree[node] < x:
                node += 1
        b = node - size
        if b >= limit:
            bins[j] = -1
            continue
        if b == num_bins:
            num_bins += 1
        bins[j] = b
        tree[node] -= x
        node //= 2
        while node > 0:
            best = max(tree[2 * node], tree[2 * node + 1])
            if tree[node] == best:
                break  # ancestors already hold this maximum
            tree[node] = best
            node //= 2
    return num_bins


def _first_fit(lengths: np.ndarray, capacity: int, seq: np.ndarray, engine: Engine) -> PackResult:
    tree = room_tree(np.zeros(0, dtype=np.int64), any_fit_bin_bound(lengths, capacity), capacity)
    bins = engine.buffer(np.zeros(seq.size, dtype=np.int64))
    args = (engine.buffer(lengths[seq]), engine.buffer(tree), bins, 0, seq.size)
    return engine.result(seq, bins, engine.kernel(first_fit_kernel)(*args))


def _ffd(lengths: np.ndarray, capacity: int, seed: int, engine: Engine) -> PackResult:
    """First-fit decreasing, O(n log n): longest first (ties by index), each into the leftmost bin with room. Layout:
    bins in creation order, items in placement order. ``seed`` is unused."""
    return _first_fit(lengths, capacity, decreasing_order(lengths), engine)


def _ffs(lengths: np.ndarray, capacity: int, seed: int, engine: Engine) -> PackResult:
    """First-fit shuffle, O(n log n): first fit in a seeded random order (+0.1…+2.5% bins over FFD,
    ``benchmarks/bench_packing.py``), keeping lengths mixed inside packs."""
    return _first_fit(lengths, capacity, shuffled_order(lengths.size, seed), engine)


ffd = Packer(name="ffd", impl=_ffd)
ffs = Packer(name="ffs", impl=_ffs)
