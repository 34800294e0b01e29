"""Deprecated alias of :mod:`streampack.layout.batch` (see :mod:`streampack._moved`)."""

from streampack._moved import alias

__getattr__, __all__ = alias(__name__, {
    "streampack.layout.batch": ("PackedBatch", "alignment", "pack_batch", "check_invariants"),
})
