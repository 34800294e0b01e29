"""Per-shard sample index: where each sample starts, its key and token length, built once.

A reader needs it to split one shard between workers, and planners use ``lengths`` (-1 where unknown: text); resuming
does not. The first process that needs an index builds it under a lock in ``cache_dir``; the others wait, then load it.
It is used only while its fingerprint (the shard's strict identity, ``tokens_key``, :func:`limits_key`, the version)
matches. Planning uses the data set's manifest instead (:mod:`streampack.io.manifest`).

**Cost per shard** (:func:`load_or_build_index`): 1 stat / HEAD + 1 read of the index file, unless
it is one of the :data:`_MEMO_SIZE` = 4 used last; a miss adds one scan (tar: headers only, remote
by ranged reads; jsonl: once; parquet: footer and token column) and one write. Memory is 12 bytes
per sample plus the keys (4M jsonl lines: 73 MiB peak while building, ``benchmarks/bench_storage.py``).
A shard cut short is indexed up to the damage (``damage``), met and counted once by its last range.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from streampack.errors import DataError
from streampack.io import arrow_ipc, hf_dataset, hf_stream, megatron, parquet, shard_identity, storage, token_array
from streampack.io.compression import DECOMPRESS_ERRORS, text_stream
from streampack.io.decode import BAD_LENGTH, DecodeOptions, token_count
from streampack.io.index_cache import cache_path, load_arrays, locked, save_arrays
from streampack.io.jsonl import iter_lines
from streampack.io.limits import Limits
from streampack.io.open import open_shard
from streampack.io.retry import IOStats
from streampack.io.storage import OpenOptions, is_remote, local_path
from streampack.io.tar import TarRegion, group_length, iter_tar_units, split_key
from streampack.io.tar_sparse import SparseStream
from streampack.io.urls import shard_format

INDEX_VERSION = 5
_MEMO_SIZE = 4  # a worker reads one split shard at a time; a big shard's index is tens of MB
_memo: OrderedDict[tuple[str, str], ShardIndex] = OrderedDict()
_memo_lock = threading.Lock()


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ShardIndex:
    """Where each sample of one shard starts. Entry ``i`` describes the ``i``-th readable sample."""

    url: str
    fingerprint: str
    offsets: np.ndarray
    """int64 ``[n]``: position of each sample (tar: first header; jsonl: line start, in
    uncompressed bytes for .gz/.zst; parquet: row)."""
    lengths: np.ndarray
    """int32 (int64 past 2**31) ``[n]``: token count when cheap to know, else -1."""
    end: int
    """Position just past the last readable sample (tar: the end-of-archive block)."""
    damage: str = ""
    """Why reading stops at ``end`` ("" when the shard is whole)."""
    number_array: np.ndarray | None = None
    """int64 ``[n]`` sample numbers when they are not ``0..n-1`` (jsonl with blank lines)."""
    key_blob: bytes = b""
    """Tar keys, UTF-8, back to back (empty for jsonl / parquet: the key is the number)."""
    key_ends: np.ndarray | None = None
    batch_table: np.ndarray | None = None
    """:data:`~streampack.io.arrow_ipc.BATCH_DTYPE` ``[batches]`` of a ``.arrow`` stream file: where each record
    batch's message starts and its first row, so a range starting at row ``r`` reads the schema and then from the
    batch holding ``r`` (None for other formats)."""

    def __len__(self) -> int:
        return int(self.offsets.shape[0])

    @property
    def numbers(self) -> np.ndarray:
        """int64 ``[n]``: sample number (tar ordinal, jsonl line number, parquet row)."""
        return self.number_array if self.number_array is not None else np.arange(len(self), dtype=np.int64)

    def number(self, i: int) -> int:
        return int(self.number_array[i]) if self.number_array is not None else i

    def key(self, i: int) -> str:
        if self.key_ends is None:
            return str(self.number(i))
        start = int(self.key_ends[i - 1]) if i else 0
        return self.key_blob[start:int(self.key_ends[i])].decode("utf-8", "surrogateescape")

    @property
    def keys(self) -> list[str]:
        return [self.key(i) for i in range(len(self))]

    def part(self, part: int, parts: int) -> tuple[int, int | None, int]:
        """``(start, end, first)`` of contiguous part ``part`` of ``parts``: sample ``i`` belongs to part
        ``i * parts // len``. A damaged shard's last part reads past ``end`` (``end`` None) to meet the damage."""
        if not 0 <= part < parts:
            raise ValueError(f"{part=} must be in [0, {parts=})")
        n = len(self)
        lo, hi = -(-part * n // parts), -(-(part + 1) * n // parts)
        last = self.number(n - 1) + 1 if n else 0  # the number after the last sample
        start, first = (int(self.offsets[lo]), self.number(lo)) if lo < n else (self.end, last)
        end = None if (self.damage and part == parts - 1) else int(self.offsets[hi]) if hi < n else self.end
        return start, end, first


def index_decode(decode: DecodeOptions = DecodeOptions()) -> DecodeOptions:
    """The :class:`DecodeOptions` every index is built and looked up with (only what changes an
    index: the tokens field, the limits, a token array's layout, what a Megatron sample is), from one function so two call sites never key the
    same shard differently."""
    return DecodeOptions(tokens_key=decode.tokens_key, limits=decode.limits, eos_id=decode.eos_id,
                         token_dtype=decode.token_dtype, megatron_sample=decode.megatron_sample)


def limits_key(url: str, limits: Limits) -> str:
    """The limits an index of ``url``'s format depends on, as a fingerprint part (a limit it does
    not depend on does not invalidate it; parquet's ``lengths`` prefix marks indexes with token counts)."""
    return _limits_of(shard_format(url), limits)


def _limits_of(fmt: str, limits: Limits) -> str:
    if fmt == "parquet":
        return f"lengths,{limits.max_sample_bytes}"
    if fmt in ("megatron", "token_array", "arrow", "hf_dataset", "hf_stream"):
        return f"{limits.max_sample_bytes}"
    names = ("max_member_bytes", "max_sample_bytes", "max_json_depth") if fmt == "tar" else (
        "max_line_bytes", "max_json_depth")
    return ",".join(f"{getattr(limits, n)}" for n in names)


def unknown_lengths_hint(urls: Sequence[str]) -> str:
    """Why an index may lack some token counts of ``urls`` (for an error message)."""
    parquet = sum(shard_format(u) == "parquet" for u in urls)
    if parquet:
        return (f"{parquet} of {len(urls)} shard(s) are parquet: their rows have text to tokenize, no integer-list "
                f"token column, or a null token list, or the manifest was built before parquet indexes recorded "
                f"token counts (rebuild it with `streampack index`)")
    return "text to tokenize, or samples without the tokens field"


def index_settings(fmt: str, decode: DecodeOptions) -> str:
    """What an index of a shard of format ``fmt`` depends on besides the shard's bytes: the tokens field, the
    limits it reads under, and the layout of a token array or a Megatron sample; a manifest records it per format."""
    layout = (f"|eos={decode.eos_id},dtype={decode.token_dtype}" if fmt == "token_array" else
              f"|{decode.megatron_sample}" if fmt == "megatron" and decode.megatron_sample != "document" else "")
    return f"{decode.tokens_key}|{_limits_of(fmt, decode.limits)}{layout}"


def fingerprint_of(url: str, decode: DecodeOptions, ident: storage.ShardStat) -> str:
    """What a cached index must match: the shard's identity ``ident`` (always the strict one, size +
    ETag / mtime: a stale index would point into other bytes) and what the index depends on."""
    where = url if is_remote(url) else os.path.abspath(local_path(url))
    tag = ident.tag.removeprefix("mtime_ns=") if not is_remote(url) else ident.tag
    return f"v{INDEX_VERSION}|{index_settings(shard_format(url), decode)}|{where}|{ident.size}|{tag}"


def load_or_build_index(url: str, *, decode: DecodeOptions = DecodeOptions(), opts: OpenOptions = OpenOptions(),
                        cache_dir: str | None = None, stats: IOStats | None = None,
                        positions_only: bool = False) -> ShardIndex:
    """The cached index of ``url`` if still valid, else one built now under the lock and cached.
    ``positions_only``: a parquet index of its footer alone (cached apart), no token column read."""
    decode = index_decode(decode)
    ident = shard_identity.identity(url, opts, stats)
    rows = positions_only and shard_format(url) == "parquet"
    fp, size = fingerprint_of(url, decode, ident) + ("|rows" if rows else ""), ident.size
    path = cache_path(url, cache_dir)
    with _memo_lock:
        hit = _memo.get((path, fp))
    if hit is not None:
        return hit
    index = cached_index(path, fp, opts)
    if index is None:
        with locked(path):
            index = cached_index(path, fp, opts)  # built by another process while this one waited
            if index is None:
                index = build_index(url, fingerprint=fp, decode=decode, opts=opts, stats=stats, size=size,
                                    lengths=not rows)
                save_arrays(path, encode_index(index), opts)
    with _memo_lock:
        _memo[(path, fp)] = index
        while len(_memo) > _MEMO_SIZE:
            _memo.popitem(last=False)
    return index


def build_index(url: str, *, fingerprint: str = "", decode: DecodeOptions = DecodeOptions(),
                opts: OpenOptions = OpenOptions(), stats: IOStats | None = None, size: int | None = None,
                ranged: str = "auto", lengths: bool = True) -> ShardIndex:
    """Scan ``url`` once; a remote tar of known ``size`` by ranged requests where that skips enough
    (``ranged``). ``lengths`` False: a parquet index of row positions only."""
    fmt = shard_format(url)
    if fmt == "megatron":  # its .idx is the index: read whole and checked, the .bin only stat'ed
        lengths = megatron.document_lengths(url, decode, opts, stats)
        return ShardIndex(url=url, fingerprint=fingerprint, offsets=np.arange(len(lengths), dtype=np.int64),
                          lengths=lengths, end=len(lengths))
    if fmt == "token_array":  # one block-wise scan of the ids (or the offsets file read whole)
        positions, lengths, end = token_array.document_index(url, decode, opts, stats)
        return ShardIndex(url=url, fingerprint=fingerprint, offsets=positions, lengths=lengths, end=end)
    if fmt == "hf_stream":  # nothing to count without reading the whole stream
        raise ValueError(hf_stream.refusal(url))
    if fmt == "hf_dataset":  # the table's list offsets, through the indices mapping
        lengths = hf_dataset.token_lengths(url, decode)
        return ShardIndex(url=url, fingerprint=fingerprint, offsets=np.arange(len(lengths), dtype=np.int64),
                          lengths=lengths, end=len(lengths))
    if fmt == "arrow":  # one pass over the stream, reading only the token column's list offsets
        scan = arrow_ipc.index_scan(url, decode, opts, stats)
        return ShardIndex(url=url, fingerprint=fingerprint, offsets=np.arange(len(scan.lengths), dtype=np.int64),
                          lengths=scan.lengths, end=len(scan.lengths), damage=scan.damage,
                          batch_table=scan.batches)
    # a shard within one block is one request read whole: ranged reads cannot beat that
    sparse = fmt == "tar" and is_remote(url) and size is not None and (
        ranged == "always" or (ranged == "auto" and size > opts.block_size))
    raw = (io.BufferedReader(SparseStream(url, size, opts, stats, mode=ranged)) if sparse  # type: ignore[arg-type]
           else open_shard(url, 0, opts=opts, stats=stats))
    with raw:
        if fmt == "parquet":
            lengths = (parquet.token_lengths(raw, decode, url) if lengths
                       else np.full(parquet.parquet_file(raw, url).metadata.num_rows, -1, np.int32))
            return ShardIndex(url=url, fingerprint=fingerprint, offsets=np.arange(len(lengths), dtype=np.int64),
                              lengths=lengths, end=len(lengths))
        scan = _Scan()
        if fmt == "tar":
            scan.tar(raw, decode, url)
        else:
            scan.jsonl(text_stream(raw, url), decode, url)
    return scan.index(url, fingerprint)


class _Scan:
    """Index entries accumulated in compact buffers (never one Python object per sample)."""

    def __init__(self) -> None:
        self.offsets, self.lengths = array("q"), array("i")
        self.numbers: array | None = None  # only when they stop being 0..n-1
        self.keys, self.key_ends = bytearray(), array("q")
        self.end, self.damage = 0, ""

    def add(self, offset: int, number: int, length: int) -> None:
        n = len(self.offsets)
        if self.numbers is None and number != n:
            self.numbers = array("q", range(n))
        if self.numbers is not None:
            self.numbers.append(number)
        self.offsets.append(offset)
        self.lengths.append(min(length, 2**31 - 1))

    def tar(self, f: BinaryIO, decode: DecodeOptions, url: str) -> None:
        token_npy = ("npy", f"{decode.tokens_key}.npy")  # the reader's order (io.tar_decode)

        def want(name: str) -> int:
            field = (split_key(name) or ("", ""))[1]
            return 512 if field in token_npy else (-1 if field == "json" else 0)

        with self._damage_stops_the_scan():
            region_at = None  # where the corrupt region(s) before the next sample start
            for unit in iter_tar_units(f, url=url, start=0, end=None, want=want, seekable=True, limits=decode.limits):
                self.end = unit.next_offset
                if isinstance(unit, TarRegion):
                    # the sample after a region starts its entry at the region, so whichever
                    # reader gets that sample also meets the region (and judges the sample alike)
                    region_at = unit.region.start if region_at is None else region_at
                    if not unit.merged:
                        continue
                    group, length = unit.merged[0], -1  # samples the region broke: its reader reports them
                else:
                    group, length = unit, group_length(unit, decode, token_npy)
                self.add(group.offset if region_at is None else region_at, len(self.offsets), length)
                self.keys += group.key.encode("utf-8", "surrogateescape")
                self.key_ends.append(len(self.keys))
                region_at = None

    def jsonl(self, f: BinaryIO, decode: DecodeOptions, url: str) -> None:
        field = f'"{decode.tokens_key}"'.encode()
        with self._damage_stops_the_scan():
            for line in iter_lines(f, start=0, first_index=0, end=None, max_bytes=decode.limits.max_line_bytes):
                self.end = line.offset + line.size
                if line.data is None:  # over max_line_bytes: its reader reports it
                    self.add(line.offset, line.number, BAD_LENGTH)
                elif not line.data.isspace():
                    self.add(line.offset, line.number, token_count(line.data, decode) if field in line.data else -1)

    @contextlib.contextmanager
    def _damage_stops_the_scan(self) -> Iterator[None]:
        """Damage ends the index where it starts; failing to *read* (unreachable) is no index."""
        try:
            yield
        except DataError as e:
            if e.reason != "corrupt_shard":
                raise
            self.damage = str(e)
        except DECOMPRESS_ERRORS as e:
            self.damage = f"corrupt_shard: cannot decompress after uncompressed byte {self.end}: {e}"

    def index(self, url: str, fp: str) -> ShardIndex:
        """The entries as arrays that share the buffers (no copy: the scan is over)."""
        def arr(a: array, dtype: Any = np.int64) -> np.ndarray:
            return np.frombuffer(a, dtype=dtype) if len(a) else np.zeros(0, dtype)

        return ShardIndex(url=url, fingerprint=fp, offsets=arr(self.offsets), lengths=arr(self.lengths, np.int32),
                          end=self.end, damage=self.damage,
                          number_array=None if self.numbers is None else arr(self.numbers),
                          key_blob=bytes(self.keys), key_ends=arr(self.key_ends) if self.key_ends else None)


# ------------------------------------------------------------------ index <-> stored arrays


def encode_index(index: ShardIndex) -> dict[str, np.ndarray]:
    n = len(index)
    out = {"version": np.array(INDEX_VERSION), "url": np.array(index.url), "fingerprint": np.array(index.fingerprint),
           "end": np.array(index.end, dtype=np.int64), "damage": np.array(index.damage), "n": np.array(n)}
    if n and index.offsets[-1] != n - 1:  # increasing, so `last == n - 1` means 0..n-1: parquet rows
        out["offsets"] = index.offsets
    if index.number_array is not None:
        out["numbers"] = index.number_array
    if (index.lengths != -1).any():
        out["lengths"] = index.lengths
    if index.key_ends is not None:
        out["key_blob"] = np.frombuffer(index.key_blob, dtype=np.uint8)
        out["key_ends"] = index.key_ends
    if index.batch_table is not None:
        out["batches"] = index.batch_table
    return out


def decode_index(data: Any) -> ShardIndex:
    n = int(data["n"])
    return ShardIndex(url=str(data["url"]), fingerprint=str(data["fingerprint"]),
                      offsets=data["offsets"] if "offsets" in data else np.arange(n, dtype=np.int64),
                      lengths=data["lengths"] if "lengths" in data else np.full(n, -1, np.int32), end=int(data["end"]),
                      damage=str(data["damage"]), number_array=data["numbers"] if "numbers" in data else None,
                      key_blob=data["key_blob"].tobytes() if "key_blob" in data else b"",
                      key_ends=data["key_ends"] if "key_ends" in data else None,
                      batch_table=data["batches"] if "batches" in data else None)


def cached_index(path: str, fp: str, opts: OpenOptions) -> ShardIndex | None:
    data = load_arrays(path, opts)
    if data is None or int(data.get("version", -1)) != INDEX_VERSION or str(data.get("fingerprint")) != fp:
        return None  # absent, stale or from another version: rebuild
    return decode_index(data) if _whole(data) else None  # a damaged file is rebuilt (or named by the manifest)


def _whole(data: Mapping[str, np.ndarray]) -> bool:
    """Whether an index file's arrays fit together (a column one short would fail mid-epoch)."""
    try:
        n = int(data["n"])
        int(data["end"])
    except (KeyError, TypeError, ValueError):
        return False
    columns = [data[k] for k in ("offsets", "numbers", "lengths", "key_ends") if k in data]
    if n < 0 or any(c.ndim != 1 or c.dtype.kind not in "iu" or len(c) != n for c in columns):
        return False
    if ("key_ends" in data) != ("key_blob" in data):
        return False
    if "batches" in data and not _batches_fit(data["batches"], n):
        return False
    return "key_ends" not in data or (n == 0 and len(data["key_blob"]) == 0) or (
        n > 0 and int(data["key_ends"][-1]) == len(data["key_blob"]) and bool((np.diff(data["key_ends"]) >= 0).all()))


def _batches_fit(table: np.ndarray, n: int) -> bool:
    """Whether a stored batch table is one a range may seek by: rows from 0 and offsets both increasing, rows < n."""
    if table.dtype != arrow_ipc.BATCH_DTYPE or table.ndim != 1:
        return False
    rows, offsets = table["row"], table["offset"]
    return not len(table) or (int(rows[0]) == 0 and int(offsets[0]) > 0 and int(rows[-1]) < max(n, 1)
                              and bool((np.diff(rows) > 0).all()) and bool((np.diff(offsets) > 0).all()))


__all__ = ["INDEX_VERSION", "ShardIndex", "build_index", "cache_path", "cached_index", "decode_index", "encode_index",
           "fingerprint_of", "index_decode", "index_settings", "limits_key", "load_or_build_index", "unknown_lengths_hint"]
