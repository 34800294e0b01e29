"""Deprecated alias of ``streampack.pipeline.packed_source``: each name resolves to its new home
(below; see :mod:`streampack._moved`)."""

from streampack._moved import alias

__getattr__, __all__ = alias(__name__, {
    "streampack.io.packed_format": ("MANIFEST_NAME", "FORMAT", "FORMAT_VERSION", "BLOCK", "PackedShard", "Manifest",
                                    "read_manifest", "check_layout", "packed_manifest", "is_packed_dataset",
                                    "read_pack", "decode_pack"),
    "streampack.nodes.packed_reader": ("PackedShardReader",),
    "streampack.state": ("STATE_VERSION",),
})
