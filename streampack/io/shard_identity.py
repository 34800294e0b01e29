"""When is a shard "the same one": the ``identity`` option of resumes and manifest checks (the modes:
docs/reliability.md). ``digest`` hashes the size and the first and last 64 KiB: a same-size edit confined to the middle
is not seen, for 2 ranged reads more. A state saved under one kind and checked under another is refused naming the
option; index caches always use the strict one.

A Megatron shard is two files, named by its ``.idx``: its identity is the pair's (:func:`identity`: the two sizes
summed, the ``.idx``'s tag and ``|bin=<size>:<tag>`` of the ``.bin``; its digest hashes the edges of both), so a
``.bin`` rewritten with the same size beside an unchanged ``.idx`` is refused like any changed shard, naming the
``.bin``. It costs one more stat per check (and 2 more ranged reads under ``digest``).
"""

from __future__ import annotations

import hashlib
from typing import Any

from streampack.errors import DataError
from streampack.io import storage
from streampack.io.megatron import bin_url
from streampack.io.open import open_shard
from streampack.io.retry import IOStats
from streampack.io.storage import IDENTITY_MODES, OpenOptions, ShardStat
from streampack.io.urls import shard_format

DIGEST_PREFIX = "digest="
EDGE = 64 << 10
"""Bytes hashed at each end of a shard for ``identity="digest"``."""
PAIR_MARK = "|bin="
"""Where a Megatron shard's tag appends its ``.bin``'s size and tag."""


class ShardChanged(DataError):
    """A shard is not the one a resume state or a manifest recorded (reason ``shard_changed``): a
    refusal, never a skip (reading on would train a splice of two versions, or lose or repeat samples)."""


def _megatron_bin(url: str) -> str | None:
    """The ``.bin`` of a Megatron shard ``url``; None for a shard of one file."""
    try:
        if shard_format(url) != "megatron":
            return None
    except ValueError:  # not a shard URL streampack reads (a pipe: command): one file
        return None
    return bin_url(url)


def _files(url: str, opts: OpenOptions, stats: IOStats | None) -> list[tuple[str, ShardStat]]:
    """Each file of shard ``url`` with the store's identity of it (one stat each)."""
    files = [(url, storage.identity(url, opts, stats))]
    data = _megatron_bin(url)
    if data is not None:
        files.append((data, storage.identity(data, opts, stats)))
    return files


def _joined(files: list[tuple[str, ShardStat]]) -> ShardStat:
    if len(files) == 1:
        return files[0][1]
    (_, idx), (_, data) = files
    size = None if idx.size is None or data.size is None else idx.size + data.size
    return ShardStat(size=size, tag=f"{idx.tag}{PAIR_MARK}{data.size}:{data.tag}")


def identity(url: str, opts: OpenOptions, stats: IOStats | None = None) -> ShardStat:
    """The store's identity of shard ``url`` (size + ETag / mtime, :func:`streampack.io.storage.identity`); a
    Megatron pair's joins both files' (see the module docstring)."""
    return _joined(_files(url, opts, stats))


def _edges(h: Any, url: str, size: int | None, opts: OpenOptions, stats: IOStats | None) -> None:
    spans = [(0, EDGE if size is None else min(EDGE, size))]
    if size is not None and size > EDGE:
        spans.append((max(EDGE, size - EDGE), size))
    for start, end in spans:
        # with no size known, a range past the end would be a short body (retried): read to the end instead
        with open_shard(url, start, None if size is None else end, opts=opts, stats=stats) as f:
            h.update(f.read(end - start))


def _digest(files: list[tuple[str, ShardStat]], size: int | None, opts: OpenOptions, stats: IOStats | None) -> str:
    if files[0][0].startswith(("hf-dataset://", "hf-stream://")):  # a datasets object's rows: the URL names the object
        return DIGEST_PREFIX + hashlib.sha1(files[0][0].encode()).hexdigest()
    h = hashlib.sha1(f"{size}|".encode())
    for url, ident in files:
        _edges(h, url, size if len(files) == 1 else ident.size, opts, stats)
    return DIGEST_PREFIX + h.hexdigest()


def shard_digest(url: str, size: int | None, opts: OpenOptions, stats: IOStats | None = None) -> str:
    """``digest=<sha1 hex>`` of ``size`` and the first and last :data:`EDGE` bytes of ``url`` (the first
    bytes only when ``size`` is None); of a Megatron pair, of both files' edges (each stat'ed for its size)."""
    files = _files(url, opts, stats) if _megatron_bin(url) is not None else [(url, ShardStat(size=size, tag=""))]
    return _digest(files, size, opts, stats)


def current(url: str, opts: OpenOptions, stats: IOStats | None = None) -> ShardStat:
    """What ``opts.identity`` compares of ``url`` now: :func:`identity`, or with ``digest`` its size +
    :func:`shard_digest` as the tag."""
    files = _files(url, opts, stats)
    ident = _joined(files)
    if opts.identity == "digest":
        return ShardStat(size=ident.size, tag=_digest(files, ident.size, opts, stats))
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
                           f"{_which(url, saved, now)}{consequence}{hint(saved, now, mode)}", url=url)


def _which(url: str, saved: ShardStat, now: ShardStat) -> str:
    """Which file of a Megatron pair changed, as a message part ("" for a shard of one file)."""
    data = _megatron_bin(url)
    if data is None:
        return ""
    (idx_was, _, bin_was), (idx_now, _, bin_now) = saved.tag.partition(PAIR_MARK), now.tag.partition(PAIR_MARK)
    if bin_was and bin_now and idx_was == idx_now and bin_was != bin_now:
        return f"; its .bin {data!r} changed beside the same .idx"
    if bin_was and bin_now and bin_was == bin_now and idx_was != idx_now:
        return f"; its .idx changed beside the same .bin {data!r}"
    return f"; the pair is {url!r} + {data!r}"


__all__ = ["DIGEST_PREFIX", "EDGE", "IDENTITY_MODES", "PAIR_MARK", "ShardChanged", "changes", "check", "current",
           "hint", "identity", "shard_digest"]
