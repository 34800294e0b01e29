"""http(s) and S3 requests that check what comes back: one version of one object, exactly the bytes asked.

Not fsspec's ``cat_file``: it drops the headers and reads the whole body whatever its length (an endless body added
+241 MiB RSS within a 4 s deadline), and its ``info`` has no deadline; s3fs's likewise drops what the answer says about
the object, so an overwritten key would splice two versions. So the requests go through the same filesystem's own
session (aiohttp) or client (s3fs): the first answer pins the object's ETag and size, every later block is sent
``If-Match`` and must report the same (else ``DataError("shard_changed")``), and a body past the range asked for is the
``long_body`` fault (docs/storage.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from streampack.errors import DataError
from streampack.io.failures import status_of
from streampack.io.retry import Transient

CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_CHUNK = 1 << 20


@dataclass(slots=True)
class Pin:
    """The version of one object a stream reads (mutable: set by the first answer)."""

    size: int | None = None
    etag: str | None = None


def head(fs: Any, url: str, deadline: float) -> dict[str, Any]:
    """``{"size", "ETag"?, "Last-Modified"?}`` of ``url`` (a ``HEAD``; a 1-byte ranged ``GET`` when
    the ``HEAD`` gives no size), all within ``deadline`` seconds."""
    from fsspec.asyn import sync

    return sync(fs.loop, _head, fs, url, timeout=deadline)


def get_range(fs: Any, url: str, start: int, end: int, pin: Pin, deadline: float) -> bytes:
    """Bytes ``[start, end)`` of ``url`` (fewer only at the object's end), of the version ``pin``
    names (which the first call sets), read within ``deadline`` seconds."""
    from fsspec.asyn import sync

    return sync(fs.loop, _get, fs, url, start, end, pin, timeout=deadline)


def _kwargs(fs: Any, headers: dict[str, str]) -> dict[str, Any]:
    kw = dict(fs.kwargs)
    kw["headers"] = {**kw.get("headers", {}), **headers}
    return kw


async def _head(fs: Any, url: str) -> dict[str, Any]:
    session = await fs.set_session()
    info: dict[str, Any] = {"size": None}
    kw = {"allow_redirects": True, **_kwargs(fs, {"Accept-Encoding": "identity"})}  # aiohttp's HEAD does not follow
    async with session.head(fs.encode_url(url), **kw) as r:
        _check_status(fs, r, url)
        if "Content-Length" in r.headers and r.headers.get("Content-Encoding", "identity") in ("identity", ""):
            info["size"] = int(r.headers["Content-Length"])
        info.update({k: r.headers[k] for k in ("ETag", "Last-Modified") if r.headers.get(k)})
    if info["size"] is None:  # a server that answers HEAD without a size: ask for one byte
        async with session.get(fs.encode_url(url), **_kwargs(fs, {"Range": "bytes=0-0"})) as r:
            _check_status(fs, r, url)
            m = CONTENT_RANGE.fullmatch(r.headers.get("Content-Range", ""))
            if m is not None and m.group(3) != "*":
                info["size"] = int(m.group(3))
            r.close()  # the body is not read: the connection must not be reused
    return info


async def _get(fs: Any, url: str, start: int, end: int, pin: Pin) -> bytes:
    session = await fs.set_session()
    headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
    if pin.etag and not pin.etag.startswith("W/"):
        headers["If-Match"] = pin.etag
    async with session.get(fs.encode_url(url), **_kwargs(fs, headers)) as r:
        if r.status == 412:
            raise changed(url, f"the server refused If-Match {pin.etag} (HTTP 412)")
        if r.status == 416 and pin.size is not None:  # "bytes */<size>": is it still that long?
            m = re.fullmatch(r"bytes \*/(\d+)", r.headers.get("Content-Range", ""))
            if m is not None:
                check_total(m.group(1), url, pin)
        _check_status(fs, r, url)
        check_version(r.headers.get("ETag"), url, pin)
        if r.status == 206:
            m = CONTENT_RANGE.fullmatch(r.headers.get("Content-Range", ""))
            if m is None or int(m.group(1)) != start:
                raise DataError("unreachable_url", f"asked for bytes {start}-{end - 1}, the answer is "
                                f"{r.headers.get('Content-Range')!r}", url=url, value=start)
            check_total(m.group(3), url, pin)
            return await _body(r, 0, min(end, int(m.group(2)) + 1) - start, url)
        # 200: the server ignored Range and sends the whole object
        length = r.headers.get("Content-Length")
        if length is not None:
            check_total(length, url, pin)
        return await _body(r, start, end - start, url)


def _check_status(fs: Any, r: Any, url: str) -> None:
    """Raise for an error status (``FileNotFoundError`` for 404, aiohttp's error otherwise, for
    :func:`~streampack.io.failures.classify`), and for any answer but 200 / 206."""
    fs._raise_not_found_for_status(r, url)
    if r.status not in (200, 206):
        raise DataError("unreachable_url", f"unexpected answer HTTP {r.status} {r.reason or ''}".strip(),
                        url=url, value=url)


def check_version(etag: str | None, url: str, pin: Pin) -> None:
    if not etag:
        return
    if pin.etag is None:
        pin.etag = etag
    elif etag != pin.etag:
        raise changed(url, f"ETag {pin.etag} -> {etag}")


def check_total(total: str, url: str, pin: Pin) -> None:
    if total == "*":
        return
    if pin.size is None:
        pin.size = int(total)
    elif int(total) != pin.size:
        raise changed(url, f"size {pin.size} -> {total} bytes")


def changed(url: str, what: str) -> DataError:
    return DataError("shard_changed", f"object changed while it was read ({what}); the bytes read so far "
                     "belong to the old version", url=url, value=url)


async def _body(r: Any, skip: int, want: int, url: str) -> bytes:
    """``want`` bytes after the first ``skip`` of ``r``'s body (fewer if it ends first), and a
    ``long_body`` fault if it goes on past them; never more is read."""
    out = bytearray()
    while skip:
        chunk = await r.content.read(min(skip, _CHUNK))
        if not chunk:
            return b""
        skip -= len(chunk)
    while len(out) < want:
        chunk = await r.content.read(min(want - len(out), _CHUNK))
        if not chunk:
            return bytes(out)
        out += chunk
    declared = r.headers.get("Content-Length")
    more = await r.content.read(1) if r.status == 206 and declared is None else b""
    if more or (r.status == 206 and declared is not None and int(declared) > want):
        r.close()  # unread bytes follow: this connection cannot carry another request
        raise Transient("long_body", detail=f"body longer than the {want} bytes asked for")
    if r.status == 200 and not r.content.at_eof():
        r.close()  # the rest of the object was not asked for
    return bytes(out)


def s3_get_range(fs: Any, path: str, start: int, end: int, pin: Pin, deadline: float) -> bytes:
    """Bytes ``[start, end)`` of the S3 object ``path`` of the version ``pin`` names."""
    from fsspec.asyn import sync

    return sync(fs.loop, _s3_get, fs, path, start, end, pin, timeout=deadline)


async def _s3_get(fs: Any, path: str, start: int, end: int, pin: Pin) -> bytes:
    from s3fs.core import version_id_kw

    bucket, key, version = fs.split_path(path)
    extra = {"IfMatch": pin.etag} if pin.etag and not pin.etag.startswith("W/") else {}
    try:
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}",
                                 **version_id_kw(version), **extra)
    except Exception as e:
        status, code = status_of(e)
        if status == 412 or code == "PreconditionFailed":
            raise changed(path, f"the store refused IfMatch {pin.etag} (HTTP 412)") from None
        raise
    body = resp["Body"]
    try:
        check_version(resp.get("ETag"), f"s3://{path}", pin)
        m = CONTENT_RANGE.fullmatch(resp.get("ContentRange") or "")
        if m is not None:
            check_total(m.group(3), f"s3://{path}", pin)
        want = end - start
        if resp.get("ContentLength", want) > want:
            raise Transient("long_body", detail=f"body of {resp['ContentLength']} bytes for the {want} asked for")
        data = bytearray()
        while len(data) < want:  # a read returns what has arrived, up to its size
            chunk = await body.read(want - len(data))
            if not chunk:
                break
            data += chunk
        return bytes(data)
    finally:
        body.close()


__all__ = ["CONTENT_RANGE", "Pin", "changed", "check_total", "check_version", "get_range", "head", "s3_get_range"]
