"""Deprecated alias of ``streampack.pipeline.urls``: each name resolves to its new home
(below; see :mod:`streampack._moved`)."""

from streampack._moved import alias

__getattr__, __all__ = alias(__name__, {
    "streampack.io.urls": ("SHARD_SUFFIXES", "shard_format", "braceexpand", "expand_urls"),
    "streampack.io.storage": ("OpenOptions", "is_remote"),
    "streampack.io.open": ("open_shard",),
}, gone={
    "remote_fingerprint": "streampack.io.storage.identity(url, opts) (size and ETag/mtime)",
})
