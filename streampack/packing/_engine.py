"""Which path runs a packer: compiled kernels or the same kernels as plain Python (identical bins).

``THRESHOLD`` = 2^16: below it every plain path costs at most ~0.2 s, under the ~0.7 s a fresh process pays to load numba
(``benchmarks/README.md``, "The threshold"); the rest of the ``backend="auto"`` rule is :meth:`Packer.flat`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from streampack.packing._common import from_log, group_log, validate
from streampack.packing.result import Bins, PackResult

THRESHOLD = 1 << 16
"""Inputs with at least this many items use the compiled kernels (``backend="auto"``)."""

_LOADED: set[str] = set()
"""Algorithms whose kernels this process has already compiled or loaded: ``auto`` runs them
compiled at every size, since the one-time cost that the threshold guards is paid. Without
this a warm process had a cliff: ffd took 86–96 ms at 65535 items and 6 ms at 1e5."""

Backend = Literal["auto", "python", "numba"]
IntBuffer = list[int] | np.ndarray
"""What a kernel indexes: a Python list on the plain path, an int64 array when compiled."""
BACKENDS = ("auto", "python", "numba")


@dataclass(frozen=True, slots=True)
class Engine:
    """How kernels run for one call: as plain Python on lists, or compiled on arrays."""

    compiled: bool

    def kernel(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        if not self.compiled:
            return fn
        from streampack.packing import aot  # here: `python -m streampack.packing.aot` runs it

        return aot.compiled(fn)

    def buffer(self, values: np.ndarray) -> IntBuffer:
        """``values`` as the container its kernel is fastest on: the array for numba, a list
        for CPython (indexing a list is ~3x faster than indexing an array)."""
        return values if self.compiled else values.tolist()

    def result(self, items: np.ndarray, bins: Any, num_bins: int) -> PackResult:
        """Placement log (``bins`` an array or list) -> ``PackResult``."""
        bins = np.asarray(bins, dtype=np.int64)
        if not self.compiled:
            return from_log(items, bins, num_bins)
        order = np.empty(items.size, dtype=np.int64)
        offsets = np.zeros(num_bins + 1, dtype=np.int64)
        self.kernel(group_log)(items, bins, order, offsets)
        return PackResult(order=order, offsets=offsets)


Impl = Callable[[np.ndarray, int, int, Engine], PackResult]


@dataclass(frozen=True, slots=True, kw_only=True)
class Packer:
    """One registered packing algorithm. Calling it gives one index array per bin."""

    name: str
    """Registry name (``ALGORITHMS`` key)."""
    impl: Impl
    """``(lengths, capacity, seed, engine) -> PackResult`` on validated input, n >= 1."""
    compiles: bool = True
    """Whether the large-input path compiles kernels; False when numpy alone meets the
    speed targets at every size (then both backends run the same numpy code)."""

    def __call__(self, lengths: Any, capacity: int, *, seed: int = 0) -> Bins:
        return self.flat(lengths, capacity, seed=seed).bins()

    def flat(self, lengths: Any, capacity: int, *, seed: int = 0, backend: Backend = "auto") -> PackResult:
        """The packing as a ``PackResult`` (see ``streampack.packing.pack_flat``)."""
        if backend not in BACKENDS:
            raise ValueError(f"{backend=} is not one of {', '.join(BACKENDS)}")
        lengths, capacity = validate(lengths, capacity)
        if lengths.size == 0:
            return PackResult(order=np.zeros(0, dtype=np.int64), offsets=np.zeros(1, dtype=np.int64))
        from streampack.packing import aot  # here: `python -m streampack.packing.aot` runs it

        auto = backend == "auto" and (lengths.size >= THRESHOLD or self.name in _LOADED
                                      or (self.compiles and aot.loaded() is not None))
        compiled = self.compiles and (backend == "numba" or auto)
        result = self.impl(lengths, capacity, seed, Engine(compiled=compiled))
        if compiled:
            _LOADED.add(self.name)
        return result

    def __repr__(self) -> str:
        return f"<packing algorithm {self.name!r}>"
