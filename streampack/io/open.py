"""Opening a shard at a byte offset: the only place that touches the filesystem or the network.

- local paths are ``open``-ed and ``seek``-ed (resuming never reads the bytes before ``offset``);
- ``http(s)://`` uses one ``urllib`` GET with ``Range: bytes=offset-end``; a connection failure
  or a 5xx is retried under the one retry policy (:mod:`streampack.io.retry`), then raises a
  ``DataError("unreachable_url")`` naming the URL. A server that ignores ``Range`` (200 instead
  of 206) still works: the skipped bytes are read and discarded;
- ``s3://bucket/key`` uses one ranged ``GetObject`` through ``boto3`` (see ``s3``);
- ``pipe:cmd`` runs a shell command, so it is refused unless ``allow_pipe=True`` (shard lists
  often come from config files; webdataset's ``gopen`` executes them unasked). A pipe cannot
  seek: resuming reads and discards ``offset`` bytes.
"""

from __future__ import annotations

import io
import subprocess
import urllib.error
import urllib.request
from typing import BinaryIO

from streampack.errors import DataError
from streampack.io import s3
from streampack.io.retry import OpenOptions, Transient, with_retries
from streampack.io.urls import is_remote

_DISCARD_CHUNK = 1 << 20


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


def _http_failure(e: Exception, url: str) -> Exception:
    """An HTTP failure as a permanent ``DataError`` or a :class:`Transient` to retry."""
    if isinstance(e, urllib.error.HTTPError):
        if e.code in (404, 410):
            return DataError("missing_shard", f"HTTP {e.code}", url=url, value=url)
        if e.code < 500:
            return DataError("unreachable_url", f"HTTP {e.code}", url=url, value=url)
    return Transient(e)


def _open_http(url: str, offset: int, end: int | None, opts: OpenOptions) -> BinaryIO:
    headers = {"Range": f"bytes={offset}-{'' if end is None else end - 1}"} if (offset or end is not None) else {}

    def attempt() -> BinaryIO:
        try:
            return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=opts.timeout)
        except urllib.error.HTTPError as e:
            if e.code == 416:  # offset == size: nothing left to read
                return io.BytesIO(b"")
            raise _http_failure(e, url) from None
        except (urllib.error.URLError, OSError) as e:
            raise Transient(e) from None

    resp = with_retries(attempt, url=url, opts=opts)
    if offset and getattr(resp, "status", 206) == 200:
        _discard(resp, offset, url)
    return resp


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

    def attempt() -> str:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=opts.timeout) as resp:
                h = resp.headers
                return f"{h.get('Content-Length')}|{h.get('Last-Modified')}|{h.get('ETag')}"
        except (urllib.error.URLError, OSError) as e:
            raise _http_failure(e, url) from None

    return with_retries(attempt, url=url, opts=opts)


__all__ = ["open_shard", "remote_fingerprint"]
