"""Deprecated module paths: thin aliases of the objects' current homes.

The data-flow layout (commit a22b0fd) moved ``streampack.pipeline.*``, ``streampack.batch``
and ``streampack.overlong`` into ``io/``, ``nodes/``, ``layout/`` with no alias, which broke
every downstream import. Each old module is now a few lines that call :func:`alias`: importing
it emits one ``DeprecationWarning`` naming the new path(s), and each old name resolves lazily
to the current object (the same object, not a copy). Names with no one-to-one successor raise
``AttributeError`` saying what replaced them. The aliases are leaves: nothing in the library
imports them.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def alias(old: str, moved: Mapping[str, tuple[str, ...]],
          gone: Mapping[str, str] | None = None) -> tuple[Callable[[str], Any], list[str]]:
    """``(__getattr__, __all__)`` for the deprecated module ``old``.

    ``moved``: new module -> the old names it now holds; ``gone``: old name -> what to use
    instead. Warns once, when ``old`` is imported (Python caches the module after that).
    """
    home = {name: new for new, names in moved.items() for name in names}
    gone = dict(gone or {})
    where = "; ".join(f"{', '.join(names)} -> {new}" for new, names in moved.items())
    # stacklevel 3: alias() <- the old module's body <- (importlib frames, skipped) <- the importer
    warnings.warn(f"{old} is deprecated and will be removed: import from the new path ({where})",
                  DeprecationWarning, stacklevel=3)

    def __getattr__(name: str) -> Any:
        if name in home:
            return getattr(importlib.import_module(home[name]), name)
        if name in gone:
            raise AttributeError(f"{old}.{name} was removed: {gone[name]}")
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return __getattr__, sorted(home)
