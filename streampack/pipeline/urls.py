"""Shard URLs: expansion (dir / brace / glob / list) and safe opening at a byte offset.

Opening is the only place that touches the filesystem or the network:

- local paths are ``open``-ed and ``seek``-ed (resuming never reads the bytes before ``offset``);
- ``http(s)://`` uses one ``urllib`` GET with ``Range: bytes=offset-end`` and retries a
  connection failure (or a 5xx) ``retries`` times with exponential backoff, then raises a
  ``DataError("unreachable_url")`` naming the URL. A server that ignores ``Range`` (200 instead
  of 206) still works: the skipped bytes are read and discarded;
- ``s3://bucket/key`` uses one ranged ``GetObject`` through ``boto3`` (see ``s3``), with the same
  retries and errors; ``s3://bucket/prefix/`` (a trailing ``/``) lists the prefix's shards;
- ``pipe:cmd`` runs a shell command, so it is refused unless ``allow_pipe=True`` (shard lists
  often come from config files; webdataset's ``gopen`` executes them unasked). A pipe cannot
  seek: resuming reads and discards ``offset`` bytes.
"""

from __future__ import annotations

import glob
import io
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

from streampack.pipeline import s3
from streampack.pipeline.errors import DataError

SHARD_SUFFIXES: dict[str, str] = {".tar": "tar", ".jsonl": "jsonl", ".ndjson": "jsonl", ".jsonl.gz": "jsonl.gz"}
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")
_DISCARD_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenOptions:
    """How shards are opened; passed as one value from the reader to the sources."""

    retries: int = 3
    """Extra attempts after a failed connection to an ``http(s)`` or ``s3`` URL."""
    backoff: float = 0.5
    """Seconds before the first retry; doubled after each."""
    timeout: float = 30.0
    """Socket timeout of one HTTP / S3 request, seconds."""
    allow_pipe: bool = False
    """Accept ``pipe:`` URLs (runs a shell command)."""

    def __post_init__(self) -> None:
        if self.retries < 0 or self.backoff < 0 or self.timeout <= 0:
            raise ValueError(f"need retries >= 0, backoff >= 0, timeout > 0; got {self.retries=} {self.backoff=} {self.timeout=}")


def is_remote(url: str) -> bool:
    return url.startswith(("http://", "https://", s3.S3_PREFIX))


def shard_format(url: str) -> str:
    """``"tar"``, ``"jsonl"`` or ``"jsonl.gz"`` from the URL's suffix (query string ignored)."""
    path = url.split("?", 1)[0].split("#", 1)[0]
    for suffix in sorted(SHARD_SUFFIXES, key=len, reverse=True):
        if path.endswith(suffix):
            return SHARD_SUFFIXES[suffix]
    raise ValueError(f"cannot tell the format of shard {url!r}: want one of {sorted(SHARD_SUFFIXES)}")


def braceexpand(pattern: str) -> list[str]:
    """``a-{000..002}.tar`` -> three names (zero padding kept); ``{x,y}`` -> alternatives."""
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    body, head, tail = m.group(1), pattern[: m.start()], pattern[m.end() :]
    rng = _RANGE.match(body)
    if rng:
        lo, hi = int(rng.group(1)), int(rng.group(2))
        if hi < lo:
            raise ValueError(f"brace range {body!r} in {pattern!r} is descending")
        width = len(rng.group(1)) if rng.group(1).startswith("0") else 0
        choices = [str(i).zfill(width) for i in range(lo, hi + 1)]
    else:
        choices = body.split(",")
    return [out for c in choices for out in braceexpand(head + c + tail)]


def expand_urls(urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *, allow_pipe: bool = False) -> list[str]:
    """Shards, in order: each item is a path, a directory (its shard files, sorted, recursive),
    a brace pattern, a glob, an ``http(s)://`` or ``s3://`` URL, an ``s3://bucket/prefix/``
    (its shard objects, sorted; listed with default ``OpenOptions``) or (if allowed) a
    ``pipe:`` command.

    A local path that does not exist is kept (it fails as ``missing_shard`` when read, so
    ``on_error="skip"`` can ride over it); a pattern or directory that matches nothing raises.
    """
    items = [urls] if isinstance(urls, (str, os.PathLike)) else list(urls)
    if not items:
        raise ValueError("no shard URLs given")
    out: list[str] = []
    for item in items:
        item = os.fspath(item)
        if item.startswith("pipe:"):
            if not allow_pipe:
                raise ValueError(f"refusing {item!r}: pipe: URLs run shell commands; pass allow_pipe=True to accept them")
            out.append(item)
            continue
        if item.startswith("file://"):
            item = item[len("file://") :]
        for name in braceexpand(item):
            out.extend(_expand_one(name))
    for url in out:
        if not url.startswith("pipe:"):
            shard_format(url)
    return out


def _expand_one(name: str) -> list[str]:
    if s3.is_s3(name) and (name.endswith("/") or not s3.split_url(name)[1]):
        return s3.list_prefix(name, tuple(SHARD_SUFFIXES), OpenOptions())
    if is_remote(name):
        return [name]
    if os.path.isdir(name):
        found = sorted(
            os.path.join(root, f)
            for root, _, files in os.walk(name)
            for f in files
            if any(f.endswith(s) for s in SHARD_SUFFIXES)
        )
        if not found:
            raise ValueError(f"directory {name!r} holds no shard files ({sorted(SHARD_SUFFIXES)})")
        return found
    if glob.has_magic(name):
        found = sorted(glob.glob(name))
        if not found:
            raise ValueError(f"glob {name!r} matches no files")
        return found
    return [name]


def _open_local(path: str) -> BinaryIO:
    """Indirection point so tests can count the bytes a reader touches."""
    return open(path, "rb")


def open_shard(url: str, offset: int = 0, end: int | None = None, *, opts: OpenOptions = OpenOptions()) -> BinaryIO:
    """A binary stream positioned at byte ``offset`` of ``url``; reading stops at ``end``
    for remote shards (the Range header) and is the caller's job for local files."""
    if offset < 0 or (end is not None and end < offset):
        raise ValueError(f"bad byte range {offset=} {end=} for {url!r}")
    if url.startswith("pipe:"):
        if not opts.allow_pipe:
            raise ValueError(f"refusing {url!r}: pass allow_pipe=True to run shell commands")
        proc = subprocess.Popen(url[len("pipe:") :], shell=True, stdout=subprocess.PIPE)
        assert proc.stdout is not None
        _discard(proc.stdout, offset, url)
        return proc.stdout  # type: ignore[return-value]
    if s3.is_s3(url):
        return s3.open_object(url, offset, end, opts)
    if is_remote(url):
        return _open_http(url, offset, end, opts)
    try:
        f = _open_local(url)
    except FileNotFoundError:
        raise DataError("missing_shard", "no such file", url=url, value=url) from None
    except OSError as e:
        raise DataError("missing_shard", f"cannot open: {e}", url=url, value=url) from None
    f.seek(offset)
    return f


def _open_http(url: str, offset: int, end: int | None, opts: OpenOptions) -> BinaryIO:
    headers = {"Range": f"bytes={offset}-{'' if end is None else end - 1}"} if (offset or end is not None) else {}
    last: Exception | None = None
    for attempt in range(opts.retries + 1):
        if attempt:
            time.sleep(opts.backoff * 2 ** (attempt - 1))
        try:
            resp = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=opts.timeout)
        except urllib.error.HTTPError as e:
            if e.code == 416:  # offset == size: nothing left to read
                return io.BytesIO(b"")
            if e.code in (404, 410):
                raise DataError("missing_shard", f"HTTP {e.code}", url=url, value=url) from None
            if e.code < 500:
                raise DataError("unreachable_url", f"HTTP {e.code}", url=url, value=url) from None
            last = e
        except (urllib.error.URLError, OSError) as e:
            last = e
        else:
            if offset and resp.status == 200:
                _discard(resp, offset, url)
            return resp
    raise DataError("unreachable_url", f"failed after {opts.retries + 1} attempts: {last}", url=url, value=url)


def _discard(f: BinaryIO, n: int, url: str) -> None:
    while n > 0:
        chunk = f.read(min(n, _DISCARD_CHUNK))
        if not chunk:
            raise DataError("corrupt_shard", "stream ended before the resume offset", url=url, value=n)
        n -= len(chunk)


def remote_fingerprint(url: str, opts: OpenOptions) -> str:
    """``size|last-modified|etag`` of a remote shard from a HEAD request (for index caching)."""
    if s3.is_s3(url):
        return s3.fingerprint(url, opts)
    req = urllib.request.Request(url, method="HEAD")
    last: Exception | None = None
    for attempt in range(opts.retries + 1):
        if attempt:
            time.sleep(opts.backoff * 2 ** (attempt - 1))
        try:
            with urllib.request.urlopen(req, timeout=opts.timeout) as resp:
                h = resp.headers
                return f"{h.get('Content-Length')}|{h.get('Last-Modified')}|{h.get('ETag')}"
        except urllib.error.HTTPError as e:
            if e.code in (404, 410):
                raise DataError("missing_shard", f"HTTP {e.code}", url=url, value=url) from None
            last = e
        except (urllib.error.URLError, OSError) as e:
            last = e
    raise DataError("unreachable_url", f"failed after {opts.retries + 1} attempts: {last}", url=url, value=url)


__all__ = ["OpenOptions", "braceexpand", "expand_urls", "is_remote", "open_shard", "remote_fingerprint", "shard_format"]
