"""Deprecated alias of :mod:`streampack.io.packed_writer` (see :mod:`streampack._moved`)."""

from streampack._moved import alias

__getattr__, __all__ = alias(__name__, {
    "streampack.io.packed_writer": ("pack_members", "write_packed_dataset"),
})
