"""Compiling the packing kernels with numba, on first use, with a cache in ``$STREAMPACK_CACHE/numba``.

Each algorithm's inner loop is one *kernel* in the subset of Python numba compiles; the plain path runs it on lists, the
compiled path ``compiled(kernel)`` on arrays: one source, so the two cannot drift apart. The on-disk cache saves 0.6–3.9 s
per process that packs a large input (``benchmarks/README.md``, "The on-disk cache"); it is never beside the possibly
read-only source, and an unwritable directory compiles without it. Kernels are self-contained (enforced below), so
numba's source-hash key never loads a stale one.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from typing import Any

_COMPILED: dict[Callable[..., Any], Callable[..., Any]] = {}


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
    """Point the dispatcher's cache at ``$STREAMPACK_CACHE/numba`` and nowhere else."""
    try:
        from numba.core import caching
    except ImportError:  # numba moved its internals: compile without a cache
        return
    from streampack.packing import aot

    root = str(aot.cache_root() / "numba")

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
