"""When is a shard "the same one": the ``identity`` option of resumes and manifest checks (the modes:
docs/reliability.md). ``digest`` hashes the size and the first and last 64 KiB: a same-size edit confined to the middle
is not seen, for 2 ranged reads more. A state saved under one kind and checked under another is refused naming the
option; index caches always use the strict one.
"""

from __future__ import annotations

import hashlib

from streampack.errors import DataError
from streampack.io import storage
from streampack.io.open import open_shard
from streampack.io.retry import IOStats
from streampack.io.storage import IDENTITY_MODES, OpenOptions, ShardStat

DIGEST_PREFIX = "digest="
EDGE = 64 << 10
"""Bytes hashed at each end of a shard for ``identity="digest"``."""


class ShardChanged(DataError):
    """A shard is not the one a resume state or a manifest recorded (reason ``shard_changed``): a
    refusal, never a skip (reading on would train a splice of two versions, or lose or repeat samples)."""


def shard_digest(url: str, size: int | None, opts: OpenOptions, stats: IOStats | None = None) -> str:
    """``digest=<sha1 hex>`` of ``size`` and the first and last :data:`EDGE` bytes of ``url`` (the first
    bytes only when ``size`` is None)."""
    if url.startswith(("hf-dataset://", "hf-stream://")):  # a datasets object's rows: the URL names the object
        return DIGEST_PREFIX + hashlib.sha1(url.encode()).hexdigest()
    spans = [(0, EDGE if size is None else min(EDGE, size))]
    if size is not None and size > EDGE:
        spans.append((max(EDGE, size - EDGE), size))
    h = hashlib.sha1(f"{size}|".encode())
    for start, end in spans:
        # with no size known, a range past the end would be a short body (retried): read to the end instead
        with open_shard(url, start, None if size is None else end, opts=opts, stats=stats) as f:
            h.update(f.read(end - start))
    return DIGEST_PREFIX + h.hexdigest()


def current(url: str, opts: OpenOptions, stats: IOStats | None = None) -> ShardStat:
    """What ``opts.identity`` compares of ``url`` now: the store's size + tag, or with
    ``digest`` its size + :func:`shard_digest` as the tag."""
    ident = storage.identity(url, opts, stats)
    if opts.identity == "digest":
        return ShardStat(size=ident.size, tag=shard_digest(url, ident.size, opts, stats))
    return ident


def changes(saved: ShardStat, now: ShardStat, mode: str) -> list[str]:
    """What differs between two identities under ``mode`` (empty: the same shard)."""
    if mode == "off":
        return []
    out = [f"size {saved.size!r} -> {now.size!r}"] if saved.size != now.size else []
    if mode != "size" and saved.tag != now.tag:
        out.append(f"{'digest' if mode == 'digest' else 'tag'} {saved.tag!r} -> {now.tag!r}")
    return out


def hint(saved: ShardStat, now: ShardStat, mode: str) -> str:
    """What to do about a refused identity: the option that compares what was recorded."""
    recorded_digest = saved.tag.startswith(DIGEST_PREFIX)
    if mode == "digest" and not recorded_digest:
        return ("; it was recorded with identity='tag' (no digest): if the shard was only re-staged "
                "(same bytes), pass identity='size'")
    if mode == "tag" and recorded_digest:
        return "; it was recorded with identity='digest': pass identity='digest'"
    if mode == "tag" and saved.size == now.size:
        return ("; if it was only re-staged (same bytes, new mtime / ETag), identity='size' or 'digest' "
                "accepts it (see streampack.io.shard_identity)")
    return ""


def check(url: str, saved: ShardStat, now: ShardStat, mode: str, *, since: str, prefix: str = "",
          consequence: str = "") -> None:
    """:class:`ShardChanged` naming ``url`` and what changed when ``now`` is not ``saved`` under ``mode``."""
    diff = changes(saved, now, mode)
    if diff:
        raise ShardChanged("shard_changed", f"{prefix}shard {url!r} changed since {since} ({'; '.join(diff)})"
                           f"{consequence}{hint(saved, now, mode)}", url=url)


__all__ = ["DIGEST_PREFIX", "EDGE", "IDENTITY_MODES", "ShardChanged", "changes", "check", "current",
           "hint", "shard_digest"]
