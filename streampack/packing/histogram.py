"""Shortest-pack-first histogram packing (``histogram``, Krell et al. 2021, "SPFHP").

Works on the length histogram instead of on items: all packs with the same contents are one
*configuration* with a count. Lengths are taken longest first; each length goes into the
packs with the most remaining space (the shortest packs — worst fit), a whole configuration
at a time, and whatever does not fit opens new packs of one configuration. Packs are grouped
by remaining space r (0..C) with a lazy max-heap over the non-empty groups.

Cost O(n + N log N) time and O(n + N) memory after the sort by length (a radix sort for
C < 2^16), N = configurations created (each move of some packs from one group to another
makes one; N ≪ n on real data). Groups live in a hash map, so a huge capacity costs
nothing. Items are handed out only at the end, longest first inside a pack. Unlike
Krell et al. there is no cap on sequences per pack.
"""

from __future__ import annotations

import heapq

import numba
import numpy as np

from streampack.packing._common import decreasing_order, grow, to_bins, validate


@numba.njit(cache=True)
def _spfhp_kernel(sizes: np.ndarray, counts: np.ndarray, capacity: int):
    """``sizes``: distinct lengths, decreasing; ``counts``: items of each.

    Returns the configuration forest (parent, size index, pack count) and the rooms, in
    increasing order, of the groups of finished packs with their first configuration.
    """
    # configuration nodes: parent configuration, index of the added size, pack count,
    # next configuration in the same group
    parent = np.full(64, -1, dtype=np.int64)
    added = np.zeros(64, dtype=np.int64)
    count = np.zeros(64, dtype=np.int64)
    nxt = np.full(64, -1, dtype=np.int64)
    used = 0
    group = numba.typed.Dict.empty(key_type=numba.types.int64, value_type=numba.types.int64)
    heap = [-capacity]  # negated rooms of groups that may be non-empty (typed for numba)
    heapq.heappop(heap)
    for s in range(sizes.size):
        length = sizes[s]
        c = counts[s]
        while c > 0:
            while len(heap) > 0 and group.get(-heap[0], -1) < 0:
                heapq.heappop(heap)  # stale: that group emptied since it was pushed
            room = capacity if len(heap) == 0 else -heap[0]
            fits = len(heap) > 0 and room >= length
            per = 1 if fits else min(c, capacity // length)
            while used + per > parent.size:
                parent, added = grow(parent, -1), grow(added, 0)
                count, nxt = grow(count, 0), grow(nxt, -1)
            if fits:
                src = group[room]
                moved = min(c, count[src])
                count[src] -= moved
                if count[src] == 0:
                    group[room] = nxt[src]
                parent[used] = src
            else:
                # Worst fit keeps filling a fresh pack while it is the roomiest one that
                # fits, so new packs take `per` items each: c // per such packs now, the
                # remainder in the next round. A chain of `per` nodes spells the contents.
                room = capacity
                moved = c // per
                parent[used] = -1
                for _ in range(per - 1):
                    added[used] = s
                    parent[used + 1] = used
                    used += 1
                    room -= length
            target = room - length
            first = group.get(target, -1)
            if first < 0 and target > 0:
                heapq.heappush(heap, -target)
            added[used] = s
            count[used] = moved
            nxt[used] = first
            group[target] = used
            used += 1
            c -= moved * per
    rooms = np.empty(len(group), dtype=np.int64)
    i = 0
    for r in group.keys():
        rooms[i] = r
        i += 1
    rooms.sort()
    heads = np.empty(rooms.size, dtype=np.int64)
    for i in range(rooms.size):
        heads[i] = group[rooms[i]]
    return parent, added, count, nxt, rooms, heads


@numba.njit(cache=True)
def _emit(parent, added, count, nxt, heads, by_size, start):
    """Hand out items: packs fullest first, items longest first inside a pack."""
    n = by_size.size
    log_items = np.empty(n, dtype=np.int64)
    log_bins = np.empty(n, dtype=np.int64)
    chain = np.empty(n, dtype=np.int64)
    cursor = start.copy()
    k = 0
    b = 0
    for e0 in heads:
        e = e0
        while e >= 0:
            depth = 0
            node = e
            while node >= 0:
                chain[depth] = added[node]
                depth += 1
                node = parent[node]
            for _ in range(count[e]):
                for d in range(depth - 1, -1, -1):
                    log_items[k] = by_size[cursor[chain[d]]]
                    cursor[chain[d]] += 1
                    log_bins[k] = b
                    k += 1
                b += 1
            e = nxt[e]
    return log_items, log_bins, b


def histogram(lengths: np.ndarray, capacity: int, *, seed: int = 0) -> list[np.ndarray]:
    """Shortest-pack-first histogram packing, O(n + N log N) (see the module docstring).

    Layout: bins by increasing remaining space (fullest first); items in a bin in placement
    order (longest first); equal-length items handed out in index order. ``seed`` is unused.
    """
    lengths, capacity = validate(lengths, capacity)
    if lengths.size == 0:
        return []
    by_size = decreasing_order(lengths, capacity)
    sorted_lengths = lengths[by_size]
    first = np.flatnonzero(np.diff(sorted_lengths, prepend=0))  # start of each distinct size
    sizes = sorted_lengths[first]
    counts = np.diff(first, append=lengths.size)
    parent, added, count, nxt, _, heads = _spfhp_kernel(sizes, counts, capacity)
    return to_bins(*_emit(parent, added, count, nxt, heads, by_size, first))
