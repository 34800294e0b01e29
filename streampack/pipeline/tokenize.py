"""Deprecated alias of :mod:`streampack.nodes.tokenize` (see :mod:`streampack._moved`)."""

from streampack._moved import alias

__getattr__, __all__ = alias(__name__, {
    "streampack.nodes.tokenize": ("Encoder", "make_encoder", "Tokenize"),
})
