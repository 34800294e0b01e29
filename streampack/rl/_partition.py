"""The two partition primitives the RL planners need, from ``streampack.packing``."""

from __future__ import annotations

import numpy as np

from streampack.packing import karmarkar_karp, pack


def balanced_parts(values: np.ndarray, k: int) -> list[np.ndarray]:
    """``k`` non-empty parts (``k <= len(values)``) with balanced sums of ``values``."""
    assert 1 <= k <= values.size, (k, values.size)
    parts = [np.asarray(p, dtype=np.int64) for p in karmarkar_karp(values, k)]
    # positive values and k <= n: largest differencing never leaves a part empty
    assert len(parts) == k and all(p.size for p in parts), "partition left a part empty"
    return parts


def bins(values: np.ndarray, capacity: int, algorithm: str) -> list[np.ndarray]:
    """Bins of item indices, each with ``sum(values) <= capacity``."""
    out = [np.asarray(b, dtype=np.int64) for b in pack(values, capacity, algorithm=algorithm)]
    assert all(int(values[b].sum()) <= capacity for b in out), "a bin exceeds its capacity"
    return out
