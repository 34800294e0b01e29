"""Per-shard sample index: byte offset, key and token length of every sample, built once.

The reader needs it only to split one shard between several workers (fewer shards than
global workers) into contiguous byte ranges, so no worker reads another's bytes; planners use
``lengths`` (token counts, -1 where unknown: text samples). Resuming does *not* need it: the
reader records the next sample's offset while reading.

Build cost: a local tar is scanned header by header with ``seek`` over member data (only the
first 512 bytes of each ``.npy`` token member and whole ``.json`` members are read); jsonl and
remote shards are read once in full. The result is cached as json next to the shard
(``<shard>.spidx.json``), or under ``cache_dir`` when given or when the shard's directory is
not writable (default ``$STREAMPACK_CACHE`` or ``~/.cache/streampack``). A cached index is
used only if its fingerprint (path + size + mtime_ns, or URL + Content-Length + Last-Modified
+ ETag, + ``tokens_key`` + format version) still matches.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass

from streampack.errors import DataError
from streampack.io.decode import DecodeOptions
from streampack.io.jsonl import scan_jsonl, text_stream
from streampack.io.open import open_shard, remote_fingerprint
from streampack.io.retry import OpenOptions
from streampack.io.tar import scan_tar
from streampack.io.urls import is_remote, shard_format

INDEX_VERSION = 1
INDEX_SUFFIX = ".spidx.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardIndex:
    """Where each sample of one shard starts. ``i``-th entries describe the ``i``-th sample."""

    url: str
    fingerprint: str
    offsets: list[int]
    """Byte offset of each sample (first tar header; jsonl line start, uncompressed for .gz)."""
    numbers: list[int]
    """Sample number inside the shard: ordinal for tar, 0-based line number for jsonl."""
    keys: list[str]
    lengths: list[int]
    """Token count of each sample when cheap to know, else -1."""
    end: int
    """Offset just past the last sample (tar: the end-of-archive block)."""

    def __len__(self) -> int:
        return len(self.offsets)

    def position(self, i: int) -> tuple[int, int]:
        """``(offset, number)`` where sample ``i`` starts; ``i == len`` gives the end of the
        shard (``end``, one past the last number), so ``[position(i), position(j))`` is a range."""
        n = len(self)
        if not 0 <= i <= n:
            raise ValueError(f"sample position {i} is outside [0, {n}] of {self.url!r}")
        if i < n:
            return self.offsets[i], self.numbers[i]
        return self.end, (self.numbers[-1] + 1 if n else 0)

    def part(self, part: int, parts: int) -> tuple[int, int, int]:
        """``(start_offset, end_offset, first_number)`` of contiguous part ``part`` of ``parts``.

        Sample ``i`` belongs to part ``i * parts // len``; parts differ in size by at most one
        sample, and a part is empty (``start == end``) only if ``parts > len``.
        """
        if not 0 <= part < parts:
            raise ValueError(f"{part=} must be in [0, {parts=})")
        n = len(self)
        lo, hi = -(-part * n // parts), -(-(part + 1) * n // parts)
        start = self.offsets[lo] if lo < n else self.end
        end = self.offsets[hi] if hi < n else self.end
        first = self.numbers[lo] if lo < n else (self.numbers[-1] + 1 if n else 0)
        return start, end, first


def default_cache_dir() -> str:
    return os.environ.get("STREAMPACK_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "streampack")


def _fingerprint(url: str, decode: DecodeOptions, opts: OpenOptions) -> str:
    if is_remote(url):
        ident = f"{url}|{remote_fingerprint(url, opts)}"
    else:
        st = os.stat(url)
        ident = f"{os.path.abspath(url)}|{st.st_size}|{st.st_mtime_ns}"
    return f"v{INDEX_VERSION}|{decode.tokens_key}|{ident}"


def _candidates(url: str, cache_dir: str | None) -> list[str]:
    name = hashlib.sha1(url.encode()).hexdigest()[:16] + "-" + os.path.basename(url.split("?", 1)[0]) + INDEX_SUFFIX
    if cache_dir is not None:
        return [os.path.join(cache_dir, name)]
    beside = [] if is_remote(url) else [url + INDEX_SUFFIX]
    return [*beside, os.path.join(default_cache_dir(), name)]


def load_or_build_index(
    url: str, *, decode: DecodeOptions = DecodeOptions(), opts: OpenOptions = OpenOptions(), cache_dir: str | None = None
) -> ShardIndex:
    """The cached index of ``url`` if still valid, else a fresh one (then cached)."""
    if not is_remote(url) and not os.path.exists(url):
        raise DataError("missing_shard", "no such file", url=url, value=url)
    fingerprint = _fingerprint(url, decode, opts)
    paths = _candidates(url, cache_dir)
    for path in paths:
        index = _load(path, fingerprint)
        if index is not None:
            return index
    index = build_index(url, fingerprint=fingerprint, decode=decode, opts=opts)
    for path in paths:
        if _save(path, index):
            break
    return index


def build_index(url: str, *, fingerprint: str = "", decode: DecodeOptions = DecodeOptions(), opts: OpenOptions = OpenOptions()) -> ShardIndex:
    fmt = shard_format(url)
    with open_shard(url, 0, opts=opts) as raw:
        if fmt == "tar":
            offsets, keys, lengths, end = scan_tar(raw, decode, url=url, seekable=not is_remote(url))
            numbers = list(range(len(offsets)))
        else:
            offsets, numbers, lengths, end = scan_jsonl(text_stream(raw, url), decode, url=url)
            keys = [str(n) for n in numbers]
    return ShardIndex(url=url, fingerprint=fingerprint, offsets=offsets, numbers=numbers, keys=keys, lengths=lengths, end=end)


def _load(path: str, fingerprint: str) -> ShardIndex | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if data.get("fingerprint") != fingerprint:
            return None
        return ShardIndex(**data)
    except (OSError, ValueError, TypeError):
        return None


def _save(path: str, index: ShardIndex) -> bool:
    """Atomically write ``index`` to ``path``; False when the directory is not writable."""
    directory = os.path.dirname(path) or "."
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".spidx-", suffix=".tmp")
    except OSError:
        return False
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(asdict(index), f)
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False
