"""Tiny shard writers and a loopback HTTP server for tests (import: ``from helpers_data import ...``).

Documents are split contiguously over shards: shard ``s`` of ``S`` holds documents
``[s*n//S, (s+1)*n//S)`` in order, and document ``i`` gets the sample key ``f"{i:08d}"``
(tar) or sits on its own line (jsonl; key = line number inside the shard).

Example::

    docs = make_token_docs(20, seed=0)                      # list[list[int]]
    urls = write_tar_shards(tmp_path, docs, 4, fmt="npy")   # 4 .tar paths
    texts = make_text_docs(10)
    urls = write_jsonl_shards(tmp_path, texts, 2, gz=True)  # 2 .jsonl.gz paths
    with serve_directory(tmp_path) as server:               # server.url = "http://127.0.0.1:PORT"
        remote = server.urls_for(urls)                      # server.requests logs (path, Range)
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import http.server
import io
import json
import os
import re
import tarfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Doc = list[int] | str


def make_token_docs(n: int, *, seed: int = 0, min_len: int = 1, max_len: int = 40, vocab: int = 1000) -> list[list[int]]:
    """``n`` random token documents with lengths in ``[min_len, max_len]``."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(min_len, max_len + 1))).tolist() for _ in range(n)]


def make_text_docs(n: int, *, seed: int = 0) -> list[str]:
    """``n`` short non-empty texts, some with non-ASCII characters and newlines."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "béta", "γάμμα", "delta", "终", "line\nbreak", "tab\there", "ok"]
    return [f"doc {i}: " + " ".join(rng.choice(words, size=int(rng.integers(1, 8))).tolist()) for i in range(n)]


def split_docs(n: int, num_shards: int) -> list[range]:
    """The document ranges each shard gets (contiguous, in order)."""
    if num_shards < 1:
        raise ValueError(f"{num_shards=} must be >= 1")
    return [range(s * n // num_shards, (s + 1) * n // num_shards) for s in range(num_shards)]


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def tar_members(
    doc: Doc,
    *,
    fmt: str,
    tokens_key: str = "input_ids",
    text_key: str = "text",
    labels: Sequence[int] | None = None,
    loss_mask: Sequence[int] | None = None,
    dtype: Any = np.int64,
) -> dict[str, bytes]:
    """The ``{field: bytes}`` members of one sample.

    ``fmt="npy"``: ``npy`` (tokens, ``dtype``) + ``labels.npy`` / ``loss_mask.npy``;
    ``fmt="json"``: one ``json`` member ``{tokens_key: [...]}`` or ``{text_key: "..."}`` plus
    ``"labels"`` / ``"loss_mask"`` fields; ``fmt="txt"``: a ``txt`` member (text docs only).
    """
    if fmt == "npy":
        out = {"npy": _npy_bytes(np.asarray(doc, dtype=dtype))}
        if labels is not None:
            out["labels.npy"] = _npy_bytes(np.asarray(labels, dtype=np.int64))
        if loss_mask is not None:
            out["loss_mask.npy"] = _npy_bytes(np.asarray(loss_mask, dtype=np.uint8))
        return out
    if fmt == "json":
        record: dict[str, Any] = {text_key: doc} if isinstance(doc, str) else {tokens_key: list(doc)}
        if labels is not None:
            record["labels"] = list(labels)
        if loss_mask is not None:
            record["loss_mask"] = list(loss_mask)
        return {"json": json.dumps(record).encode()}
    if fmt == "txt":
        if not isinstance(doc, str):
            raise ValueError("fmt='txt' needs text documents")
        return {"txt": doc.encode()}
    raise ValueError(f"{fmt=} must be 'npy', 'json' or 'txt'")


def write_tar(path: str | os.PathLike[str], samples: Sequence[tuple[str, dict[str, bytes]]]) -> str:
    """Write ``[(key, {field: bytes})]`` as a webdataset tar (members ``key.field``)."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for key, fields in samples:
            for field, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{field}")
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                tf.addfile(info, io.BytesIO(data))
    return os.fspath(path)


def write_tar_shards(
    directory: str | os.PathLike[str],
    docs: Sequence[Doc],
    num_shards: int,
    fmt: str = "npy",
    *,
    prefix: str = "shard",
    tokens_key: str = "input_ids",
    text_key: str = "text",
    labels: Sequence[Sequence[int]] | None = None,
    loss_mask: Sequence[Sequence[int]] | None = None,
) -> list[str]:
    """Write ``docs`` into ``num_shards`` tar files ``{prefix}-{s:06d}.tar``; return their paths.

    ``docs`` are token lists (fmt ``npy``/``json``) or strings (fmt ``json``/``txt``);
    ``labels``/``loss_mask`` are optional per-document lists of the same lengths.
    """
    os.makedirs(directory, exist_ok=True)
    paths = []
    for s, rng in enumerate(split_docs(len(docs), num_shards)):
        samples = [
            (
                f"{i:08d}",
                tar_members(
                    docs[i], fmt=fmt, tokens_key=tokens_key, text_key=text_key,
                    labels=None if labels is None else labels[i], loss_mask=None if loss_mask is None else loss_mask[i],
                ),
            )
            for i in rng
        ]
        paths.append(write_tar(os.path.join(directory, f"{prefix}-{s:06d}.tar"), samples))
    return paths


def write_jsonl_shards(
    directory: str | os.PathLike[str],
    docs: Sequence[Doc],
    num_shards: int,
    *,
    gz: bool = False,
    prefix: str = "shard",
    tokens_key: str = "input_ids",
    text_key: str = "text",
    labels: Sequence[Sequence[int]] | None = None,
    loss_mask: Sequence[Sequence[int]] | None = None,
) -> list[str]:
    """Write ``docs`` as ``{prefix}-{s:06d}.jsonl[.gz]``, one json object per line; return paths.

    Token docs go under ``tokens_key``, text docs under ``text_key``; optional ``"labels"`` /
    ``"loss_mask"`` fields (read them with ``labels_key="labels"`` / ``loss_mask_key="loss_mask"``).
    """
    os.makedirs(directory, exist_ok=True)
    paths = []
    for s, rng in enumerate(split_docs(len(docs), num_shards)):
        lines = []
        for i in rng:
            record: dict[str, Any] = {text_key: docs[i]} if isinstance(docs[i], str) else {tokens_key: list(docs[i])}
            if labels is not None:
                record["labels"] = list(labels[i])
            if loss_mask is not None:
                record["loss_mask"] = list(loss_mask[i])
            lines.append(json.dumps(record, ensure_ascii=False) + "\n")
        data = "".join(lines).encode()
        path = os.path.join(directory, f"{prefix}-{s:06d}.jsonl" + (".gz" if gz else ""))
        with open(path, "wb") as f:
            f.write(gzip.compress(data, mtime=0) if gz else data)
        paths.append(path)
    return paths


class RangeRequestHandler(http.server.SimpleHTTPRequestHandler):
    """Static files with single-range ``Range: bytes=a-[b]`` support; records requests."""

    def log_message(self, *args: Any) -> None:
        pass

    def send_head(self):  # type: ignore[no-untyped-def]
        self.server.requests.append((self.path, self.headers.get("Range")))  # type: ignore[attr-defined]
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "") or "")
        path = self.translate_path(self.path)
        if m is None or not os.path.isfile(path):
            return super().send_head()
        size = os.path.getsize(path)
        start = int(m.group(1))
        stop = min(int(m.group(2)) + 1 if m.group(2) else size, size)
        if start >= size:
            self.send_error(416)
            return None
        with open(path, "rb") as f:
            f.seek(start)
            body = f.read(stop - start)
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        return io.BytesIO(body)


@dataclass
class LoopbackServer:
    url: str
    """Base URL, ``http://127.0.0.1:PORT`` (no trailing slash)."""
    requests: list[tuple[str, str | None]] = field(default_factory=list)
    """Every GET/HEAD as ``(path, Range header or None)``."""

    def urls_for(self, paths: Sequence[str]) -> list[str]:
        """Remote URLs of local files served from the directory root."""
        return [f"{self.url}/{os.path.basename(p)}" for p in paths]


@contextlib.contextmanager
def serve_directory(directory: str | os.PathLike[str],
                    handler_class: type[RangeRequestHandler] | None = None) -> Iterator[LoopbackServer]:
    """Serve ``directory`` on ``127.0.0.1`` (free port) with Range support (or ``handler_class``, a subclass that
    misbehaves on purpose), in a thread."""
    handler = functools.partial(handler_class or RangeRequestHandler, directory=os.fspath(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    info = LoopbackServer(url=f"http://127.0.0.1:{server.server_address[1]}")
    server.requests = info.requests  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield info
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def closed_port() -> int:
    """A loopback port with nothing listening (bound then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CountingFile(io.RawIOBase):
    """Wraps a real file, recording every byte range it reads."""

    log: list[tuple[int, int]] = []

    def __init__(self, path: str) -> None:
        self._f = open(path, "rb")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        return self._f.seek(pos, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readinto(self, b) -> int:
        pos = self._f.tell()
        n = self._f.readinto(b)
        if n:
            CountingFile.log.append((pos, n))
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


def bucket_manifest(location: str | os.PathLike[str], shards: int) -> None:
    """A manifest of ``shards`` shards shaped like a real bucket's (long common URL prefix, 34-char
    quoted ETags, digests; no shard behind it): what holding a manifest costs is measured on it."""
    import hashlib

    from streampack.io.manifest import Manifest, ShardTotals, save_manifest
    from streampack.io.storage import OpenOptions

    totals = []
    for s in range(shards):
        h = hashlib.sha1(str(s).encode()).hexdigest()
        totals.append(ShardTotals(url=f"s3://my-bucket/datasets/web-2026/train/shard-{s:06d}.tar",
                                  size=400_000_000 + s, tag=f'"{h[:32]}"', samples=10_000 + s % 977,
                                  tokens=6_000_000 + s, byte_cost=399_000_000 + s, digest=f"digest={h}"))
    save_manifest(Manifest.of(str(location), totals), OpenOptions())
