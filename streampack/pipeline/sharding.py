"""Deprecated alias of ``streampack.pipeline.sharding``: each name resolves to its new home
(below; see :mod:`streampack._moved`)."""

from streampack._moved import alias

__getattr__, __all__ = alias(__name__, {
    "streampack.nodes.sharding": ("ShardSpan", "epoch_permutation", "assign_shards"),
    "streampack.topology": ("validate_topology", "resolve_topology"),
}, gone={
    "resolve_worker": "streampack.topology.current_worker() (a Worker record: .id, .num_workers)",
})
