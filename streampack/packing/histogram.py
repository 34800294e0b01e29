"""Shortest-pack-first histogram packing (``histogram``, Krell et al. 2021, "SPFHP").

Works on the length histogram: packs with the same contents are one *configuration* with a count.
Lengths go longest first into the packs with the most room (worst fit), a configuration at a time;
what does not fit opens new packs. Packs are grouped by room under a lazy max-heap; no cap on
sequences per pack. O(n + N log N) time, N configurations (<= n). The forest is a compiled kernel
because numpy alone is 25x slower at 1e4 items (``benchmarks/bench_packing_scaling.py``).
"""

from __future__ import annotations

import heapq

import numpy as np

from streampack.packing._common import decreasing_order
from streampack.packing._engine import Engine, IntBuffer, Packer
from streampack.packing.result import PackResult


def _configurations_kernel(sizes: IntBuffer, counts: IntBuffer, capacity: int, parent: IntBuffer, added: IntBuffer,
                           count: IntBuffer, nxt: IntBuffer, heads: IntBuffer) -> tuple[int, int]:
    """Build the configuration forest: configuration i is ``parent[i]`` plus one item of size index ``added[i]``, held
    by ``count[i]`` packs, ``nxt[i]`` the next of its room group (-1 ends it). Writes each room group's head
    configuration by increasing room to ``heads``; returns (configurations, groups)."""
    group = {capacity: 0}  # room -> newest configuration with packs at that room
    group.pop(capacity)  # (the literal gives numba the key and value types)
    heap = [capacity]  # negated rooms of groups that may be non-empty
    heap.pop()
    num = 0
    for s in range(len(sizes)):
        length = sizes[s]
        c = counts[s]
        while c > 0:
            while heap and group.get(-heap[0], -1) < 0:
                heapq.heappop(heap)  # stale: that group emptied since it was pushed
            room = -heap[0] if heap else capacity
            if heap and room >= length:
                link = group[room]
                moved, per = min(c, count[link]), 1
                count[link] -= moved
                if count[link] == 0:
                    group[room] = nxt[link]
            else:
                # Worst fit keeps filling a fresh pack while it is the roomiest one that
                # fits, so new packs take `per` items each: c // per such packs now, the
                # remainder in the next round. A chain of `per` nodes spells the contents.
                per = min(c, capacity // length)
                moved, room, link = c // per, capacity - (per - 1) * length, -1
                for _ in range(per - 1):
                    parent[num], added[num], count[num], nxt[num] = link, s, 0, -1
                    link = num
                    num += 1
            target = room - length
            first = group.get(target, -1)
            if first < 0 and target > 0:
                heapq.heappush(heap, -target)
            parent[num], added[num], count[num], nxt[num] = link, s, moved, first
            group[target] = num
            num += 1
            c -= moved * per
    rooms = list(group.keys())
    rooms.sort()
    for i in range(len(rooms)):
        heads[i] = group[rooms[i]]
    return num, len(rooms)


def _emit_kernel(parent: IntBuffer, added: IntBuffer, count: IntBuffer, nxt: IntBuffer, heads: IntBuffer,
                 num_heads: int, chain: IntBuffer, depth: IntBuffer, packs: IntBuffer) -> tuple[int, int]:
    """Non-empty configurations in output order (by room group, fullest first, then
    configuration): their contents, root first, into ``chain``; items per pack into
    ``depth``; packs into ``packs`` (each ``[n]``). Returns (chain length, configurations)."""
    k = p = 0
    for h in range(num_heads):
        e = heads[h]
        while e >= 0:
            if count[e]:
                node, start = e, k
                while node >= 0:
                    chain[k] = added[node]
                    k += 1
                    node = parent[node]
                i, j = start, k - 1
                while i < j:  # the walk went leaf to root
                    chain[i], chain[j] = chain[j], chain[i]
                    i += 1
                    j -= 1
                depth[p] = k - start
                packs[p] = count[e]
                p += 1
            e = nxt[e]
    return k, p


def _emit(sizes: list[int] | np.ndarray, counts: np.ndarray, capacity: int,
          engine: Engine) -> tuple[np.ndarray, np.ndarray]:
    """``(size index of every slot, items per pack)`` with packs in output order: by room
    group (fullest first), then configuration; a pack's items longest first."""
    n = int(counts.sum())
    forest = [engine.buffer(np.zeros(n, dtype=np.int64)) for _ in range(4)]
    heads = engine.buffer(np.zeros(n + 1, dtype=np.int64))
    _, num_heads = engine.kernel(_configurations_kernel)(engine.buffer(np.asarray(sizes, dtype=np.int64)),
                                                         engine.buffer(counts), capacity, *forest, heads)
    out = [engine.buffer(np.zeros(n, dtype=np.int64)) for _ in range(3)]
    size, num = engine.kernel(_emit_kernel)(*forest, heads, num_heads, *out)
    chain, d, k = (np.asarray(b[:m], dtype=np.int64) for b, m in zip(out, (size, num, num)))
    chain_start = np.concatenate(([0], np.cumsum(d)[:-1]))
    slots = np.repeat(np.arange(d.size), k * d)  # configuration of every slot
    pos = np.arange(slots.size) - np.concatenate(([0], np.cumsum(k * d)[:-1]))[slots]
    slot_size = chain[chain_start[slots] + pos % d[slots]]
    return slot_size, np.repeat(d, k)


def _histogram(lengths: np.ndarray, capacity: int, seed: int, engine: Engine) -> PackResult:
    """Shortest-pack-first histogram packing, O(n + N log N) (see the module docstring).
    Layout: packs by increasing remaining space (fullest first); items in a pack longest
    first; equal-length items handed out in index order. ``seed`` is unused."""
    by_size = decreasing_order(lengths)
    sorted_lengths = lengths[by_size]
    first = np.flatnonzero(np.diff(sorted_lengths, prepend=0))  # start of each distinct size
    counts = np.diff(first, append=lengths.size)
    slot_size, pack_sizes = _emit(sorted_lengths[first], counts, capacity, engine)
    # Items of one size go out in emission order: a stable sort of the slots by size lines
    # them up with `by_size`, which lists each size's items in index order.
    key = slot_size.astype(np.uint16) if first.size <= 1 << 16 else slot_size
    order = np.empty(lengths.size, dtype=np.int64)
    order[np.argsort(key, kind="stable")] = by_size
    offsets = np.concatenate(([0], np.cumsum(pack_sizes)))
    return PackResult(order=order, offsets=offsets)


histogram = Packer(name="histogram", impl=_histogram)
