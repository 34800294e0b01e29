"""Deprecated alias of :mod:`streampack.nodes.stages` (see :mod:`streampack._moved`)."""

from streampack._moved import alias

__getattr__, __all__ = alias(__name__, {
    "streampack.nodes.stages": ("NodeStage", "MapSamples", "check_stages", "build_stages"),
})
