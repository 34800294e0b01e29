"""streampack's own dynamic batching convention (``convention="balanced"``), on lengths.

Longest first, so the peak-memory micro-batch runs first (an OOM shows at micro-batch 0). Ranks are dealt one round of
``dp_size`` sorted sequences at a time, largest to the lightest rank (token balance 1.0001 where ROLL's stride deal
gives 1.018, ``benchmarks/bench_rl.py``), and each rank cuts its run into micro-batches with
``count * round_up(max_len) <= budget``. This reproduces NeMo-RL's diagram exactly, order included.
"""

from __future__ import annotations

import numpy as np


def deal(idx: np.ndarray, lens: np.ndarray, load: np.ndarray) -> list[np.ndarray]:
    """Sorted sequences of one chunk -> one sorted run per rank, token-balanced."""
    dp = load.size
    order = idx[np.argsort(-lens[idx], kind="stable")]
    shards: list[list[int]] = [[] for _ in range(dp)]
    # One round of dp sequences at a time, largest to the lightest rank: counts stay within
    # one of each other (similar micro-batch counts) and tokens balance better than a stride.
    for s in range(0, order.size, dp):
        batch = order[s:s + dp]
        for i, r in zip(batch, np.argsort(load, kind="stable")[:batch.size]):
            shards[r].append(int(i))
            load[r] += lens[i]
    return [np.asarray(s, dtype=np.int64) for s in shards]


def group(shard: np.ndarray, rounded: np.ndarray, overlong: np.ndarray, budget: int) -> list[tuple[np.ndarray, int]]:
    """Greedy maximal runs of a sorted shard (optimal in count, since any sub-run of a run
    that fits also fits); each run with its padded length."""
    groups: list[tuple[np.ndarray, int]] = []
    cur: list[int] = []
    width = 0
    for i in shard.tolist():
        if cur and not overlong[i] and not overlong[cur[0]]:
            new_width = max(width, int(rounded[i]))
            if (len(cur) + 1) * new_width <= budget:
                cur.append(i)
                width = new_width
                continue
        if cur:
            groups.append((np.asarray(cur, dtype=np.int64), width))
        cur, width = [i], int(rounded[i])
    if cur:
        groups.append((np.asarray(cur, dtype=np.int64), width))
    return groups


def split_to(groups: list[tuple[np.ndarray, int]], target: int, rounded: np.ndarray, *, where: str) -> None:
    """Split the largest multi-sequence micro-batch in two until there are ``target``."""
    while len(groups) < target:
        multi = [j for j, (ix, _) in enumerate(groups) if ix.size > 1]
        if not multi:
            have = sum(ix.size for ix, _ in groups)
            raise ValueError(f"{where}: {have} sequences cannot fill {target} non-empty "
                             f"micro-batches (every rank needs the same count); give each rank "
                             f"more sequences, a larger chunk_size or a smaller pp_size")
        j = max(multi, key=lambda j: (groups[j][0].size * groups[j][1], groups[j][0].size, -j))
        ix, _ = groups[j]
        halves = (ix[:ix.size // 2], ix[ix.size // 2:])
        groups[j:j + 1] = [(h, int(rounded[h].max())) for h in halves]
