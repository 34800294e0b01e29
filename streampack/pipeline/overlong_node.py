"""Deprecated alias of :mod:`streampack.nodes.overlong` (see :mod:`streampack._moved`)."""

from streampack._moved import alias

__getattr__, __all__ = alias(__name__, {
    "streampack.nodes.overlong": ("OverlongNode",),
})
