"""ROLL's dynamic batching (``roll.utils.dynamic_batching.dynamic_batching_shard``), on lengths.

What ROLL's code does (read from alibaba/ROLL; its own unit tests are reproduced in
``tests/test_rl_plan.py``), as opposed to the worked example in its documentation, which bounds
real tokens and lets padded micro-batches exceed the budget:

1. sort the batch by length, shortest first (stable); rank ``r`` takes ``sorted[r::dp]``, so
   "row" ``j`` holds the ``j``-th sequence of every rank (the batch must divide by ``dp``);
2. every row's length is the longest sequence of the row over all ranks, rounded up to
   ``sequence_length_round``;
3. rows are cut greedily into micro-batches with a hard cap: a micro-batch of ``b`` rows and
   padded length ``L`` (its longest row) satisfies ``b * L <= budget``; one list of boundaries
   and lengths is shared by every rank;
4. with pipeline parallelism the largest micro-batch (most rows; the first on ties) is split
   at its middle, keeping its length, until the count is a multiple of ``pp_size``.
"""

from __future__ import annotations

import numpy as np


def roll_rows(idx: np.ndarray, lens: np.ndarray, rounded: np.ndarray, overlong: np.ndarray,
              dp: int, budget: int, pp_size: int, where: str) -> tuple[list[list[np.ndarray]], list[int]]:
    """One chunk of sequences ``idx``: every rank's micro-batches (the same rows on every
    rank) and their shared padded lengths."""
    if idx.size % dp:
        raise ValueError(f"{where}: ROLL's dynamic batching deals sorted[r::dp_size] to rank r and "
                         f"needs every rank to hold the same number of sequences; {idx.size} "
                         f"sequences do not divide by dp_size={dp}")
    order = idx[np.argsort(lens[idx], kind="stable")]
    shards = [order[r::dp] for r in range(dp)]
    row_len = np.max([rounded[s] for s in shards], axis=0)
    row_over = np.any([overlong[s] for s in shards], axis=0)
    ranges: list[list[int]] = []
    lengths: list[int] = []
    for j in range(row_len.size):
        if ranges and not row_over[j] and not row_over[ranges[-1][0]]:
            width = max(lengths[-1], int(row_len[j]))
            if (j + 1 - ranges[-1][0]) * width <= budget:
                ranges[-1][1] = j + 1
                lengths[-1] = width
                continue
        ranges.append([j, j + 1])
        lengths.append(int(row_len[j]))
    _split_to_multiple(ranges, lengths, pp_size, where)
    return [[shard[s:e] for s, e in ranges] for shard in shards], lengths


def _split_to_multiple(ranges: list[list[int]], lengths: list[int], pp_size: int, where: str) -> None:
    """ROLL's ``_split_ranges_to_vpp_multiple``: halve the range with the most rows (the first
    on ties), keeping its padded length, until the count is a multiple of ``pp_size``."""
    while len(ranges) % pp_size:
        multi = [i for i, (s, e) in enumerate(ranges) if e - s > 1]
        if not multi:
            raise ValueError(f"{where}: {len(ranges)} micro-batches of single rows cannot fill a "
                             f"multiple of {pp_size=} non-empty micro-batches (every rank needs the "
                             f"same count); give each rank more sequences or a smaller pp_size")
        i = max(multi, key=lambda i: (ranges[i][1] - ranges[i][0], -i))
        start, end = ranges[i]
        mid = start + (end - start) // 2
        ranges[i:i + 1] = [[start, mid], [mid, end]]
        lengths[i:i + 1] = [lengths[i], lengths[i]]
