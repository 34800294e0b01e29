"""Deprecated alias of ``streampack.pipeline.jsonl_source``: each name resolves to its new home
(below; see :mod:`streampack._moved`)."""

from streampack._moved import alias

__getattr__, __all__ = alias(__name__, {
    "streampack.io.decode": ("DecodeOptions", "Item", "make_sample", "parse_json_object", "decode_record"),
    "streampack.io.compression": ("DECOMPRESS_ERRORS", "text_stream"),
    "streampack.io.jsonl": ("iter_lines", "iter_jsonl_items"),
}, gone={
    "scan_jsonl": "shards are scanned by streampack.io.index.build_index (every format)",
})
