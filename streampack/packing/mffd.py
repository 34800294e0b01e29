"""Johnson–Garey (1985) modified first-fit decreasing (``mffd``), phases as NeMo-RL describes them,
each O(log n) per item where NeMo-RL's are O(n·m):

1. classes: large > C/2 >= medium > C/3 >= small > C/6 >= tiny; every large item opens a bin;
2. medium items, largest first, by first fit over the large bins only;
3. a backward pass over the large bins (roomiest first): if the two smallest unused small items
   fit, add the smallest, then the largest unused small item that still fits;
4. every item left, largest first, by first fit over all bins (``first_fit``'s kernel).
"""

from __future__ import annotations

import numpy as np

from streampack.packing._common import any_fit_bin_bound, decreasing_order
from streampack.packing._engine import Engine, IntBuffer, Packer
from streampack.packing.first_fit import first_fit_kernel, room_tree
from streampack.packing.result import PackResult


def _pairs_kernel(rooms: IntBuffer, vals: IntBuffer, left: IntBuffer, taken: IntBuffer,
                  pair_slots: IntBuffer, pair_bins: IntBuffer) -> int:
    """Phase 3. ``rooms``: room of each large bin (updated); ``vals``: small lengths,
    increasing; ``left``: identity ``[len(vals) + 1]`` (union-find "last free slot <= t",
    shifted by one); ``taken``: zeros. Logs each placement as (slot, bin); returns the count."""
    m = len(vals)
    lo = 0  # smallest free slot: slots only ever get taken, so it only moves up
    k = 0
    for b in range(len(rooms) - 1, -1, -1):
        while lo < m and taken[lo]:
            lo += 1
        lo2 = lo + 1
        while lo2 < m and taken[lo2]:
            lo2 += 1
        if lo2 >= m:
            break
        room = rooms[b]
        if vals[lo] + vals[lo2] > room:
            continue
        room -= vals[lo]
        a, z = lo2, m  # first slot with vals > room (>= lo2 + 1 since vals[lo2] <= room)
        while a < z:
            mid = (a + z) // 2
            if vals[mid] <= room:
                a = mid + 1
            else:
                z = mid
        s = a  # last free slot <= a - 1 is find(left, a) - 1, with path halving
        while left[s] != s:
            left[s] = left[left[s]]
            s = left[s]
        hi = s - 1
        for t in (lo, hi):
            taken[t] = 1
            left[t + 1] = t
            pair_slots[k] = t
            pair_bins[k] = b
            k += 1
        rooms[b] = room - vals[hi]
    return k


def _mffd(lengths: np.ndarray, capacity: int, seed: int, engine: Engine) -> PackResult:
    """Modified first-fit decreasing (see the module docstring). Layout: bins in creation
    order (large bins first), items in a bin in placement order. ``seed`` is unused."""
    order = decreasing_order(lengths)
    xs = lengths[order]
    # class starts in the decreasing order: x > C // d is d·x > C without an int64 overflow
    med0, small0, tiny0 = (int(np.count_nonzero(xs > capacity // d)) for d in (2, 3, 6))
    bound = any_fit_bin_bound(lengths, capacity)
    first_fit = engine.kernel(first_fit_kernel)
    # phase 2: large bins are the first leaves; a medium item whose leftmost fit is not
    # a large bin (limit = med0) is left for phase 4 (bins[j] = -1)
    tree = engine.buffer(room_tree(capacity - xs[:med0], bound, capacity))
    medium = engine.buffer(np.zeros(small0 - med0, dtype=np.int64))
    first_fit(engine.buffer(xs[med0:small0]), tree, medium, med0, med0)
    medium = np.asarray(medium, dtype=np.int64)

    # phase 3 on the large bins' rooms; small items by increasing length
    asc = np.arange(tiny0 - 1, small0 - 1, -1)
    rooms = engine.buffer(np.asarray(tree[len(tree) // 2:len(tree) // 2 + med0], dtype=np.int64))
    taken = engine.buffer(np.zeros(asc.size, dtype=np.int64))
    slots = engine.buffer(np.zeros(asc.size, dtype=np.int64))
    pair_bins = engine.buffer(np.zeros(asc.size, dtype=np.int64))
    left = engine.buffer(np.arange(asc.size + 1, dtype=np.int64))
    k = engine.kernel(_pairs_kernel)(rooms, engine.buffer(xs[asc]), left, taken, slots, pair_bins)
    paired = asc[np.asarray(slots[:k], dtype=np.int64)]

    # phase 4: the rest, still longest first, over a tree rebuilt from the updated rooms
    placed = np.zeros(xs.size, dtype=bool)
    placed[:med0] = True
    placed[med0:small0] = medium >= 0
    placed[paired] = True
    rest = np.flatnonzero(~placed)
    tree = engine.buffer(room_tree(np.asarray(rooms, dtype=np.int64), bound, capacity))
    last = engine.buffer(np.zeros(rest.size, dtype=np.int64))
    num_bins = first_fit(engine.buffer(xs[rest]), tree, last, med0, xs.size + 1)

    steps = np.concatenate([np.arange(med0), med0 + np.flatnonzero(medium >= 0), paired, rest])
    bins = np.concatenate([np.arange(med0), medium[medium >= 0],
                           np.asarray(pair_bins[:k], dtype=np.int64), np.asarray(last, dtype=np.int64)])
    return engine.result(order[steps], bins, num_bins)


mffd = Packer(name="mffd", impl=_mffd)
