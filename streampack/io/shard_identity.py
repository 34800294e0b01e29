"""When is a shard "the same one": the ``identity`` option of resumes and manifest checks.

A resume state stores byte offsets into the shards it read, and a manifest the per-sample index
of each shard; both are right only for the bytes they were made from. ``OpenOptions.identity``
(``PackedDataset(identity=...)``) says what proves that a shard still holds those bytes:

==========  ===========================================  =====================================  ==================
identity    compares                                     a re-staged copy (``cp`` without       cost when a shard
                                                         ``-p``, a re-download, an S3 re-upload  is opened
                                                         with another part size: new ETag)
==========  ===========================================  =====================================  ==================
``tag``     size + ETag / generation / ``st_mtime_ns``   refused (the safe default)             1 stat / HEAD
``size``    size                                         accepted — and so is any same-size     1 stat / HEAD
                                                         rewrite: only sound for data that is
                                                         never edited in place
``digest``  size + SHA-1 of the first and last 64 KiB    accepted while those bytes are equal   1 stat / HEAD + 2
                                                                                                 ranged reads of
                                                                                                 ≤ 64 KiB
``off``     nothing                                      accepted, whatever changed             none
==========  ===========================================  =====================================  ==================

What ``digest`` proves: the shard has the same size and the same first and last 64 KiB (so a
shard of at most 128 KiB is compared whole). For the formats read here that pins the first
samples' and the last samples' boundaries and the end of archive; a same-size edit confined
to the middle of a larger shard is not seen. ``streampack index`` records the same digest in
the manifest, so a manifest check under ``digest`` accepts a re-staged copy too. A state saved
under one kind of identity and checked under another cannot be compared (a recorded mtime is
no digest) and is refused naming the option that would accept it.

Index cache files are always keyed on the strict identity (:func:`streampack.io.index.fingerprint_of`):
a re-staged shard re-scans its index (a cost), never reuses one made from other bytes.
"""

from __future__ import annotations

import hashlib

from streampack.errors import DataError
from streampack.io import storage
from streampack.io.retry import IOStats
from streampack.io.storage import OpenOptions, ShardStat, is_remote, local_path

IDENTITY_MODES = ("tag", "size", "digest", "off")
DIGEST_PREFIX = "digest="
EDGE = 64 << 10
"""Bytes hashed at each end of a shard for ``identity="digest"``."""


class ShardChanged(DataError):
    """A shard is not the one a resume state or a manifest recorded (reason ``shard_changed``).

    A refusal, never a skip: ``on_error="skip"`` drops bad samples, but reading on over a changed
    shard would train a splice of two versions, or lose or repeat samples. Its message names the
    shard and its old and new identity; putting the original bytes back makes the same resume
    succeed."""


def check_mode(mode: str) -> str:
    if mode not in IDENTITY_MODES:
        raise ValueError(f"identity={mode!r} must be one of {IDENTITY_MODES}")
    return mode


def shard_digest(url: str, size: int | None, opts: OpenOptions, stats: IOStats | None = None) -> str:
    """``digest=<sha1 hex>`` of ``size`` and the first and last :data:`EDGE` bytes of ``url``
    (two ranged reads remotely; none past the end). ``size`` None (an http server that gives
    no length) hashes the first bytes only."""
    spans = [(0, EDGE if size is None else min(EDGE, size))]
    if size is not None and size > EDGE:
        spans.append((max(EDGE, size - EDGE), size))
    h = hashlib.sha1(f"{size}|".encode())
    for start, end in spans:
        h.update(_read(url, start, end, opts, stats))
    return DIGEST_PREFIX + h.hexdigest()


def _read(url: str, start: int, end: int, opts: OpenOptions, stats: IOStats | None) -> bytes:
    if not is_remote(url):
        with open(local_path(url), "rb") as f:
            f.seek(start)
            return f.read(end - start)
    fs, path = storage.filesystem(url, opts)
    data = storage.call(lambda: fs.cat_file(path, start=start, end=end), url, opts, stats, what="digest read")
    return bytes(data[: end - start])  # a body never exceeds the range asked for


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


__all__ = ["DIGEST_PREFIX", "EDGE", "IDENTITY_MODES", "ShardChanged", "changes", "check", "check_mode", "current",
           "hint", "shard_digest"]
