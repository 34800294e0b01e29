"""Deprecated alias of :mod:`streampack.io.index` (see :mod:`streampack._moved`)."""

from streampack._moved import alias

__getattr__, __all__ = alias(__name__, {
    "streampack.io.index": ("INDEX_VERSION", "INDEX_SUFFIX", "ShardIndex", "load_or_build_index", "build_index"),
    "streampack.io.index_cache": ("default_cache_dir",),
})
