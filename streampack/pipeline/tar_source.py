"""Deprecated alias of ``streampack.pipeline.tar_source``: each name resolves to its new home
(below; see :mod:`streampack._moved`)."""

from streampack._moved import alias

__getattr__, __all__ = alias(__name__, {
    "streampack.io.tar": ("BLOCK", "split_key", "iter_tar_items"),
    "streampack.io.tar_stream": ("Cursor", "TarMember", "iter_tar_members"),
    "streampack.io.tar_decode": ("PICKLE_EXTS", "decode_tar_sample"),
    "streampack.io.npy": ("npy_length",),
}, gone={
    "iter_tar_groups": "streampack.io.tar.iter_tar_items yields whole samples",
    "scan_tar": "shards are scanned by streampack.io.index.build_index (every format)",
})
