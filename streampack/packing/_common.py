"""Shared pieces of the packing algorithms: input validation, item orders, bin layout.

Every algorithm produces its result as a *placement log*: ``items[j]`` was the j-th item
placed and went into bin ``bins[j]``. ``to_bins`` turns that log into one int64 index array
per bin, bins in creation order and items inside a bin in the order they were placed.
"""

from __future__ import annotations

import numbers

import numba
import numpy as np

# Stable argsort of a uint16 key is a radix sort in numpy (O(n)); an int64 key falls back to
# timsort. Measured for 1e6 lognormal lengths: 9 ms vs 75 ms.
_RADIX_MAX = int(np.iinfo(np.uint16).max)


def validate(lengths: object, capacity: object) -> tuple[np.ndarray, int]:
    """Check user input and return ``(lengths as contiguous int64, capacity as int)``.

    Raises ``TypeError`` for a non-integer capacity or lengths dtype, ``ValueError`` for a
    capacity < 1, a non-1-D array, a length < 1 or a length > capacity (naming the index).
    """
    if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral):
        raise TypeError(f"capacity must be an int, got {capacity!r} ({type(capacity).__name__})")
    capacity = int(capacity)
    if capacity < 1:
        raise ValueError(f"{capacity=} must be >= 1")
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
        raise ValueError(
            f"item {high} has length {int(arr[high])} > {capacity=}; split or drop it first"
        )
    return np.ascontiguousarray(arr, dtype=np.int64), capacity


def decreasing_order(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Item indices by decreasing length, ties by increasing index (stable, deterministic)."""
    if capacity <= _RADIX_MAX:
        key = (capacity - lengths).astype(np.uint16)
    else:
        key = -lengths
    return np.argsort(key, kind="stable")


def shuffled_order(n: int, seed: int) -> np.ndarray:
    """A permutation of ``range(n)`` drawn from ``numpy.random.default_rng(seed)``."""
    return np.random.default_rng(seed).permutation(n).astype(np.int64)


def any_fit_bin_bound(lengths: np.ndarray, capacity: int) -> int:
    """Most bins any any-fit packer can open: ``2·sum // C + 2``, capped at n.

    An any-fit packer opens a bin only when the item fits no open bin, so no two bins are
    both at most half full; hence ``(m - 1)·C/2 < sum``. Kernels size their trees by this.
    """
    return int(min(lengths.size, 2 * int(lengths.sum()) // capacity + 2))


@numba.njit(cache=True)
def _group(items: np.ndarray, bins: np.ndarray, num_bins: int) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(num_bins + 1, dtype=np.int64)
    for b in bins:
        offsets[b + 1] += 1
    for b in range(num_bins):
        offsets[b + 1] += offsets[b]
    cursor = offsets[:-1].copy()
    flat = np.empty(items.size, dtype=np.int64)
    for j in range(items.size):
        b = bins[j]
        flat[cursor[b]] = items[j]
        cursor[b] += 1
    return flat, offsets


@numba.njit(cache=True)
def grow(a: np.ndarray, fill: int) -> np.ndarray:
    """``a`` doubled in size, new slots set to ``fill`` (for kernels with unknown output size)."""
    out = np.full(2 * a.size, fill, dtype=a.dtype)
    out[:a.size] = a
    return out


def to_bins(items: np.ndarray, bins: np.ndarray, num_bins: int) -> list[np.ndarray]:
    """Placement log -> one int64 array per bin (creation order, items in placement order)."""
    if items.size == 0:
        return []
    flat, offsets = _group(items, bins, num_bins)
    return np.split(flat, offsets[1:-1])


def split_runs(items: np.ndarray, starts: np.ndarray) -> list[np.ndarray]:
    """Bins that are consecutive runs of ``items`` beginning at positions ``starts``."""
    if items.size == 0:
        return []
    return np.split(items, starts[1:])
