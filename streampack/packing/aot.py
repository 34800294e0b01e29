"""Compiled packing kernels: built ahead of time into one extension module, or by numba's JIT on first use.

Each algorithm's inner loop is one *kernel* in the subset of Python numba compiles; the plain path runs it on lists, the
compiled path :func:`compiled` on arrays: one source, so the two cannot drift apart. ``python -m streampack.packing.aot``
builds every kernel once per machine into ``$STREAMPACK_CACHE/aot``, a module a process loads in 18 ms without importing
numba (``docs/algorithms.md``); its name hashes the kernel files, numpy's and Python's versions and the machine, so an
edited kernel never loads a stale build. Without a build, numba's JIT compiles each kernel on first use, cached in
``$STREAMPACK_CACHE/numba`` (0.6–3.9 s saved per process that packs a large input, ``benchmarks/README.md``, "The
on-disk cache"), never beside the possibly read-only source; an unwritable directory compiles without a cache. Kernels
are self-contained (enforced by :func:`compiled`), so numba's source-hash key never loads a stale one.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import os
import platform
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

_STATE: dict[str, Any] = {}  # "module": the loaded module, or None once known to be absent
_COMPILED: dict[Callable[..., Any], Callable[..., Any]] = {}

A = "i8[:]"
KERNELS = {  # module -> kernel -> numba signature; every array is int64, any layout
    "_common": {"group_log": f"void({A}, {A}, {A}, {A})"},
    "best_fit": {"_bfd_kernel": f"i8({A}, i8, {A}, {A})"},
    "first_fit": {"first_fit_kernel": f"i8({A}, {A}, {A}, i8, i8)"},
    "mffd": {"_pairs_kernel": f"i8({', '.join([A] * 6)})"},
    "balanced": {"_round_kernel": f"i8({', '.join([A] * 7)}, i8)", "_unlink_kernel": f"void({A}, {A}, {A})"},
    "histogram": {"_configurations_kernel": f"UniTuple(i8, 2)({A}, {A}, i8, {', '.join([A] * 5)})",
                  "_emit_kernel": f"UniTuple(i8, 2)({', '.join([A] * 5)}, i8, {A}, {A}, {A})"},
    "sequential": {"_next_fit_kernel": f"i8({A}, i8, {A})"},
}


def _modules() -> list[types.ModuleType]:
    # by module path: the package's `mffd` / `histogram` attributes are the packers. Imported
    # here, not at module level: the algorithm modules import `_engine`, which imports this one.
    return [importlib.import_module(f"streampack.packing.{m}") for m in KERNELS]


def module_name() -> str:
    """``streampack_kernels_<hash>`` of the kernel files (whole files: ~1 ms, where ``inspect.getsource``
    cost 24 ms), the signatures, numpy's ABI and the interpreter."""
    import numpy as np

    digest = hashlib.sha256(repr(KERNELS).encode())
    for module in _modules():
        digest.update(Path(module.__file__ or "").read_bytes())
    digest.update(f"{np.__version__} {sys.version} {platform.machine()}".encode())
    return f"streampack_kernels_{digest.hexdigest()[:16]}"


def cache_root() -> Path:
    """``$STREAMPACK_CACHE``, else ``~/.cache/streampack`` (``$XDG_CACHE_HOME`` honoured): the
    built module goes to ``aot/`` under it, numba's JIT cache to ``numba/``."""
    root = os.environ.get("STREAMPACK_CACHE")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "streampack")
    return Path(root)


def build_dir() -> Path:
    return cache_root() / "aot"


def loaded() -> types.ModuleType | None:
    """The built module for these kernel sources, imported on first use; None when absent."""
    if "module" not in _STATE:
        name = module_name()
        path = build_dir() / f"{name}{importlib.machinery.EXTENSION_SUFFIXES[0]}"
        module = None
        if path.is_file():
            spec = importlib.util.spec_from_file_location(name, path)
            try:  # a build for another platform or a truncated file: use the JIT path
                assert spec is not None and spec.loader is not None, path
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            except ImportError:
                module = None
        _STATE["module"] = module
    return _STATE["module"]


def build(directory: Path | None = None) -> Path:
    """Compile every kernel into one extension module under ``directory`` (default
    ``build_dir()``); returns its path. Needs numba and a C compiler."""
    from numba.pycc import CC

    target = directory or build_dir()
    target.mkdir(parents=True, exist_ok=True)
    cc = CC(module_name())
    cc.output_dir = str(target)
    cc.verbose = False
    for module, signatures in zip(_modules(), KERNELS.values()):
        for name, signature in signatures.items():
            cc.export(name, signature)(getattr(module, name))
    cc.compile()
    _STATE.clear()  # found on the next call
    return target / f"{module_name()}{importlib.machinery.EXTENSION_SUFFIXES[0]}"


def compiled(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """``kernel`` compiled: from the ahead-of-time module when built, else by
    numba's JIT (once per process; from the disk cache when present)."""
    if kernel not in _COMPILED:
        _check_self_contained(kernel)
        module = loaded()  # the ahead-of-time module, when built: no numba import
        built = None if module is None else getattr(module, kernel.__name__, None)
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
    root = str(cache_root() / "numba")

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


if __name__ == "__main__":
    print(build())
