"""Shard URLs: what a user may write in ``urls`` and what it expands to.

A path, a directory (its shard files, sorted, recursive), a brace pattern
(``train-{000000..000999}.tar``, expanded by the ``braceexpand`` package: nested braces and
steps such as ``f{1..9..2}`` included), a glob, an ``http(s)://`` or ``s3://`` URL, an
``s3://bucket/prefix/`` (its shard objects, sorted), or, if allowed, a ``pipe:`` command.
Expansion runs once per dataset, in the process that builds it; workers get the list.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass

from braceexpand import braceexpand

from streampack.io import s3
from streampack.io.retry import OpenOptions

SHARD_SUFFIXES: dict[str, str] = {".tar": "tar", ".jsonl": "jsonl", ".ndjson": "jsonl", ".jsonl.gz": "jsonl.gz"}


@dataclass(frozen=True, slots=True)
class ShardList:
    """Shard URLs expanded once (in the process that builds the dataset), with their digest.

    Pass one to a reader so DataLoader workers neither expand patterns again (a stat per URL per
    worker) nor hash the list on every ``state_dict()``.
    """

    urls: tuple[str, ...]
    digest: str
    """sha1 of the URL list (16 hex): what a resume state is keyed on."""

    @classmethod
    def of(cls, urls: ShardList | str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
           allow_pipe: bool = False) -> ShardList:
        """``urls`` itself when already a ShardList, else its expansion (:func:`expand_urls`)."""
        if isinstance(urls, ShardList):
            return urls
        expanded = tuple(expand_urls(urls, allow_pipe=allow_pipe))
        return cls(expanded, hashlib.sha1("\n".join(expanded).encode()).hexdigest()[:16])

    def __len__(self) -> int:
        return len(self.urls)


def is_remote(url: str) -> bool:
    return url.startswith(("http://", "https://", s3.S3_PREFIX))


def shard_format(url: str) -> str:
    """``"tar"``, ``"jsonl"`` or ``"jsonl.gz"`` from the URL's suffix (query string ignored)."""
    path = url.split("?", 1)[0].split("#", 1)[0]
    for suffix in sorted(SHARD_SUFFIXES, key=len, reverse=True):
        if path.endswith(suffix):
            return SHARD_SUFFIXES[suffix]
    raise ValueError(f"cannot tell the format of shard {url!r}: want one of {sorted(SHARD_SUFFIXES)}")


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


__all__ = ["SHARD_SUFFIXES", "ShardList", "expand_urls", "is_remote", "shard_format"]
