"""Ahead-of-time packing kernels: one extension module, built once per machine by ``python -m streampack.packing.aot``
into ``$STREAMPACK_CACHE/aot``, that a process loads in 18 ms without importing numba (``docs/algorithms.md``). Its name
hashes the kernel files, numpy's and Python's versions and the machine, so an edited kernel never loads a stale build.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

_STATE: dict[str, Any] = {}  # "module": the loaded module, or None once known to be absent

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


def _modules() -> list[ModuleType]:
    # by module path: the package's `mffd` / `histogram` attributes are the packers. Imported
    # here, not at module level: the algorithm modules import `_jit`, which imports this one.
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


def loaded() -> ModuleType | None:
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


def kernel(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """``fn`` from the built module, or None."""
    module = loaded()
    return None if module is None else getattr(module, fn.__name__, None)


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


if __name__ == "__main__":
    print(build())
