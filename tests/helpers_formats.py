"""Shard writers for the formats added with fsspec storage (import: ``from helpers_formats import ...``).

Same conventions as ``helpers_data``: documents split contiguously over shards; a jsonl line or a
parquet row per document (its key is the line / row number inside the shard).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard
from helpers_data import Doc, split_docs


def write_parquet(path: str | os.PathLike[str], docs: Sequence[Doc], *, row_group_size: int = 16,
                  tokens_key: str = "input_ids", text_key: str = "text", token_type: Any = pa.int32(),
                  extra: dict[str, Any] | None = None) -> str:
    """One parquet file, a row per document: a token list column or a text column."""
    if docs and isinstance(docs[0], str):
        columns: dict[str, Any] = {text_key: pa.array(list(docs), pa.string())}
    else:
        columns = {tokens_key: pa.array([list(d) for d in docs], pa.list_(token_type))}
    columns.update(extra or {})
    pq.write_table(pa.table(columns), os.fspath(path), row_group_size=row_group_size)
    return os.fspath(path)


def write_parquet_shards(directory: str | os.PathLike[str], docs: Sequence[Doc], num_shards: int, *,
                         row_group_size: int = 16, prefix: str = "shard", **kw: Any) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    return [write_parquet(os.path.join(directory, f"{prefix}-{s:06d}.parquet"), [docs[i] for i in rng],
                          row_group_size=row_group_size, **kw)
            for s, rng in enumerate(split_docs(len(docs), num_shards))]


def jsonl_bytes(docs: Sequence[Doc], *, tokens_key: str = "input_ids", text_key: str = "text") -> bytes:
    return "".join(json.dumps({text_key: d} if isinstance(d, str) else {tokens_key: list(d)}, ensure_ascii=False)
                   + "\n" for d in docs).encode()


def write_zst_shards(directory: str | os.PathLike[str], docs: Sequence[Doc], num_shards: int, *,
                     frames: int = 1, prefix: str = "shard", suffix: str = ".jsonl.zst") -> list[str]:
    """jsonl.zst shards; ``frames > 1`` splits each into that many zstd frames (like pzstd)."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for s, rng in enumerate(split_docs(len(docs), num_shards)):
        lines = [jsonl_bytes([docs[i]]) for i in rng]
        chunks = [b"".join(part) for part in np.array_split(np.array(lines, dtype=object), frames) if len(part)]
        path = os.path.join(directory, f"{prefix}-{s:06d}{suffix}")
        with open(path, "wb") as f:
            for chunk in chunks or [b""]:
                f.write(zstandard.ZstdCompressor(level=3).compress(chunk))
        paths.append(path)
    return paths
