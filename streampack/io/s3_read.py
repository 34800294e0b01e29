"""S3 ranged reads pinned to one version of the object, never read past the range asked.

s3fs's ``cat_file`` drops what the answer says about the object, so an overwritten key would
splice two versions. Here the ``GetObject`` goes through s3fs's own client with ``IfMatch`` set
to the first answer's ETag, and each answer's ``ETag`` and ``ContentRange`` total are compared
with the pin (:class:`~streampack.io.http.Pin`); a mismatch or 412 is ``DataError("shard_changed")``.
"""

from __future__ import annotations

from typing import Any

from streampack.io.http import CONTENT_RANGE, Pin, changed, check_total, check_version
from streampack.io.retry import Transient


def s3_get_range(fs: Any, path: str, start: int, end: int, pin: Pin, deadline: float) -> bytes:
    """Bytes ``[start, end)`` of the S3 object ``path`` of the version ``pin`` names."""
    from fsspec.asyn import sync

    return sync(fs.loop, _get, fs, path, start, end, pin, timeout=deadline)


async def _get(fs: Any, path: str, start: int, end: int, pin: Pin) -> bytes:
    from s3fs.core import version_id_kw

    bucket, key, version = fs.split_path(path)
    extra = {"IfMatch": pin.etag} if pin.etag and not pin.etag.startswith("W/") else {}
    try:
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}",
                                 **version_id_kw(version), **extra)
    except Exception as e:
        if _precondition_failed(e):
            raise changed(path, f"the store refused IfMatch {pin.etag} (HTTP 412)") from None
        raise
    body = resp["Body"]
    try:
        check_version({"ETag": resp.get("ETag")} if resp.get("ETag") else {}, f"s3://{path}", pin)
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


def _precondition_failed(exc: BaseException) -> bool:
    from streampack.io.failures import status_of

    status, code = status_of(exc)
    return status == 412 or code == "PreconditionFailed"


__all__ = ["s3_get_range"]
