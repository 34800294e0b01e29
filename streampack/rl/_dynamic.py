"""The two dynamic batching conventions of :func:`~streampack.rl.plan.plan_dynamic_batches`, on lengths.

``convention="balanced"`` (streampack's, :func:`deal`, :func:`group`, :func:`split_to`): longest first, so the
peak-memory micro-batch runs first (an OOM shows at micro-batch 0). Ranks are dealt one round of ``dp_size`` sorted
sequences at a time, largest to the lightest rank (token balance 1.0001 where ROLL's stride deal gives 1.018,
``benchmarks/bench_rl.py``), and each rank cuts its run into micro-batches with ``count * round_up(max_len) <= budget``.
This reproduces NeMo-RL's diagram exactly, order included.

``convention="roll"`` (:func:`roll_rows`): ROLL's ``roll.utils.dynamic_batching.dynamic_batching_shard`` as its code
(main branch, v0.2.0, commit 3077befc) does it, its unit tests reproduced in ``tests/unit/rl/test_rl_plan.py`` (its
documentation's example bounds real tokens instead):

1. sort shortest first; rank ``r`` takes ``sorted[r::dp]`` (the batch must divide by ``dp``);
2. a row's length is its longest over all ranks, rounded up to ``sequence_length_round``;
3. rows are cut greedily into micro-batches of ``b`` rows and padded length ``L`` with
   ``b * L <= budget``, one list shared by every rank;
4. with ``pp_size > 1`` the ``k`` micro-batches missing to a multiple of ``pp_size`` come from
   halving the ``k`` multi-row micro-batches with the most padded tokens (first on ties); when
   fewer than ``k`` have two rows this raises ``ValueError``.
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


def roll_rows(idx: np.ndarray, lens: np.ndarray, rounded: np.ndarray, overlong: np.ndarray,
              dp: int, budget: int, pp_size: int, where: str) -> tuple[list[list[np.ndarray]], list[int]]:
    """One chunk of sequences ``idx``: every rank's micro-batches (the same rows on every
    rank) and their shared padded lengths."""
    if idx.size % dp:
        raise ValueError(f"{where}: ROLL's dynamic batching deals sorted[r::dp_size] to rank r and needs every rank to "
                         f"hold the same number of sequences; {idx.size} sequences do not divide by dp_size={dp}")
    order = idx[np.argsort(lens[idx], kind="stable")]
    shards = [order[r::dp] for r in range(dp)]
    row_len = np.max([rounded[s] for s in shards], axis=0)
    row_over = np.any([overlong[s] for s in shards], axis=0)
    # rows are cut like one rank's sorted run, with each row's length its longest over the ranks
    groups = group(np.arange(row_len.size), row_len, row_over, budget)
    ranges = [[int(ix[0]), int(ix[-1]) + 1] for ix, _ in groups]
    lengths = [width for _, width in groups]
    _split_to_multiple(ranges, lengths, pp_size, where)
    return [[shard[s:e] for s, e in ranges] for shard in shards], lengths


def _split_to_multiple(ranges: list[list[int]], lengths: list[int], pp_size: int, where: str) -> None:
    """ROLL's VPP padding (module docstring, rule 4), in place: the ``missing`` multi-row
    ranges with the most padded tokens are each split once at their middle."""
    missing = -len(ranges) % pp_size
    if not missing:
        return
    multi = [i for i, (s, e) in enumerate(ranges) if e - s > 1]
    if len(multi) < missing:
        raise ValueError(f"{where}: ROLL's pipeline split makes {len(ranges)} micro-batches a multiple of "
                         f"{pp_size=} by splitting {missing} of them once each, but only {len(multi)} hold more "
                         f"than one row: no {len(ranges) + missing} non-empty micro-batches that way (ROLL asserts "
                         f"here); give each rank more sequences, a smaller pp_size, or convention='balanced'")
    # sorted() is stable: equal token counts keep their order, as in ROLL's list.sort(reverse=True)
    chosen = set(sorted(multi, key=lambda i: (ranges[i][1] - ranges[i][0]) * lengths[i], reverse=True)[:missing])
    for i in sorted(chosen, reverse=True):  # from the back, so earlier positions stay valid
        start, end = ranges[i]
        mid = start + (end - start) // 2
        ranges[i:i + 1] = [[start, mid], [mid, end]]
        lengths[i:i + 1] = [lengths[i], lengths[i]]
