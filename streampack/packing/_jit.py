"""Compiling the packing kernels with numba, on first use, with a cache outside the package.

Each algorithm's inner loop is one *kernel*: a plain function in the subset of Python that
numba compiles (ints, lists, ``heapq``, indexing; no calls to other Python functions). The
small-input path runs it as it is, on Python lists; the large-input path runs
``compiled(kernel)`` on numpy arrays. One source for both means the two paths cannot drift
apart: they produce identical bins by construction, which the property tests then check.

Nothing here imports numba at module level: ``compiled`` imports it on the first large
input, so ``import streampack.packing`` and window-sized ``pack`` calls never load it. When
the ahead-of-time module is built (``streampack.packing.aot``), ``compiled`` returns its
functions instead and numba is never imported (18 ms to load vs 0.7–7 s; see ``aot``).

The on-disk cache, and why. Measured (numba 0.68; ``benchmarks/bench_packing_scaling.py``, table in ``benchmarks/README.md``,
"The on-disk cache"): a fresh
process's first compiled call costs 1.2–1.8 s per algorithm with an empty cache (kk 4.8 s:
it needs four kernels) and 0.66–0.86 s with the cache filled, of which ~0.3 s is importing
numba and ~0.3 s its code generator starting up. So the cache saves 0.6–3.9 s in every
process that packs a large input — as much as the plain path takes for 1e6 items (bfd
0.46 s, ffd 1.4 s) — and without it the compiled path would lose to the plain one on a
one-off call up to a few million items. So the cache is on, but never next to the source
(numba's default ``__pycache__`` is inside the installed package, read-only on many
clusters): it lives in ``$STREAMPACK_CACHE/numba`` (default ``~/.cache/streampack/numba``).
If that directory cannot be written, kernels compile without a cache. numba keys each entry
by the kernel's source-file hash, numba version and CPU, and kernels are self-contained
(enforced below), so an edited kernel never loads stale.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

_COMPILED: dict[Callable[..., Any], Callable[..., Any]] = {}


def cache_dir() -> Path:
    """Where compiled kernels are cached: ``$STREAMPACK_CACHE/numba``, else
    ``~/.cache/streampack/numba`` (``$XDG_CACHE_HOME`` honoured)."""
    from streampack.packing import aot

    return aot.cache_root() / "numba"


def compiled(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """``kernel`` compiled: from the ahead-of-time module (``aot``) when built, else by
    numba's JIT (once per process; from the disk cache when present)."""
    if kernel not in _COMPILED:
        _check_self_contained(kernel)
        from streampack.packing import aot  # here: `python -m streampack.packing.aot` runs it

        built = aot.kernel(kernel)  # the ahead-of-time module, when built: no numba import
        if built is not None:
            _COMPILED[kernel] = built
            return built
        import numba  # only here: the small-input path must never pay for it

        dispatcher = numba.njit(kernel)
        _enable_cache(dispatcher, kernel)
        _COMPILED[kernel] = dispatcher
    return _COMPILED[kernel]


def _check_self_contained(kernel: Callable[..., Any]) -> None:
    # numba cannot call plain Python functions, and its cache would not notice an edit to a
    # helper in another file: a kernel may only use builtins and modules (heapq, math, np).
    for name in kernel.__code__.co_names:
        value = kernel.__globals__.get(name)
        if isinstance(value, types.FunctionType):
            raise TypeError(f"kernel {kernel.__qualname__} calls Python function {name!r}; "
                            f"kernels must be self-contained")


def _enable_cache(dispatcher: Any, kernel: Callable[..., Any]) -> None:
    """Point the dispatcher's cache at ``cache_dir()`` and nowhere else."""
    try:
        from numba.core import caching
    except ImportError:  # numba moved its internals: compile without a cache
        return
    root = str(cache_dir())

    class Locator(caching.UserProvidedCacheLocator):
        def __init__(self, py_func: Any, py_file: str) -> None:
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            self._cache_path = os.path.join(root, self.get_suitable_cache_subpath(py_file))

        @classmethod
        def from_function(cls, py_func: Any, py_file: str) -> Any:
            # the source-file check and the writability probe, without the parent's
            # "is NUMBA_CACHE_DIR set" test; None (not writable) means no cache at all
            return caching._SourceFileBackedLocatorMixin.from_function.__func__(cls, py_func, py_file)

    class Impl(caching.CompileResultCacheImpl):
        _locator_classes = [Locator]  # the only candidate: never the in-tree __pycache__

    class Cache(caching.FunctionCache):
        _impl_class = Impl

    try:
        dispatcher._cache = Cache(kernel)
    except (RuntimeError, AttributeError, OSError):  # no writable cache directory
        pass
