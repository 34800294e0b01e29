"""Read failures sorted into "retry" and "give up", whatever the store raised them as: each fsspec back-end reports
failures its own way, so :func:`classify` looks through the cause chain (which failures retry: docs/storage.md).
"""

from __future__ import annotations

import asyncio
import datetime
import sys
from collections.abc import Mapping
from email.utils import parsedate_to_datetime

from streampack.errors import DataError
from streampack.io.retry import REFUSED, Transient

_SHORT_BODY = {"ClientPayloadError", "IncompleteRead", "ContentLengthError", "TransferEncodingError"}
_TIMEOUTS = {"FSTimeoutError", "ServerTimeoutError", "ReadTimeoutError", "ConnectTimeoutError", "ConnectionTimeoutError",
             "SocketTimeoutError", "ReadTimeout", "ConnectTimeout"}


class RedirectRefused(Exception):
    """An http(s) redirect to another host while ``allow_redirects=False``."""


def classify(exc: BaseException, url: str, *, local: bool = False) -> BaseException:
    """A read failure as :class:`Transient` (retry), ``DataError`` (give up at once), or
    ``exc`` itself (not an I/O failure: a bug, let it propagate)."""
    if isinstance(exc, (DataError, Transient)):  # already judged (io.http)
        return exc
    gone, denied = "missing_shard", "corrupt_shard" if local else "unreachable_url"
    if isinstance(exc, FileNotFoundError) and exc.__cause__ is not None:
        # fsspec's http `info` turns *every* failure into FileNotFoundError: judge its cause
        cause = classify(exc.__cause__, url, local=local)
        if cause is not exc.__cause__:
            return cause
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return DataError(gone, f"no such {'file' if local else 'object'}", url=url, value=url)
    if isinstance(exc, RedirectRefused):
        return DataError("unreachable_url", str(exc), url=url, value=url)
    names = {type(e).__name__ for e in _chain(exc)}
    if "TooManyRedirects" in names:
        return DataError("unreachable_url", f"redirect loop: still redirected after "
                         f"{len(getattr(exc, 'history', ()))} redirects", url=url, value=url)
    if names & _SHORT_BODY:
        return Transient("short_body", exc)
    parse_errors = sys.modules.get("aiohttp.http_exceptions")
    if parse_errors is not None and any(isinstance(e, parse_errors.HttpProcessingError) for e in _chain(exc)):
        return Transient("bad_response", exc, detail=f"unparsable answer: {exc}")
    if any(isinstance(e, ConnectionRefusedError) or isinstance(getattr(e, "os_error", None), ConnectionRefusedError)
           for e in _chain(exc)):
        where = url.partition("://")[2].split("/", 1)[0] or url
        return Transient(REFUSED, exc, detail=f"connection refused by {where} (is the host and port right?)")
    status, code = status_of(exc)
    if status is not None:
        if status in (404, 410) or code in ("NoSuchKey", "NoSuchBucket"):
            return DataError(gone, f"HTTP {status}", url=url, value=url)
        if status in (408, 425, 429) or status >= 500 or code in ("SlowDown", "Throttling", "RequestTimeout"):
            return Transient(f"HTTP {status}", exc, retry_after=_retry_after(exc))
        if status >= 400:
            return DataError(denied, f"HTTP {status} {code or ''}".strip(), url=url, value=url)
    name = type(exc).__name__
    if isinstance(exc, PermissionError) or name in ("NoCredentialsError", "PartialCredentialsError"):
        return DataError(denied, f"access denied: {exc}", url=url, value=url)
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)) or names & _TIMEOUTS:
        return Transient("timeout", exc)
    if isinstance(exc, (ConnectionError, OSError)) or _is_client_error(exc):
        return Transient("connection" if not local else "io_error", exc)
    return exc


def status_of(exc: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status (and S3 error code) anywhere in ``exc``'s cause chain."""
    for seen in _chain(exc):
        status = getattr(seen, "status", None)
        if isinstance(status, int) and 100 <= status < 600:
            return status, None
        response = getattr(seen, "response", None)
        if isinstance(response, Mapping):  # botocore ClientError
            code = str(response.get("Error", {}).get("Code", "")) or None
            meta = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            if meta or code:
                return (meta or 500), code
        status = getattr(response, "status_code", None)  # requests / httpx (huggingface_hub)
        if isinstance(status, int):
            return status, None
    return None, None


def _retry_after(exc: BaseException) -> float | None:
    """Seconds the first ``Retry-After`` header in ``exc``'s chain asks to wait (a number or an HTTP date), if any."""
    headers = next((e.headers for e in _chain(exc) if hasattr(getattr(e, "headers", None), "get")), None)
    value = headers.get("Retry-After") if headers is not None else None
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds())


def _is_client_error(exc: BaseException) -> bool:
    aiohttp = sys.modules.get("aiohttp")
    botocore = sys.modules.get("botocore.exceptions")
    return bool((aiohttp is not None and isinstance(exc, aiohttp.ClientError))
                or (botocore is not None and isinstance(exc, botocore.BotoCoreError))
                or type(exc).__name__ in ("HTTPException", "RemoteDisconnected", "ProtocolError"))


def _chain(exc: BaseException) -> list[BaseException]:
    out, seen = [], exc
    while seen is not None and len(out) < 6:
        out.append(seen)
        seen = seen.__cause__ or seen.__context__
    return out


__all__ = ["RedirectRefused", "classify", "status_of"]
