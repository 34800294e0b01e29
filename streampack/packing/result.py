"""``PackResult``: a packing as two flat arrays instead of one array per bin.

A million small arrays cost more than the packing itself (splitting 1e6 items into 143k bins
took 103 ms of bfd's 233 ms in the old tree), so the algorithms produce this record and
``pack`` splits it only when asked.

Worked example: bins ``[[0, 1], [2, 3, 4]]`` are ``order = [0, 1, 2, 3, 4]``,
``offsets = [0, 2, 5]``; bin ``b`` is ``order[offsets[b]:offsets[b + 1]]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True, kw_only=True)
class PackResult:
    """One packing of ``n`` items into ``num_bins`` bins."""

    order: np.ndarray
    """int64 ``[n]``: item indices, bin after bin, each bin's items in layout order."""
    offsets: np.ndarray
    """int64 ``[num_bins + 1]``: bin ``b`` is ``order[offsets[b]:offsets[b + 1]]``; starts at
    0, strictly increasing (no empty bin), ends at n."""

    @property
    def num_bins(self) -> int:
        return int(self.offsets.size - 1)

    def bins(self) -> list[np.ndarray]:
        """One int64 index array per bin (views into ``order``), as ``pack`` returns them."""
        if self.num_bins == 0:
            return []
        return np.split(self.order, self.offsets[1:-1])

    def sizes(self) -> np.ndarray:
        """int64 ``[num_bins]``: items per bin."""
        return np.diff(self.offsets)

    def bin_sums(self, values: np.ndarray) -> np.ndarray:
        """``[num_bins]``: per-bin sums of ``values[i]`` over the bin's items (e.g. loads from
        lengths, or attention cost from squared lengths)."""
        if self.num_bins == 0:
            return np.zeros(0, dtype=np.asarray(values).dtype)
        return np.add.reduceat(np.asarray(values)[self.order], self.offsets[:-1])

    def loads(self, lengths: np.ndarray) -> np.ndarray:
        """int64 ``[num_bins]``: tokens per bin."""
        return self.bin_sums(np.asarray(lengths, dtype=np.int64))

    def bin_ids(self) -> np.ndarray:
        """int64 ``[n]``: the bin of each position of ``order``."""
        return np.repeat(np.arange(self.num_bins, dtype=np.int64), self.sizes())

    @staticmethod
    def from_bins(bins: list[np.ndarray]) -> PackResult:
        """The flat form of a list of index arrays (e.g. a packing built by hand)."""
        sizes = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
        order = np.concatenate(bins).astype(np.int64) if bins else np.zeros(0, dtype=np.int64)
        return PackResult(order=order, offsets=np.concatenate(([0], np.cumsum(sizes))))
