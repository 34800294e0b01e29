"""ROLL's dynamic batching (``roll.utils.dynamic_batching.dynamic_batching_shard``), on lengths.

As ROLL's code (main branch, v0.2.0, commit 3077befc) does it, its unit tests reproduced in
``tests/unit/rl/test_rl_plan.py`` (its documentation's example bounds real tokens instead):

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

from streampack.rl._dynamic import group


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
