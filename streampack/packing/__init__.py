"""Packing algorithms: pure functions from item lengths to bins of item indices (reference: ``docs/algorithms.md``).

Every algorithm is called as ``(lengths, capacity, *, seed=0) -> Bins``: ``lengths`` is int ``[n]`` (each 1..capacity);
one int64 array of item indices per bin in layout order, every index exactly once, no bin over capacity, no empty bin,
deterministic for a seed. ``pack`` is the one entry point, ``pack_flat`` its flat form (:class:`PackResult`),
``ALGORITHMS`` the registry names are validated against. Importing this package loads neither numba nor torch.
"""

from __future__ import annotations

from typing import Any

from streampack.packing._engine import THRESHOLD, Backend, Packer
from streampack.packing.balanced import kk
from streampack.packing.best_fit import bfd
from streampack.packing.cost import CostModel
from streampack.packing.first_fit import ffd, ffs
from streampack.packing.histogram import histogram
from streampack.packing.karmarkar_karp import karmarkar_karp
from streampack.packing.metrics import MetricsAccumulator, PackingMetrics, packing_metrics
from streampack.packing.mffd import mffd
from streampack.packing.result import Bins, PackResult
from streampack.packing.schedule import Balance
from streampack.packing.sequential import greedy, shuffle_pack

ALGORITHMS: dict[str, Packer] = {p.name: p for p in (greedy, shuffle_pack, ffd, ffs, bfd, mffd, histogram, kk)}


def get_algorithm(name: str) -> Packer:
    """The packer registered as ``name``; ``ValueError`` listing the valid names otherwise."""
    try:
        return ALGORITHMS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown packing algorithm {name!r}; valid names: {', '.join(sorted(ALGORITHMS))}") from None


def pack_flat(lengths: Any, capacity: int, algorithm: str = "bfd", seed: int = 0, *,
              backend: Backend = "auto") -> PackResult:
    """Pack items of the given lengths into bins of ``capacity`` tokens, as flat arrays.

    Args:
        lengths: integer array ``[n]``, every entry in 1..capacity.
        capacity: tokens per bin, 1..2^62.
        algorithm: a name in ``ALGORITHMS``.
        seed: randomness for ``ffs`` / ``shuffle_pack``; ignored by the others.
        backend: ``"auto"`` (compiled when built ahead of time, already loaded, or at
            ``THRESHOLD`` items and above; else plain Python), ``"python"`` or ``"numba"``
            to force one; the bins are the same.

    Returns:
        ``PackResult`` with ``order`` int64 ``[n]`` and ``offsets`` int64 ``[num_bins + 1]``;
        ``result.bins()`` gives what ``pack`` returns.

    Example: ``pack_flat([5, 4, 3, 3, 3], 10, "ffd")`` -> ``order=[0, 1, 2, 3, 4]``, ``offsets=[0, 2, 5]``.
    """
    return get_algorithm(algorithm).flat(lengths, capacity, seed=seed, backend=backend)


def pack(lengths: Any, capacity: int, algorithm: str = "bfd", seed: int = 0, *, backend: Backend = "auto") -> Bins:
    """Pack items of the given lengths into bins of ``capacity`` tokens.

    Arguments as ``pack_flat``. Returns one int64 array per bin with the indices of its items, in layout order (see each
    algorithm), as a read-only sequence (``Bins``: each array is made when read, so ``pack`` costs what ``pack_flat``
    does); empty (``== []``) when n = 0.

    Example: ``pack([5, 4, 3, 3, 3], 10, "ffd")`` -> ``[array([0, 1]), array([2, 3, 4])]``.
    """
    return pack_flat(lengths, capacity, algorithm, seed, backend=backend).bins()


__all__ = ["ALGORITHMS", "THRESHOLD", "Backend", "Balance", "Bins", "CostModel", "MetricsAccumulator", "PackResult",
           "Packer", "PackingMetrics", "bfd", "ffd", "ffs", "get_algorithm", "greedy", "histogram", "karmarkar_karp",
           "kk", "mffd", "pack", "pack_flat", "packing_metrics", "shuffle_pack"]
