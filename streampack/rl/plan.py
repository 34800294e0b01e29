"""Micro-batch plans for an in-memory RL rollout batch, computed from sequence lengths only (reference: ``docs/rl.md``).

Two planners, one record (:class:`MicroBatchPlan`: rank -> micro-batch -> sequence indices): :func:`plan_dynamic_batches`
(padded ``[b, L]`` micro-batches, conventions in :mod:`streampack.rl._dynamic`) and
:func:`plan_packed_microbatches` (one THD pack per micro-batch, Karmarkar-Karp to ranks, then to micro-batches). Both
give every rank the same number of micro-batches, none empty, a multiple of ``pp_size``, or raise ``ValueError`` instead
of planning a hang. On 1024 lognormal lengths, dp 8, budget 16384 (``benchmarks/bench_rl.py``) padding is 82% for the
naive batch max, 6.2% dynamic, 2.1% packed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from streampack.packing import karmarkar_karp, pack
from streampack.packing.cost import CostModel
from streampack.rl import _dynamic


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class MicroBatchPlan:
    """Which sequences each DP rank runs together, in which order."""

    kind: str
    """``"dynamic"`` (padded ``[b, L]`` micro-batches) or ``"packed"`` (one THD pack each)."""
    seq_lens: np.ndarray
    """int64 ``[n]``: real length of every sequence, in the original order."""
    microbatches: tuple[tuple[np.ndarray, ...], ...]
    """rank -> micro-batch -> int64 array of original sequence indices (in run order)."""
    padded_lengths: tuple[tuple[int, ...], ...]
    """rank -> micro-batch -> padded sequence length ``L`` (dynamic) or packed length (packed:
    sum of the sequences' lengths rounded up to ``align``)."""
    inverse: np.ndarray
    """int64 ``[n]``: ``concat(per-sequence outputs in plan order)[inverse]`` is original order."""
    max_tokens_per_microbatch: int
    align: int
    """``sequence_length_round`` (dynamic) or per-sequence ``align`` (packed)."""

    @property
    def dp_size(self) -> int:
        return len(self.microbatches)

    @property
    def num_sequences(self) -> int:
        return int(self.seq_lens.size)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per rank (the same on every rank)."""
        return len(self.microbatches[0])

    @property
    def order(self) -> np.ndarray:
        """int64 ``[n]``: original index of each sequence in plan order (rank, micro-batch, row)."""
        return np.concatenate([ix for rank in self.microbatches for ix in rank])

    @property
    def padded_sizes(self) -> tuple[tuple[int, ...], ...]:
        """rank -> micro-batch -> tokens the micro-batch occupies (``b * L`` or packed length)."""
        if self.kind == "packed":
            return self.padded_lengths
        return tuple(tuple(int(ix.size) * length for ix, length in zip(mbs, lens))
                     for mbs, lens in zip(self.microbatches, self.padded_lengths))

    @property
    def tokens_per_rank(self) -> np.ndarray:
        """int64 ``[dp_size]``: real tokens on each rank."""
        return np.array([sum(int(self.seq_lens[ix].sum()) for ix in rank)
                         for rank in self.microbatches], dtype=np.int64)

    @property
    def padded_tokens_per_rank(self) -> np.ndarray:
        return np.array([sum(sizes) for sizes in self.padded_sizes], dtype=np.int64)

    @property
    def padded_tokens(self) -> int:
        """Tokens computed over all ranks, padding included."""
        return int(self.padded_tokens_per_rank.sum())

    @property
    def balance(self) -> float:
        """max / mean real tokens per rank (1.0 = perfectly balanced)."""
        tokens = self.tokens_per_rank
        return float(tokens.max() / tokens.mean()) if tokens.sum() else 1.0

    def cost_per_rank(self, cost_model: CostModel) -> np.ndarray:
        """float64 ``[dp_size]``: estimated compute of each rank's sequences (each packed on its
        own span: ``linear · aligned length + attention · L²``)."""
        weights = sequence_costs(self.seq_lens, cost_model, self.align)
        return np.array([sum(float(weights[ix].sum()) for ix in rank) for rank in self.microbatches])

    def cost_balance(self, cost_model: CostModel) -> float:
        """max / mean estimated compute per rank (1.0 = every rank's step takes as long)."""
        costs = self.cost_per_rank(cost_model)
        return float(costs.max() / costs.mean()) if costs.sum() else 1.0

    def stats(self) -> dict[str, Any]:
        """The summary as one flat dict (for logging)."""
        real = int(self.seq_lens.sum())
        return {"kind": self.kind, "num_sequences": self.num_sequences, "num_microbatches": self.num_microbatches,
                "real_tokens": real, "padded_tokens": self.padded_tokens,
                "padding_fraction": 1 - real / self.padded_tokens if self.padded_tokens else 0.0,
                "balance": self.balance}


def sequence_costs(lens: np.ndarray, cost_model: CostModel, align: int = 1) -> np.ndarray:
    """float64 ``[n]``: each sequence's estimated compute in a pack (its aligned span runs through
    the linear layers, its real tokens attend causally)."""
    lens = np.asarray(lens, dtype=np.float64)
    return cost_model.linear * _round_up(lens, align) + cost_model.attention * lens * lens


def _cost_weights(aligned: np.ndarray, lens: np.ndarray, cost_model: CostModel | None) -> np.ndarray:
    """Integer weights to balance: tokens, or the estimated cost in token-equivalents of the
    linear coefficient (``aligned + attention / linear · L²``; ``L²`` when linear is 0)."""
    if cost_model is None:
        return aligned
    scale = cost_model.linear if cost_model.linear > 0 else (cost_model.attention or 1.0)
    return np.rint(sequence_costs(lens, cost_model) / scale - lens + aligned).astype(np.int64)


def _balanced_parts(values: np.ndarray, k: int) -> list[np.ndarray]:
    """``k`` non-empty parts (``k <= len(values)``) with balanced sums of ``values``."""
    assert 1 <= k <= values.size, (k, values.size)
    parts = [np.asarray(p, dtype=np.int64) for p in karmarkar_karp(values, k)]
    # positive values and k <= n: largest differencing never leaves a part empty
    assert len(parts) == k and all(p.size for p in parts), "partition left a part empty"
    return parts


def _check_args(seq_lens: Any, **positive: int) -> np.ndarray:
    for name, value in positive.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    lens = np.asarray(seq_lens)
    if lens.ndim != 1 or lens.size == 0 or not np.issubdtype(lens.dtype, np.integer):
        raise ValueError(f"seq_lens must be a non-empty 1-D integer array, got {lens.dtype} of shape {lens.shape}")
    if (lens < 1).any():
        i = int(np.argmax(lens < 1))
        raise ValueError(f"sequence {i} has length {int(lens[i])}; every length must be >= 1")
    return lens.astype(np.int64)


def _round_up(x: Any, multiple: int) -> Any:
    return -(-x // multiple) * multiple


def _refuse_overlong(lens: np.ndarray, padded: np.ndarray, budget: int, what: str) -> None:
    bad = np.flatnonzero(padded > budget)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"sequence {i} of length {int(lens[i])} needs {int(padded[i])} tokens "
                         f"after {what}, more than max_tokens_per_microbatch={budget} ({bad.size} such sequences)")


def _finish(kind: str, lens: np.ndarray, mbs: list[list[np.ndarray]],
            padded: list[list[int]], budget: int, align: int) -> MicroBatchPlan:
    order = np.concatenate([ix for rank in mbs for ix in rank])
    assert np.array_equal(np.sort(order), np.arange(lens.size)), "a sequence is lost or repeated"
    assert len({len(rank) for rank in mbs}) == 1, "ranks have different micro-batch counts"
    assert all(ix.size for rank in mbs for ix in rank), "empty micro-batch"
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    return MicroBatchPlan(kind=kind, seq_lens=lens, inverse=inverse, max_tokens_per_microbatch=budget, align=align,
                          microbatches=tuple(tuple(ix.astype(np.int64) for ix in rank) for rank in mbs),
                          padded_lengths=tuple(tuple(int(v) for v in rank) for rank in padded))


CONVENTIONS = ("balanced", "roll")


def plan_dynamic_batches(seq_lens: Any, *, dp_size: int, max_tokens_per_microbatch: int, sequence_length_round: int,
                         pp_size: int = 1, chunk_size: int | None = None, convention: str = "balanced",
                         allow_overlong: bool = False) -> MicroBatchPlan:
    """Plan padded micro-batches of similar-length sequences for ``dp_size`` ranks.

    Args:
        seq_lens: int ``[n]`` real length of each sequence (e.g. ``attention_mask.sum(-1)``).
        dp_size: data-parallel ranks.
        max_tokens_per_microbatch: budget, a hard cap on ``count * L`` where ``L`` = the
            micro-batch's longest length rounded up to ``sequence_length_round``.
        sequence_length_round: every micro-batch's ``L`` is a multiple of it (TP*CP, 64, 128).
        pp_size: micro-batches per rank (per chunk) are made a multiple of it by splitting
            multi-sequence micro-batches: ``"balanced"`` the largest, again until it is a
            multiple; ``"roll"`` ROLL's rule with VPP (each of the ones with the most padded
            tokens once; :mod:`streampack.rl._dynamic`).
        chunk_size: sort inside consecutive chunks of this many sequences only, so the
            training order of chunks is kept; micro-batches never cross a chunk.
        convention: ``"balanced"`` (streampack) or ``"roll"`` (ROLL's code; needs every chunk
            to divide by ``dp_size``); module docstring.
        allow_overlong: a sequence whose rounded length exceeds the budget gets a micro-batch
            of its own (over budget) instead of a ``ValueError``.
    """
    lens = _check_args(seq_lens, dp_size=dp_size, max_tokens_per_microbatch=max_tokens_per_microbatch,
                       sequence_length_round=sequence_length_round, pp_size=pp_size)
    if chunk_size is not None:
        _check_args([1], chunk_size=chunk_size)
    if convention not in CONVENTIONS:
        raise ValueError(f"{convention=} must be one of {CONVENTIONS}")
    budget = int(max_tokens_per_microbatch)
    rounded = _round_up(lens, sequence_length_round)
    overlong = rounded > budget
    if not allow_overlong:
        _refuse_overlong(lens, rounded, budget, f"rounding to {sequence_length_round=}")
    chunk = int(chunk_size or lens.size)
    mbs: list[list[np.ndarray]] = [[] for _ in range(dp_size)]
    padded: list[list[int]] = [[] for _ in range(dp_size)]
    load = np.zeros(dp_size, dtype=np.int64)
    for start in range(0, lens.size, chunk):
        idx = np.arange(start, min(start + chunk, lens.size))
        if idx.size < dp_size:  # every rank needs a micro-batch from every chunk
            raise ValueError(f"the chunk of sequences {idx[0]}..{idx[-1]} has {idx.size} sequences, "
                             f"fewer than {dp_size=}: they cannot fill {dp_size} non-empty "
                             f"micro-batches (use a chunk_size that leaves >= dp_size per chunk)")
        where = f"sequences {idx[0]}..{idx[-1]} ({dp_size=}, {pp_size=})"
        if convention == "roll":
            rank_mbs, shared = _dynamic.roll_rows(idx, lens, rounded, overlong, dp_size, budget, pp_size, where)
            groups = [list(zip(r, shared)) for r in rank_mbs]
        else:
            groups = [_dynamic.group(s, rounded, overlong, budget)
                      for s in _dynamic.deal(idx, lens, load)]
            target = _round_up(max(len(g) for g in groups), pp_size)
            for r, g in enumerate(groups):
                _dynamic.split_to(g, target, rounded, where=f"rank {r}, {where}")
        for r, g in enumerate(groups):
            mbs[r] += [ix for ix, _ in g]
            padded[r] += [length for _, length in g]
    return _finish("dynamic", lens, mbs, padded, budget, sequence_length_round)


def plan_packed_microbatches(seq_lens: Any, *, dp_size: int, max_tokens_per_microbatch: int,
                             min_num_microbatches: int = 1, algorithm: str = "kk",
                             align: int = 1, cost_model: CostModel | None = None) -> MicroBatchPlan:
    """Plan one THD pack per micro-batch, balanced across ranks and across micro-batches.

    Each sequence occupies ``round_up(len, align)`` tokens. Ranks get balanced token sums (Karmarkar-Karp); each rank's
    sequences are split into ``M`` micro-batches, the same ``M`` on every rank, every packed length ``<=
    max_tokens_per_microbatch`` (hard cap). ``algorithm="kk"``: ``M = max(min_num_microbatches, ceil(rank tokens /
    budget))``, raised until every part fits (ROLL §2.4). ``"ffd"``/``"bfd"`` (or another packing-registry name): bins
    of the budget per rank, then the largest bins split until counts match.

    ``cost_model``: balance estimated compute (``linear · tokens + attention · Σ L²``,
    :class:`streampack.packing.CostModel`) instead of tokens — across ranks always, and across
    each rank's micro-batches with ``"kk"`` (the token budget stays a hard cap). Long
    sequences cost more than their share of tokens, so token-balanced ranks wait for the one
    that drew them (``plan.cost_balance(cost_model)``; measured in ``benchmarks/bench_rl.py``).
    """
    lens = _check_args(seq_lens, dp_size=dp_size, max_tokens_per_microbatch=max_tokens_per_microbatch,
                       min_num_microbatches=min_num_microbatches, align=align)
    budget = int(max_tokens_per_microbatch)
    aligned = _round_up(lens, align)
    _refuse_overlong(lens, aligned, budget, f"rounding to {align=}")
    if lens.size < dp_size * min_num_microbatches:
        raise ValueError(f"{lens.size} sequences cannot fill {dp_size=} ranks x "
                         f"{min_num_microbatches=} non-empty micro-batches")
    weights = _cost_weights(aligned, lens, cost_model)
    tries = [(weights, weights), (aligned, weights), (aligned, aligned)] if cost_model else [(aligned, aligned)]
    for i, (by_rank, by_microbatch) in enumerate(tries):
        # Cost-balanced ranks may hold too few sequences for the common micro-batch count
        # (a rank of one long sequence): then balance tokens across ranks, then nothing by cost,
        # so a cost model never makes a batch unplannable that plans by tokens.
        try:
            ranks = _balanced_parts(by_rank, dp_size)
            if algorithm == "kk":
                parts = _kk_microbatches(ranks, aligned, by_microbatch, budget, min_num_microbatches)
            else:
                parts = _binned_microbatches(ranks, aligned, budget, min_num_microbatches, algorithm)
            break
        except ValueError:
            if i == len(tries) - 1:
                raise
    mbs, padded = [], []
    for rank_parts in parts:  # largest micro-batch first (peak memory at step 0)
        rank_parts = sorted(rank_parts, key=lambda ix: (-int(aligned[ix].sum()), int(ix[0])))
        mbs.append(rank_parts)
        padded.append([int(aligned[ix].sum()) for ix in rank_parts])
    return _finish("packed", lens, mbs, padded, budget, align)


def _kk_microbatches(ranks: list[np.ndarray], aligned: np.ndarray, weights: np.ndarray, budget: int,
                     min_mb: int) -> list[list[np.ndarray]]:
    count = max(min_mb, max(math.ceil(int(aligned[r].sum()) / budget) for r in ranks))
    smallest = min(r.size for r in ranks)
    while count <= smallest:
        parts = [[r[p] for p in _balanced_parts(weights[r], count)] for r in ranks]
        if all(int(aligned[ix].sum()) <= budget for rank in parts for ix in rank):
            return [[np.sort(ix) for ix in rank] for rank in parts]
        count += 1  # a part overflowed: one more micro-batch on every rank
    raise ValueError(f"a rank with {smallest} sequences cannot be given {count} non-empty "
                     f"micro-batches within max_tokens_per_microbatch={budget}")


def _binned_microbatches(ranks: list[np.ndarray], aligned: np.ndarray, budget: int, min_mb: int,
                         algorithm: str) -> list[list[np.ndarray]]:
    bins = [[r[b] for b in pack(aligned[r], budget, algorithm=algorithm)] for r in ranks]
    count = max(min_mb, max(len(b) for b in bins))
    for r, rank_bins in enumerate(bins):
        while len(rank_bins) < count:  # split the fullest multi-sequence bin in two
            multi = [j for j, ix in enumerate(rank_bins) if ix.size > 1]
            if not multi:
                raise ValueError(f"rank {r} has {ranks[r].size} sequences and cannot be given "
                                 f"{count} non-empty micro-batches like the other ranks")
            j = max(multi, key=lambda j: (int(aligned[rank_bins[j]].sum()), -j))
            ix = rank_bins[j]
            rank_bins[j:j + 1] = [ix[p] for p in _balanced_parts(aligned[ix], 2)]
    return [[np.sort(ix) for ix in rank_bins] for rank_bins in bins]
