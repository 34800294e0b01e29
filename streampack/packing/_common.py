"""Shared pieces of the packing algorithms: input validation, item orders, bin layout.

Every algorithm produces a *placement log* (``items[j]`` went into bin ``bins[j]``); ``from_log``
turns it into a ``PackResult``, bins in creation order and items in placement order. No numba here.
"""

from __future__ import annotations

import numbers

import numpy as np

from streampack.packing.result import PackResult

# Stable argsort of a uint16 key is a radix sort in numpy (O(n)); uint32 and int64 keys fall
# back to timsort. Measured here for 1e6 keys: 18 ms vs 106-112 ms.
_RADIX_MAX = int(np.iinfo(np.uint16).max)
_MAX_TOTAL = 1 << 62  # kernels count in int64: capacity and total length stay below this


def validate(lengths: object, capacity: object) -> tuple[np.ndarray, int]:
    """``(lengths as contiguous int64, capacity as int)``; ``TypeError`` / ``ValueError`` for bad input,
    naming the offending index."""
    if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral):
        raise TypeError(f"capacity must be an int, got {capacity!r} ({type(capacity).__name__})")
    capacity = int(capacity)
    if not 1 <= capacity <= _MAX_TOTAL:
        raise ValueError(f"{capacity=} must be in 1..2**62 (kernels count in int64)")
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64), capacity
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"lengths must be integers, got dtype {arr.dtype}")
    low = int(np.argmin(arr))
    if arr[low] < 1:
        raise ValueError(f"lengths[{low}]={int(arr[low])} must be >= 1 (item {low} is empty)")
    high = int(np.argmax(arr))
    if arr[high] > capacity:
        raise ValueError(f"item {high} has length {int(arr[high])} > {capacity=}; split or drop it first")
    if int(arr[high]) * arr.size > _MAX_TOTAL and sum(arr.tolist()) > _MAX_TOTAL:
        raise ValueError("the lengths must sum to at most 2**62 (kernels count in int64)")
    return np.ascontiguousarray(arr, dtype=np.int64), capacity


def decreasing_order(lengths: np.ndarray) -> np.ndarray:
    """Item indices by decreasing length, ties by increasing index (stable, deterministic)."""
    top = int(lengths.max()) if lengths.size else 0
    if top <= _RADIX_MAX:
        key = (top - lengths).astype(np.uint16)
    else:
        key = -lengths
    return np.argsort(key, kind="stable")


def shuffled_order(n: int, seed: int) -> np.ndarray:
    """A permutation of ``range(n)`` drawn from ``numpy.random.default_rng(seed)``."""
    return np.random.default_rng(seed).permutation(n).astype(np.int64)


def any_fit_bin_bound(lengths: np.ndarray, capacity: int) -> int:
    """Most bins any any-fit packer can open: ``2·sum // C + 2``, capped at n (no two bins are both at
    most half full, so ``(m - 1)·C/2 < sum``). Kernels size their trees by this."""
    return int(min(lengths.size, 2 * int(lengths.sum()) // capacity + 2))


def from_log(items: np.ndarray, bins: np.ndarray, num_bins: int) -> PackResult:
    """Placement log -> ``PackResult``: a stable sort by bin (a uint16 key below 65536 bins lets numpy
    radix-sort it in O(n)) keeps each bin's items in placement order."""
    key = bins.astype(np.uint16 if num_bins <= _RADIX_MAX else np.int64, copy=False)
    order = np.asarray(items, dtype=np.int64)[np.argsort(key, kind="stable")]
    offsets = np.zeros(num_bins + 1, dtype=np.int64)
    np.cumsum(np.bincount(bins, minlength=num_bins), out=offsets[1:])
    return PackResult(order=order, offsets=offsets)


def group_log(items: np.ndarray, bins: np.ndarray, order: np.ndarray, offsets: np.ndarray) -> None:
    """Kernel (compiled path): ``from_log`` as one O(n) counting sort into ``order`` and ``offsets`` (zeros, ``[num_bins
    + 1]``), where a stable argsort by an int64 bin id would be a 0.1 s timsort at 1e6 items."""
    for j in range(len(bins)):
        offsets[bins[j] + 1] += 1
    for b in range(len(offsets) - 1):
        offsets[b + 1] += offsets[b]
    cursor = offsets[:-1].copy()
    for j in range(len(bins)):
        b = bins[j]
        order[cursor[b]] = items[j]
        cursor[b] += 1


def from_starts(items: np.ndarray, starts: np.ndarray) -> PackResult:
    """Bins that are consecutive runs of ``items`` beginning at positions ``starts``."""
    offsets = np.append(np.asarray(starts, dtype=np.int64), np.int64(items.size))  # n >= 1 (Packer.flat)
    return PackResult(order=np.asarray(items, dtype=np.int64), offsets=offsets)
