"""``s3://bucket/key`` shards (AWS S3 and S3-compatible stores: MinIO, Ceph, R2, moto).

``urls`` calls this module for every ``s3://`` URL; ``boto3`` is imported only then.

- Endpoint: ``$STREAMPACK_S3_ENDPOINT`` if set, else boto3's own ``$AWS_ENDPOINT_URL_S3`` /
  ``$AWS_ENDPOINT_URL`` / config file, else AWS. With a custom endpoint requests use path-style
  addressing (``http://host:9000/bucket/key``): MinIO and most S3-compatible stores have no
  per-bucket DNS names. Credentials and region come from the normal boto3 chain.
- Opening at ``offset`` is one ``GetObject`` with ``Range: bytes=offset-[end-1]``: resuming never
  reads the bytes before it. botocore's own retries are off (``total_max_attempts=1``) so
  ``OpenOptions.retries`` is the only retry budget: a connection error, a timeout, a 5xx or a
  throttle is retried with exponential backoff, then ``DataError("unreachable_url")``; a
  missing key or bucket is ``DataError("missing_shard")`` at once.
- A read that breaks mid-stream raises ``ConnectionError`` (an ``OSError``), so the reader
  reopens at the recorded offset of the next sample, as for ``http(s)://``.
- One client per (process, endpoint, timeout): clients are thread-safe but must not cross a
  ``fork`` (DataLoader workers), hence the pid in the key.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO, TypeVar

from streampack.errors import DataError
from streampack.io.retry import OpenOptions, Transient, with_retries

S3_PREFIX = "s3://"
ENDPOINT_ENV = "STREAMPACK_S3_ENDPOINT"
_MISSING_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "404", "NotFound"})
_RETRY_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed", "InternalError"})
_READ_BUFFER = 1 << 18
LIST_PAGE_SIZE = 1000
_CLIENTS: dict[tuple[int, str | None, float], Any] = {}
_CLIENTS_LOCK = threading.Lock()
T = TypeVar("T")


def is_s3(url: str) -> bool:
    return url.startswith(S3_PREFIX)


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b.tar`` -> ``("bucket", "a/b.tar")``; the key may be empty (whole bucket)."""
    bucket, _, key = url[len(S3_PREFIX) :].partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket: want s3://bucket/key")
    return bucket, key


def _boto3() -> Any:
    try:
        import boto3
        import botocore  # noqa: F401  (installed with boto3; imported by name below)
    except ImportError:
        raise ImportError("s3:// URLs need boto3: pip install 'streampack[s3]'") from None
    return boto3


def _new_client(endpoint: str | None, timeout: float) -> Any:
    """A fresh S3 client (tests wrap this to hook botocore events)."""
    boto3 = _boto3()
    from botocore.config import Config

    custom = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    config = Config(
        connect_timeout=timeout, read_timeout=timeout, retries={"total_max_attempts": 1},
        s3={"addressing_style": "path"} if custom else None,
    )
    return boto3.session.Session().client("s3", endpoint_url=endpoint, config=config)


def _client(opts: OpenOptions) -> Any:
    key = (os.getpid(), os.environ.get(ENDPOINT_ENV) or None, opts.timeout)
    with _CLIENTS_LOCK:
        if key not in _CLIENTS:
            _CLIENTS[key] = _new_client(key[1], opts.timeout)
        return _CLIENTS[key]


def _call(url: str, opts: OpenOptions, fn: Callable[[Any], T]) -> T:
    """``fn(client)`` under the retry policy (transient failures retried); S3 errors -> DataError."""
    _boto3()
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    def attempt() -> T:
        try:
            return fn(_client(opts))
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            if code in _MISSING_CODES or status in (404, 410):
                raise DataError("missing_shard", f"S3 {code or status}", url=url, value=url) from None
            if status < 500 and code not in _RETRY_CODES:
                raise DataError("unreachable_url", f"S3 {code} (HTTP {status})", url=url, value=url) from None
            raise Transient(e) from None
        except NoCredentialsError as e:
            raise DataError("unreachable_url", f"{e} (set AWS_ACCESS_KEY_ID / a profile)", url=url, value=url) from None
        except (BotoCoreError, OSError) as e:
            raise Transient(e) from None

    return with_retries(attempt, url=url, opts=opts)


class _Body(io.RawIOBase):
    """A ``GetObject`` body as a raw stream; a broken read becomes ``ConnectionError``."""

    def __init__(self, body: Any, url: str) -> None:
        self._body, self._url = body, url

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        from botocore.exceptions import BotoCoreError

        try:
            data = self._body.read(len(b))
        except BotoCoreError as e:  # urllib3 errors arrive wrapped by botocore
            raise ConnectionError(f"reading {self._url}: {e}") from e
        b[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._body.close()
        super().close()


def open_object(url: str, offset: int, end: int | None, opts: OpenOptions) -> BinaryIO:
    """A buffered stream of bytes ``[offset, end)`` of ``url`` (to the object's end if None)."""
    if end is not None and end <= offset:
        return io.BytesIO(b"")
    bucket, key = split_url(url)
    kwargs = {"Bucket": bucket, "Key": key}
    if offset or end is not None:
        kwargs["Range"] = f"bytes={offset}-{'' if end is None else end - 1}"

    _boto3()
    from botocore.exceptions import ClientError

    def get(client: Any) -> Any:
        try:
            return client.get_object(**kwargs)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") == "InvalidRange":  # offset == size
                return None
            raise

    resp = _call(url, opts, get)
    if resp is None:
        return io.BytesIO(b"")
    return io.BufferedReader(_Body(resp["Body"], url), buffer_size=_READ_BUFFER)  # type: ignore[return-value]


def fingerprint(url: str, opts: OpenOptions) -> str:
    """``size|last-modified|etag`` of an object from ``HeadObject`` (for index caching)."""
    bucket, key = split_url(url)
    head = _call(url, opts, lambda c: c.head_object(Bucket=bucket, Key=key))
    return f"{head.get('ContentLength')}|{head.get('LastModified')}|{head.get('ETag')}"


def list_prefix(url: str, suffixes: Sequence[str], opts: OpenOptions) -> list[str]:
    """Sorted ``s3://`` URLs of the objects under prefix ``url`` whose keys end in ``suffixes``."""
    bucket, prefix = split_url(url)

    def keys(client: Any) -> list[str]:
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix, PaginationConfig={"PageSize": LIST_PAGE_SIZE}
        )
        return [obj["Key"] for page in pages for obj in page.get("Contents", ())]

    found = sorted(f"{S3_PREFIX}{bucket}/{k}" for k in _call(url, opts, keys) if k.endswith(tuple(suffixes)))
    if not found:
        raise ValueError(f"S3 prefix {url!r} holds no shard objects ({sorted(suffixes)})")
    return found


__all__ = ["ENDPOINT_ENV", "fingerprint", "is_s3", "list_prefix", "open_object", "split_url"]
