"""Packing quality as a named record, for one batch or accumulated over a stream."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True, kw_only=True)
class PackingMetrics:
    """Quality of a set of packs of one capacity."""

    num_bins: int
    """Packs produced."""
    num_documents: int
    """Items (documents) packed."""
    num_tokens: int
    """Real tokens packed (sum of item lengths)."""
    capacity: int
    """Tokens per pack."""
    fill: float
    """num_tokens / (num_bins · capacity); 0 when there are no bins."""
    waste: float
    """1 − fill: share of pack slots that are padding (0 when there are no bins)."""
    balance_cv: float
    """Coefficient of variation (population std / mean) of the per-pack token loads."""
    efficiency: float
    """Lower bound ceil(num_tokens / capacity) / num_bins: 1.0 is optimal."""
    docs_per_bin: float
    """Mean documents per pack."""


class MetricsAccumulator:
    """Accumulates ``PackingMetrics`` over a stream in O(1) memory (sums, sums of squares)."""

    def __init__(self) -> None:
        self._capacity: int | None = None
        self._bins = 0
        self._docs = 0
        self._tokens = 0
        self._tokens_sq = 0

    def update(self, bin_loads: np.ndarray, docs_per_bin: np.ndarray | int, capacity: int) -> None:
        """Add packs with token loads ``bin_loads`` (int ``[m]``), documents per pack
        ``docs_per_bin`` (int ``[m]``, or the total as an int), all of ``capacity``."""
        if self._capacity is not None and capacity != self._capacity:
            raise ValueError(f"{capacity=} differs from the capacity {self._capacity} seen before")
        loads = np.asarray(bin_loads, dtype=np.int64)
        if loads.ndim != 1:
            raise ValueError(f"bin_loads must be 1-D, got shape {loads.shape}")
        if loads.size and (loads.min() < 0 or loads.max() > capacity):
            raise ValueError(f"bin_loads must lie in [0, {capacity=}], got {loads.min()}..{loads.max()}")
        self._capacity = int(capacity)
        self._bins += int(loads.size)
        self._docs += int(np.sum(docs_per_bin))
        self._tokens += int(loads.sum())
        self._tokens_sq += int(np.dot(loads, loads))  # exact: loads <= capacity

    def update_bins(self, lengths: np.ndarray, bins: list[np.ndarray], capacity: int) -> None:
        """Add the packs ``bins`` (index arrays into ``lengths``) as returned by ``pack``."""
        lengths = np.asarray(lengths, dtype=np.int64)
        loads = np.array([lengths[b].sum() for b in bins], dtype=np.int64)
        self.update(loads, np.array([len(b) for b in bins], dtype=np.int64), capacity)

    def result(self) -> PackingMetrics:
        capacity, bins, tokens, docs = self._capacity or 0, self._bins, self._tokens, self._docs
        if bins == 0:
            return PackingMetrics(num_bins=0, num_documents=docs, num_tokens=tokens, capacity=capacity, fill=0.0,
                                  waste=0.0, balance_cv=0.0, efficiency=0.0, docs_per_bin=0.0)
        fill, mean = tokens / (bins * capacity), tokens / bins
        var = max(self._tokens_sq / bins - mean * mean, 0.0)
        return PackingMetrics(num_bins=bins, num_documents=docs, num_tokens=tokens, capacity=capacity, fill=fill,
                              waste=1.0 - fill, balance_cv=math.sqrt(var) / mean if mean > 0 else 0.0,
                              efficiency=-(-tokens // capacity) / bins, docs_per_bin=docs / bins)


def packing_metrics(lengths: np.ndarray, bins: list[np.ndarray], capacity: int) -> PackingMetrics:
    """Metrics of one packing: ``bins`` as returned by ``pack(lengths, capacity)``."""
    acc = MetricsAccumulator()
    acc.update_bins(lengths, bins, capacity)
    return acc.result()
