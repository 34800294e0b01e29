"""Deprecated alias of :mod:`streampack.errors` and :mod:`streampack.io.decode` (see :mod:`streampack._moved`)."""

from streampack._moved import alias

__getattr__, __all__ = alias(__name__, {
    "streampack.errors": ("OnError", "ON_ERROR_CHOICES", "DataError", "ErrorCounter", "ErrorPolicy"),
    "streampack.io.decode": ("validate_tokens", "validate_text", "validate_per_token"),
})
