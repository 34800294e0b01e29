"""Deprecated alias of :mod:`streampack.nodes.reader` (see :mod:`streampack._moved`)."""

from streampack._moved import alias

__getattr__, __all__ = alias(__name__, {
    "streampack.nodes.reader": ("ShardReader", "CONFIG_KEY", "EPOCH_KEY", "SHARD_POS_KEY", "OFFSET_KEY",
                                "SAMPLE_KEY", "YIELDED_KEY", "EPOCH_YIELDED_KEY"),
    "streampack.state": ("STATE_VERSION", "VERSION_KEY"),
})
