"""Shard URLs: what a user may write in ``urls`` (docs/storage.md) and what it expands to, once per dataset.

Each item is a local path, a directory (its shard files, sorted, recursive), a brace pattern (via ``braceexpand``), a
glob, or a URL of any fsspec filesystem; a pattern that matches nothing raises.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from braceexpand import braceexpand

from streampack.io import hf_dataset, hf_stream, storage
from streampack.io.arrow_ipc import data_files
from streampack.io.storage import OpenOptions, is_remote, local_path
from streampack.io.token_array import OFFSETS_SUFFIX

SHARD_SUFFIXES: dict[str, str] = {
    ".tar": "tar",
    ".jsonl": "jsonl", ".ndjson": "jsonl",
    ".jsonl.gz": "jsonl.gz", ".ndjson.gz": "jsonl.gz", ".json.gz": "jsonl.gz",
    ".jsonl.zst": "jsonl.zst", ".ndjson.zst": "jsonl.zst", ".json.zst": "jsonl.zst",
    ".parquet": "parquet",
    ".idx": "megatron",
    ".npy": "token_array", ".bin": "token_array",
    ".arrow": "arrow",
}
"""Suffix -> format. Compressed ``.json`` is JSON lines (Dolma's and RedPajama's convention); a Megatron-core indexed
data set (``prefix.idx`` + ``prefix.bin``) is named by its ``.idx`` (:mod:`streampack.io.megatron`), so a listing
skips a ``.bin`` with an ``.idx`` beside it; a flat token array is a ``.npy`` or ``.bin``
(:mod:`streampack.io.token_array`) and its offsets file (``.offsets.npy``) is never a shard; an ``.arrow`` file is an
Arrow IPC stream as Hugging Face ``datasets`` saves it (:mod:`streampack.io.arrow_ipc`), and a directory holding the
``state.json`` of ``save_to_disk`` expands to its ``.arrow`` files in that file's order."""
_BY_LENGTH = sorted(SHARD_SUFFIXES, key=len, reverse=True)


@dataclass(frozen=True, slots=True)
class ShardList:
    """Shard URLs expanded once, with their digest, so DataLoader workers neither expand nor hash again."""

    urls: tuple[str, ...]
    digest: str
    """sha1 of the URL list (16 hex): what a resume state is keyed on."""
    held: Any = field(default=None, compare=False, repr=False)
    """The ``datasets`` object the ``hf-dataset://`` / ``hf-stream://`` URLs name (:class:`~streampack.io.hf_dataset.Held`,
    :class:`~streampack.io.hf_stream.Stream`), carried with the list so a DataLoader worker has it; None for shards named
    by URL."""

    @classmethod
    def of(cls, urls: ShardList | str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
           opts: OpenOptions | None = None) -> ShardList:
        """``urls`` itself when already a ShardList, else its expansion (:func:`expand_urls`)."""
        if isinstance(urls, ShardList):
            return urls
        if hf_dataset.is_source_object(urls):
            found = hf_dataset.shards_of(urls) if hf_dataset.is_dataset(urls) else hf_stream.shards_of(urls)
            return cls(found.urls, list_digest(found.urls), held=found.held)
        expanded = tuple(expand_urls(urls, opts=opts))
        return cls(expanded, list_digest(expanded))

    def __len__(self) -> int:
        return len(self.urls)


def list_digest(urls: Sequence[str]) -> str:
    """sha1 (16 hex) of an expanded URL list: what a resume state is keyed on, and what ranks of one job agree on."""
    return hashlib.sha1("\n".join(urls).encode()).hexdigest()[:16]


def _suffix(url: str) -> str | None:
    path = url.split("?", 1)[0].split("#", 1)[0] if is_remote(url) else url
    if path.endswith(OFFSETS_SUFFIX):
        return None
    return next((s for s in _BY_LENGTH if path.endswith(s)), None)


def _shards_of(listing: list[str]) -> list[str]:
    """The shards of a listing: its shard files, less the companions of other shards."""
    return [u for u in _without_companions(listing) if _suffix(u) is not None]


def _without_companions(listing: list[str]) -> list[str]:
    """``listing`` less the files read through another: offsets files and the ``.bin`` of each Megatron pair."""
    names = set(listing)
    return [u for u in listing if not u.split("?", 1)[0].endswith(OFFSETS_SUFFIX) and not (
        u.split("?", 1)[0].endswith(".bin") and _sibling(u, ".idx") in names)]


def _sibling(url: str, suffix: str) -> str:
    path, sep, query = url.partition("?")
    return path[:-4] + suffix + sep + query


def shard_format(url: str) -> str:
    """``"tar"``, ``"jsonl"``, ``"jsonl.gz"``, ``"jsonl.zst"``, ``"parquet"``, ``"megatron"``, ``"token_array"`` or
    ``"arrow"`` from the URL's suffix (a remote URL's query string ignored), or ``"hf_dataset"`` / ``"hf_stream"`` for
    the rows of a ``datasets.Dataset`` / ``IterableDataset`` object (:mod:`streampack.io.hf_dataset`,
    :mod:`streampack.io.hf_stream`)."""
    if hf_dataset.is_object_url(url):
        return "hf_dataset"
    if hf_stream.is_stream_url(url):
        return "hf_stream"
    suffix = _suffix(url)
    if suffix is None and url.split("?", 1)[0].endswith(OFFSETS_SUFFIX):
        raise ValueError(f"{url!r} is the offsets file of a flat token array, not a shard: name the array beside it")
    if suffix is None:
        raise ValueError(f"cannot tell the format of shard {url!r}: want one of {sorted(SHARD_SUFFIXES)}")
    return SHARD_SUFFIXES[suffix]


def expand_urls(urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
                opts: OpenOptions | None = None) -> list[str]:
    """Shards, in order (see the module docstring); remote listings use ``opts``, which also says whether
    ``pipe:`` commands are accepted."""
    items = [urls] if isinstance(urls, (str, os.PathLike)) else list(urls)
    if not items:
        raise ValueError("no shard URLs given")
    opts = opts if opts is not None else OpenOptions()
    out: list[str] = []
    for item in items:
        item = os.fspath(item)
        if item.startswith("pipe:"):
            if not opts.allow_pipe:
                raise ValueError(f"refusing {item!r}: pipe: URLs run shell commands; "
                                 "pass allow_pipe=True to accept them")
            out.append(item)
            continue
        if hf_dataset.is_object_url(item) or hf_stream.is_stream_url(item):
            out.append(item)  # a datasets object's shard: read while this process holds the object
            continue
        for name in braceexpand(item):
            out.extend(_expand_remote(name, opts) if is_remote(name) else _expand_local(local_path(name)))
    for url in out:
        if not url.startswith("pipe:"):
            shard_format(url)
    return out


def _expand_remote(url: str, opts: OpenOptions) -> list[str]:
    path = url.split("?", 1)[0] if storage.protocol_of(url) in ("http", "https") else url
    pattern = "*" in path or "[" in path.split("://", 1)[1]
    if not pattern and not url.endswith("/") and _suffix(url) is not None:
        return [url]
    found = _shards_of(storage.find(url, opts, pattern=pattern))
    if not found:
        what = "glob" if pattern else "prefix"
        raise ValueError(f"{what} {url!r} matches no shard files ({sorted(SHARD_SUFFIXES)})")
    return found


def _expand_local(name: str) -> list[str]:
    if glob.has_magic(name):
        found = _without_companions(sorted(glob.glob(name)))
        if not found:
            raise ValueError(f"glob {name!r} matches no files")
        return found
    if _suffix(name) is not None:
        if name.endswith(".bin") and os.path.isfile(_sibling(name, ".idx")):
            raise ValueError(f"{name!r} is the .bin of a Megatron-core indexed data set, which is named by its .idx "
                             f"(the .bin beside it is read through it)")
        return [name]
    if os.path.isdir(name):
        saved = data_files(name)  # a datasets save_to_disk directory: its own order, not the names'
        if saved is not None:
            return saved
        found = _shards_of(sorted(os.path.join(root, f) for root, _, files in os.walk(name) for f in files))
        if not found:
            raise ValueError(f"directory {name!r} holds no shard files ({sorted(SHARD_SUFFIXES)})")
        return found
    if not os.path.splitext(os.path.basename(name))[1] and not os.path.exists(name):
        # a directory name (no suffix) that is not there: a typo, not a file of unknown format
        raise ValueError(f"{name!r} does not exist (not a shard file, a directory or a glob; "
                         f"shard files end in one of {sorted(SHARD_SUFFIXES)})")
    return [name]


def missing_local(urls: Sequence[str]) -> list[str]:
    """The local shards of ``urls`` that are not files (one ``os.stat`` each; remote URLs and
    ``pipe:`` commands are skipped)."""
    return [u for u in urls if not u.startswith("pipe:") and not is_remote(u) and not os.path.isfile(local_path(u))]


__all__ = ["SHARD_SUFFIXES", "ShardList", "expand_urls", "is_remote", "list_digest", "missing_local", "shard_format"]
