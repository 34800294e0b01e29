"""Where shards live: one fsspec filesystem per (process, protocol, options), built with streampack's timeouts and
redirect policy under the user's ``storage_options``, and the few store calls (stat, listing) made under the retry
policy (docs/storage.md).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from streampack.errors import DataError
from streampack.io.failures import RedirectRefused, classify
from streampack.io.retry import IOStats, RetryPolicy, with_retries

ENDPOINT_ENV = "STREAMPACK_S3_ENDPOINT"
IDENTITY_MODES = ("tag", "size", "digest", "off")
"""What ``OpenOptions.identity`` may be (:mod:`streampack.io.shard_identity`)."""
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure",
          "adl": "azure", "hf": "hf"}
"""``pip install 'streampack[extra]'`` that brings each protocol's fsspec package."""

_FILESYSTEMS: dict[tuple[Any, ...], Any] = {}
_FS_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenOptions:
    """How shards are fetched; one value passed from the reader to the I/O layer. None of it
    changes which samples are read, so none of it is in a resume fingerprint."""

    retry: RetryPolicy = field(default_factory=RetryPolicy)
    connect_timeout: float = 10.0
    """Seconds to open a connection (http(s), s3)."""
    read_timeout: float = 30.0
    """Seconds without a single byte arriving (http(s), s3)."""
    request_deadline: float = 120.0
    """Seconds one request may take in all (each read block is one request; async stores)."""
    allow_redirects: bool = False
    """Follow http(s) redirects to another host (same-host redirects are always followed)."""
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    """fsspec options: flat (given to every remote filesystem), or ``{protocol: {...}}`` when
    every key is a protocol name, e.g. ``{"s3": {"anon": True}, "hf": {"token": "..."}}``."""
    block_size: int = 8 << 20
    """Bytes per remote read request (one more block is prefetched while one is parsed)."""
    allow_pipe: bool = False
    """Accept ``pipe:`` URLs (runs a shell command)."""
    identity: str = "tag"
    """What proves a shard unchanged on resume and against a manifest: ``tag`` (size + ETag /
    mtime), ``size``, ``digest`` or ``off`` (:mod:`streampack.io.shard_identity`)."""

    def __post_init__(self) -> None:
        if self.identity not in IDENTITY_MODES:
            raise ValueError(f"identity={self.identity!r} must be one of {IDENTITY_MODES}")
        for name in ("connect_timeout", "read_timeout", "request_deadline"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}={value!r} must be a number > 0 (seconds)")
        if not isinstance(self.storage_options, Mapping):
            raise TypeError(f"storage_options must be a mapping, got {type(self.storage_options).__name__}")
        if self.block_size < 4096:
            raise ValueError(f"block_size={self.block_size} must be >= 4096")

    def options_for(self, protocol: str) -> dict[str, Any]:
        """The user's storage options for ``protocol`` (see ``storage_options``)."""
        opts = dict(self.storage_options)
        if opts and all(isinstance(v, Mapping) for v in opts.values()) and set(opts) <= _known_protocols():
            aliases = {protocol, *_aliases(protocol)}
            return dict(next((opts[p] for p in opts if p in aliases), {}))
        return opts


@dataclass(frozen=True, slots=True)
class ShardStat:
    """What a store says about one object."""

    size: int | None
    """Bytes, or None when the store does not say (an http server without Content-Length)."""
    tag: str
    """ETag / mtime / blob id where the store has one (changes when the object does)."""


IN_PROCESS: dict[str, Callable[[str], ShardStat]] = {}
"""URL scheme -> the identity of a shard held by this process (a ``datasets`` object's rows), registered by the module
that reads them (:mod:`streampack.io.hf_dataset`, :mod:`streampack.io.hf_stream`)."""


def protocol_of(url: str) -> str | None:
    """``"s3"`` for ``s3://b/k``; None for a local path (``file://`` included)."""
    head, sep, _ = url.partition("://")
    if not sep or head in ("file", "local") or not head.replace("+", "").replace("-", "").isalnum():
        return None
    return head.lower()


def is_remote(url: str) -> bool:
    return protocol_of(url) is not None


def local_path(url: str) -> str:
    """A local path or ``file://`` URL as a path."""
    return url[len("file://"):] if url.startswith("file://") else url


def filesystem(url: str, opts: OpenOptions) -> tuple[Any, str]:
    """``(fs, path)`` for a remote ``url``: one filesystem per (process, protocol, options)."""
    protocol = protocol_of(url)
    assert protocol is not None, url
    user = opts.options_for(protocol)
    env = tuple(os.environ.get(k) for k in (ENDPOINT_ENV, "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"))
    key = (os.getpid(), _aliases(protocol)[0], repr(sorted(user.items())), opts.connect_timeout,
           opts.read_timeout, opts.allow_redirects, env)
    with _FS_LOCK:
        fs = _FILESYSTEMS.get(key)
        if fs is None:
            fs = _FILESYSTEMS[key] = _new_filesystem(protocol, user, opts)
    return fs, fs._strip_protocol(url)


def _new_filesystem(protocol: str, user: dict[str, Any], opts: OpenOptions) -> Any:
    import fsspec

    kwargs: dict[str, Any] = {"skip_instance_cache": True}
    if protocol in ("http", "https"):
        kwargs["client_kwargs"] = {**_http_client_kwargs(opts), **user.pop("client_kwargs", {})}
    elif protocol in ("s3", "s3a"):
        kwargs.update(_s3_kwargs(opts, user.pop("config_kwargs", {})))
    try:
        fs = fsspec.filesystem(protocol, **{**kwargs, **user})
    except ImportError as e:
        extra = EXTRAS.get(protocol)
        hint = f": pip install 'streampack[{extra}]'" if extra else ""
        raise ImportError(f"{protocol}:// URLs need fsspec's {protocol} backend{hint} ({e})") from None
    except ValueError as e:
        if "Protocol not known" in str(e):
            raise ValueError(f"unknown URL protocol {protocol!r}: {e}") from None
        raise
    if protocol in ("s3", "s3a"):
        fs.retries = 1  # one attempt per call: the one retry policy decides (s3fs's is a class attribute)
    return fs


def _http_client_kwargs(opts: OpenOptions) -> dict[str, Any]:
    import aiohttp

    trace = aiohttp.TraceConfig()
    if not opts.allow_redirects:
        trace.on_request_redirect.append(_refuse_cross_host)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=opts.connect_timeout, sock_read=opts.read_timeout)
    return {"timeout": timeout, "trace_configs": [trace]}


async def _refuse_cross_host(session: Any, ctx: Any, params: Any) -> None:
    import yarl

    target = params.url.join(yarl.URL(params.response.headers.get("Location", "")))
    if target.host and params.url.host and target.host.lower() != params.url.host.lower():
        params.response.close()
        raise RedirectRefused(f"redirect from {params.url} to another host ({target}); "
                              f"pass allow_redirects=True to follow it")


def _s3_kwargs(opts: OpenOptions, user_config: Mapping[str, Any]) -> dict[str, Any]:
    endpoint = os.environ.get(ENDPOINT_ENV) or None
    custom = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    config = {"connect_timeout": opts.connect_timeout, "read_timeout": opts.read_timeout,
              "retries": {"total_max_attempts": 1}, **({"s3": {"addressing_style": "path"}} if custom else {}),
              **user_config}
    return {"config_kwargs": config, **({"endpoint_url": endpoint} if endpoint else {})}


def _aliases(protocol: str) -> tuple[str, ...]:
    """Names of the same filesystem, the canonical one first."""
    for group in (("http", "https"), ("s3", "s3a"), ("gs", "gcs"), ("abfs", "az", "abfss")):
        if protocol in group:
            return group
    return (protocol,)


def _known_protocols() -> set[str]:
    import fsspec

    return set(fsspec.available_protocols()) | {"http", "https", "s3", "gs", "gcs", "az", "abfs", "hf", "memory"}


def deadline(fs: Any, opts: OpenOptions) -> dict[str, Any]:
    """``{"timeout": request_deadline}`` for an async filesystem's sync calls (fsspec cancels
    the request when it runs out), ``{}`` for a sync one (its own timeouts apply)."""
    from fsspec.asyn import AsyncFileSystem

    return {"timeout": opts.request_deadline} if isinstance(fs, AsyncFileSystem) else {}


def is_http(url: str) -> bool:
    return protocol_of(url) in ("http", "https")


def call(fn: Any, url: str, opts: OpenOptions, stats: IOStats | None, *, what: str) -> Any:
    """``fn()`` (one request to ``url``'s store) under the retry policy."""
    def attempt() -> Any:
        if stats is not None:
            stats.count(requests=1)
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - sorted by classify; non-I/O errors re-raised as is
            failure = classify(e, url)
            if failure is e:
                raise
            raise failure from None

    return with_retries(attempt, url=url, policy=opts.retry, stats=stats, what=what)


def stat(url: str, opts: OpenOptions, stats: IOStats | None = None) -> ShardStat:
    """Size and identity tag of a remote object (one ``HEAD`` or equivalent, retried)."""
    fs, path = filesystem(url, opts)
    if is_http(url):
        from streampack.io.http import head

        info = call(lambda: head(fs, path, opts.request_deadline), url, opts, stats, what="stat")
    else:
        info = call(lambda: fs.info(path, **deadline(fs, opts)), url, opts, stats, what="stat")
    size = info.get("size")
    tag = next((str(info[k]) for k in ("ETag", "etag", "LastModified", "Last-Modified", "mtime", "updated",
                                       "last_commit", "blob_id", "md5", "created") if info.get(k)), "")
    return ShardStat(size=None if size is None else int(size), tag=tag)


def identity(url: str, opts: OpenOptions, stats: IOStats | None = None) -> ShardStat:
    """What identifies a shard's current contents: its size and the store's tag (ETag / mtime
    / blob id) for a remote object, its size and ``st_mtime_ns`` for a local file."""
    held = IN_PROCESS.get(url.partition("://")[0] + "://")
    if held is not None:
        return held(url)
    if is_remote(url):
        return stat(url, opts, stats)
    try:
        st = os.stat(local_path(url))
    except OSError as e:
        raise DataError("missing_shard", f"cannot stat: {e.strerror}", url=url, value=url) from None
    return ShardStat(size=st.st_size, tag=f"mtime_ns={st.st_mtime_ns}")


def find(url: str, opts: OpenOptions, *, pattern: bool) -> list[str]:
    """Every object under a remote prefix / directory (``pattern=False``) or matching a glob, as full URLs, sorted."""
    fs, path = filesystem(url, opts)
    if pattern:
        found = call(lambda: fs.glob(path, **deadline(fs, opts)), url, opts, None, what="glob")
    else:
        found = call(lambda: fs.find(path.rstrip("/"), **deadline(fs, opts)), url, opts, None, what="listing")
    return sorted(fs.unstrip_protocol(p) if "://" not in p else p for p in found)


__all__ = ["ENDPOINT_ENV", "IDENTITY_MODES", "OpenOptions", "ShardStat", "call", "deadline", "filesystem", "find",
           "identity", "is_http", "is_remote", "local_path", "protocol_of", "stat"]
