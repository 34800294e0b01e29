"""Random and greedy PackedBatch layouts shared by the attention, loss and CP tests."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from streampack import PackedBatch, pack_batch


def random_batch(seed: int, *, capacity: int = 32, align: int = 4, num_packs: int = 3,
                 p_more: float = 0.75, vocab: int = 100) -> PackedBatch:
    """Random documents packed greedily; some packs end with trailing padding, some are full."""
    rng = random.Random(seed)
    packs = []
    for _ in range(num_packs):
        room, pack = capacity, []
        while room and (not pack or rng.random() < p_more):
            n = rng.randint(1, room)
            pack.append([rng.randrange(1, vocab) for _ in range(n)])
            room -= -(-n // align) * align
        packs.append(pack)
    return pack_batch(packs, capacity=capacity, align=align)


def greedy_pack(docs: Sequence[Any], capacity: int, align: int) -> PackedBatch:
    """Documents (mappings with ``input_ids``) in order, a new pack whenever one is full."""
    packs, room = [[]], capacity
    for d in docs:
        span = -(-len(d["input_ids"]) // align) * align
        if span > room:
            packs.append([])
            room = capacity
        packs[-1].append(d)
        room -= span
    return pack_batch(packs, capacity=capacity, align=align)
