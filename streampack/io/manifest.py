"""One data-set manifest: every shard's identity and totals, read once, so a reader pays only for its share.

A manifest lives in a directory (local or any fsspec URL), written by ``streampack index``::

    <location>/manifest.spm.npz     per shard: URL, size, tag (ETag / generation / mtime), samples,
                                    token total (-1 when any length is unknown), byte cost
    <location>/shards/<h>-<name>.spidx.npz   per shard: the sample index (offsets, keys, lengths)

Planning an epoch needs only the per-shard totals; a reader then fetches the sample index of the
shards it reads and of the few its boundaries fall in. The manifest is also the shards' identity
for resume checks, so a start makes no per-shard HEAD: a changed shard is found when it is opened.

**Cost per reader** (N shards, G readers, T samples): 1 request per rank to load the manifest (workers get it with the
dataset), ``≈ 122 B × N`` held per process and ``≈ 420 B × N`` at the load's peak
(``benchmarks/bench_manifest_memory.py``); O(N/G + 4) requests and O(T/G) memory for the sample indexes. A resume
compares :meth:`Manifest.fingerprint` (O(N) CPU once per process, 0.46 µs × N, ``benchmarks/bench_resume_check.py``) and
reads the copy kept under ``history/<fingerprint>`` only to name the changed shards when it refuses. The file is ``≈ 70
B × N``, loaded in ``≈ 3.6 µs × N`` (``benchmarks/bench_index.py``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from streampack.io import shard_identity
from streampack.io.decode import DecodeOptions
from streampack.io.index import (
    ShardIndex,
    build_index,
    cache_path,
    cached_index,
    encode_index,
    fingerprint_of,
    index_decode,
    index_settings,
    limits_key,
)
from streampack.io.index_cache import DamagedFile, index_dir, join_path, locked, read_arrays, save_arrays
from streampack.io.limits import Limits
from streampack.io.manifest_file import LIMITS, StringColumn, checked_fields
from streampack.io.retry import IOStats
from streampack.io.storage import OpenOptions, ShardStat, is_remote
from streampack.io.urls import shard_format

MANIFEST_VERSION = 4  # 2: digests and limits recorded; 4: the index settings of each format
MANIFEST_FILE = "manifest.spm.npz"
SHARDS_DIR = "shards"
HISTORY_DIR = "history"
HISTORY_SUFFIX = ".spm.npz"
HISTORY_KEEP = 8
"""Copies of earlier manifests kept in a local cache (each ~70 B per shard)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardTotals:
    """What the manifest keeps of one shard."""

    url: str
    size: int
    """Bytes (-1 when the store does not say)."""
    tag: str
    """ETag / generation / ``mtime_ns=...``: changes when the object does."""
    samples: int
    tokens: int
    """Sum of the samples' token counts; -1 when any sample's count is unknown (text)."""
    byte_cost: int
    """Sum of the samples' byte sizes (each at least 1): the balancing cost without token counts."""
    digest: str = ""
    """``digest=<sha1>`` of the size and first / last 64 KiB (:mod:`streampack.io.shard_identity`)."""
    damage: str = ""
    """Why the index stops early ("" for a whole shard); reported, not stored."""

    @classmethod
    def of(cls, index: ShardIndex, ident: ShardStat, digest: str = "") -> ShardTotals:
        lengths = np.asarray(index.lengths, dtype=np.int64)
        nxt = np.append(index.offsets[1:], index.end).astype(np.int64)
        return cls(url=index.url, size=-1 if ident.size is None else int(ident.size), tag=ident.tag,
                   samples=len(index), tokens=int(lengths[lengths > 0].sum()) if not (lengths == -1).any() else -1,
                   byte_cost=int(np.maximum(nxt - index.offsets, 1).sum()) if len(index) else 0,
                   digest=digest, damage=index.damage)


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardChange:
    """A shard that is not what another manifest of the same shards recorded."""

    shard: int
    url: str
    old: ShardStat
    """Its identity in the other (older) manifest, as the mode compares it."""
    new: ShardStat
    samples: tuple[int, int]
    """Its sample count in the older manifest and in this one."""

    def describe(self, mode: str) -> str:
        diff = shard_identity.changes(self.old, self.new, mode if mode != "off" else "size")
        if self.samples[0] != self.samples[1]:
            diff.append(f"samples {self.samples[0]} -> {self.samples[1]}")
        return f"shard {self.url!r} ({'; '.join(diff) or 'token totals'})"


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Manifest:
    """Every shard of a data set, in URL-list order, as parallel arrays (strings as
    :class:`~streampack.io.manifest_file.StringColumn`; sequences given are converted)."""

    location: str
    tokens_key: str
    urls: StringColumn
    sizes: np.ndarray
    """int64 ``[N]``."""
    tags: StringColumn
    samples: np.ndarray
    """int64 ``[N]``."""
    tokens: np.ndarray
    """int64 ``[N]``; -1 where a shard has samples of unknown length."""
    byte_costs: np.ndarray
    """int64 ``[N]``."""
    digests: StringColumn = field(default_factory=lambda: StringColumn.of(()))
    """Per shard ``digest=<sha1>`` (what ``identity="digest"`` compares); empty when not recorded."""
    limits: Limits = Limits()
    """The limits the index files were built under (an over-limit sample is indexed as -1)."""
    settings: str = ""
    """``fmt=<index_settings>`` of each format the data set holds, one per line: what its counts were made with."""
    _prints: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    """:meth:`fingerprint` by mode, computed once (a reader's state names it at every batch)."""

    def __post_init__(self) -> None:
        for name in ("urls", "tags", "digests"):
            if not isinstance(getattr(self, name), StringColumn):
                object.__setattr__(self, name, StringColumn.of(getattr(self, name)))
        for name in ("sizes", "samples", "tokens", "byte_costs"):
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.int64).reshape(-1))
        n = len(self.urls)
        wrong = {name: len(getattr(self, name)) for name in ("tags", "sizes", "samples", "tokens", "byte_costs",
                                                             "digests") if len(getattr(self, name)) != n}
        if wrong.get("digests") == 0:  # no digests at all: recorded by none
            del wrong["digests"]
        if wrong:
            raise ValueError(f"the manifest at {self.location!r} lists {n} URLs but other column lengths {wrong}")

    def __len__(self) -> int:
        return len(self.urls)

    @classmethod
    def of(cls, location: str, totals: Sequence[ShardTotals], decode: DecodeOptions = DecodeOptions()) -> Manifest:
        def col(name: str) -> np.ndarray:
            return np.asarray([getattr(t, name) for t in totals], dtype=np.int64).reshape(-1)

        formats = sorted({shard_format(t.url) for t in totals})
        return cls(location=location, tokens_key=decode.tokens_key, urls=tuple(t.url for t in totals),
                   sizes=col("size"), tags=tuple(t.tag for t in totals), samples=col("samples"), tokens=col("tokens"),
                   byte_costs=col("byte_cost"), digests=tuple(t.digest for t in totals), limits=decode.limits,
                   settings="\n".join(f"{f}={index_settings(f, decode)}" for f in formats))

    def check_settings(self, decode: DecodeOptions) -> None:
        """``ValueError`` unless this run reads every format of the data set as its indexes were made (the tokens
        field, the limits, a token array's EOS id and dtype, what a Megatron sample is): the sample counts a plan
        divides come from them, and a reader that never loads an index would not notice the difference."""
        built = dict(line.split("=", 1) for line in self.settings.splitlines())
        differ = {f: (made, index_settings(f, decode)) for f, made in built.items()
                  if made != index_settings(f, decode)}
        if differ:
            f, (made, asked) = next(iter(differ.items()))
            raise ValueError(f"the manifest at {self.location!r} indexed its {f} shards with {made!r}, this run "
                             f"reads them with {asked!r} (tokens field|limits|layout): rebuild it with `streampack "
                             f"index` and the same --tokens-key / --max-* / --eos-id / --token-dtype / "
                             f"--megatron-sample, or read as it was built")

    def known_lengths(self) -> bool:
        """Whether every sample's token count is known (what counting batches needs)."""
        return bool((self.tokens >= 0).all())

    def costs(self, *, tokens: bool) -> np.ndarray:
        """int64 ``[N]``: each shard's balancing cost (token total, or byte cost)."""
        return self.tokens if tokens else self.byte_costs

    def identity(self, shard: int) -> ShardStat:
        size = int(self.sizes[shard])
        return ShardStat(size=None if size < 0 else size, tag=self.tags[shard])

    def recorded(self, shard: int, mode: str = "tag") -> ShardStat:
        """The identity the manifest indexed shard ``shard`` with, as ``mode`` compares it (its
        digest in the tag's place under ``"digest"``)."""
        indexed = self.identity(shard)
        if mode != "digest":
            return indexed
        if not (self.digests and self.digests[shard]):
            raise ValueError(f"the manifest at {self.location!r} records no digest of shard "
                             f"{self.urls[shard]!r}: rebuild it with `streampack index`, or pass identity='tag'")
        return ShardStat(size=indexed.size, tag=self.digests[shard])

    def check_identity(self, shard: int, now: ShardStat, mode: str = "tag") -> None:
        """:class:`~streampack.io.shard_identity.ShardChanged` (a ``ValueError``) when ``now``, the
        identity the reader found opening shard ``shard``, is not what the manifest indexed, compared as
        ``mode`` says. No request: a stale manifest is found lazily, never by a HEAD per shard at start."""
        shard_identity.check(self.urls[shard], self.recorded(shard, mode), now, mode,
                             since=f"the manifest at {self.location!r} indexed it",
                             prefix="stale manifest: ",
                             consequence="; its index and the epoch plan point into the old contents: put the "
                                         "original back, or rebuild the manifest with `streampack index` and "
                                         "start afresh (a resume over other contents cannot be exact)")

    def fingerprint(self, mode: str) -> str:
        """16 hex digits of SHA-1 over what an epoch plan and ``mode`` see of every shard: its counts,
        size, and tag (``"tag"``), digest (``"digest"``) or both (``"all"``: the history copy's key).
        Equal fingerprints mean every position saved under the other manifest is still right. O(N) CPU."""
        if mode not in self._prints:
            per_mode = {"tag": ["tags"], "digest": ["digests"], "all": ["tags", "digests"]}
            parts = ["counts", "sizes", *per_mode.get(mode, [])]
            self._prints[mode] = hashlib.sha1("|".join([mode, str(len(self.urls)), *map(self._part, parts)])
                                              .encode()).hexdigest()[:16]
        return self._prints[mode]

    def _part(self, name: str) -> str:
        """SHA-1 of one group of columns, computed once (the four fingerprints share them)."""
        key = f"part:{name}"
        if key not in self._prints:
            digest = hashlib.sha1()
            if name == "counts":
                for column in (self.samples, self.tokens, self.byte_costs):
                    digest.update(np.ascontiguousarray(column, dtype=np.int64))
            elif name == "sizes":
                digest.update(np.ascontiguousarray(self.sizes, dtype=np.int64))
            else:
                getattr(self, name).hash_into(digest, b"\n")
            self._prints[key] = digest.hexdigest()
        return self._prints[key]

    def changes_since(self, old: Manifest, mode: str) -> list[ShardChange]:
        """The shards whose identity under ``mode`` or whose totals differ in ``old`` (the same URL
        list), in shard order; run only once a fingerprint differs."""
        n = min(len(self), len(old))
        differ = np.zeros(n, dtype=bool)
        for column in ("samples", "tokens", "byte_costs", "sizes"):
            differ |= np.asarray(getattr(self, column))[:n] != np.asarray(getattr(old, column))[:n]
        names = {"tag": "tags", "digest": "digests"}
        if mode in names:
            mine, theirs = getattr(self, names[mode]), getattr(old, names[mode])
            differ |= np.fromiter((mine[i] != theirs[i] if i < len(mine) and i < len(theirs) else False
                                   for i in range(n)), dtype=bool, count=n)
        return [ShardChange(shard=int(i), url=self.urls[i], old=old._seen(int(i), mode), new=self._seen(int(i), mode),
                            samples=(int(old.samples[i]), int(self.samples[i]))) for i in np.flatnonzero(differ)]

    def _seen(self, shard: int, mode: str) -> ShardStat:
        has_digest = mode == "digest" and shard < len(self.digests) and self.digests[shard]
        return self.recorded(shard, "digest") if has_digest else self.identity(shard)

    def check_urls(self, urls: Sequence[str]) -> None:
        """``ValueError`` unless the manifest lists exactly ``urls``, in that order."""
        if self.urls == urls:
            return
        listed = set(self.urls)  # once: inside the comprehension it was rebuilt per URL (N^2 at 10^5)
        missing = [u for u in urls if u not in listed]
        raise ValueError(f"the manifest at {self.location!r} lists {len(self.urls)} shards, the data set "
                         f"{len(urls)}; " + (f"not in it: {missing[:3]} ({len(missing)} in all)" if missing else
                                              "the order differs") + ": rebuild it with `streampack index`")

    def load_index(self, shard: int, decode: DecodeOptions, opts: OpenOptions) -> ShardIndex:
        """Shard ``shard``'s sample index: one read of its index file, checked against the
        manifest's identity of the shard (no request to the shard itself)."""
        url = self.urls[shard]
        decode = index_decode(decode)
        path = cache_path(url, join_path(self.location, SHARDS_DIR))
        index = cached_index(path, fingerprint_of(url, decode, self.identity(shard)), opts)
        if index is None:
            asked, built = (decode.tokens_key, limits_key(url, decode.limits)), \
                (self.tokens_key, limits_key(url, self.limits))
            why = (f"indexed with tokens_key / limits {built}, this run reads {asked}" if asked != built
                   else "its index file is missing or damaged")
            raise ValueError(f"the manifest at {self.location!r} has no valid index of shard {url!r} ({why}): "
                             f"rebuild it with `streampack index` and the same --tokens-key / --max-* limits")
        return index


def build_entry(url: str, location: str, decode: DecodeOptions, opts: OpenOptions,
                stats: IOStats | None = None, ranged: str = "auto") -> ShardTotals:
    """Index one shard into ``location`` and return its totals; an index file already there for this
    shard's identity and settings is kept (``streampack index`` resumes)."""
    decode = index_decode(decode)
    ident = shard_identity.identity(url, opts, stats)
    fp = fingerprint_of(url, decode, ident)
    path = cache_path(url, join_path(location, SHARDS_DIR))
    index = cached_index(path, fp, opts)
    if index is None:
        index = build_index(url, fingerprint=fp, decode=decode, opts=opts, stats=stats, size=ident.size, ranged=ranged)
        if not save_arrays(path, encode_index(index), opts):
            raise OSError(f"cannot write the index of {url!r} to {path!r}")
    return ShardTotals.of(index, ident, shard_identity.shard_digest(url, ident.size, opts, stats))


def build_manifest(urls: Sequence[str], location: str, *, decode: DecodeOptions = DecodeOptions(),
                   opts: OpenOptions = OpenOptions(), stats: IOStats | None = None,
                   each: Callable[[Callable[[str], ShardTotals], Sequence[str]], Sequence[ShardTotals]] | None = None,
                   ranged: str = "auto") -> Manifest:
    """Index every shard of ``urls`` into ``location`` and write the manifest there. ``each(function,
    urls)`` maps the per-shard work (default: in order; the function is a picklable partial)."""
    work = functools.partial(build_entry, location=location, decode=decode, opts=opts, stats=stats, ranged=ranged)
    totals = each(work, urls) if each is not None else [work(u) for u in urls]
    manifest = Manifest.of(location, totals, decode)
    save_manifest(manifest, opts)
    return manifest


def obtain_manifest(urls: Sequence[str], *, location: str | None, cache_dir: str | None,
                    decode: DecodeOptions = DecodeOptions(), opts: OpenOptions = OpenOptions(),
                    stats: IOStats | None = None) -> Manifest:
    """The manifest of ``urls``: the one at ``location`` (checked to list exactly ``urls``), else for
    local shards one built once under a lock in the cache directory; remote shards without a
    ``location`` are refused, naming ``streampack index`` (building here would read the whole data
    set in every job). A built manifest is read without the lock (it is replaced atomically), so
    processes of a host do not queue behind each other's stats; only a missing or stale one waits."""
    if location is not None:
        manifest = load_manifest(location, opts)
        manifest.check_urls(urls)
        manifest.check_settings(index_decode(decode))
        return manifest
    remote = [u for u in urls if is_remote(u) and not u.startswith(("hf-dataset://", "hf-stream://"))]  # in memory
    if remote:
        raise ValueError(f"planning this run needs the data set's manifest ({len(urls)} shards, e.g. {remote[0]!r} "
                         f"is remote): build it once with `streampack index URLS --out DIR` and pass manifest=DIR")
    decode = index_decode(decode)
    key = "\n".join([decode.tokens_key, limits_key("x.tar", decode.limits), limits_key("x.jsonl", decode.limits),
                     f"{decode.eos_id},{decode.token_dtype},{decode.megatron_sample}", *urls])
    where = join_path(join_path(index_dir(cache_dir), "manifests"), hashlib.sha1(key.encode()).hexdigest()[:16])
    manifest = _current_manifest(where, urls, opts, stats)
    if manifest is not None:
        return manifest
    with locked(join_path(where, MANIFEST_FILE)):
        manifest = _current_manifest(where, urls, opts, stats)  # built by another process while this one waited
        if manifest is not None:
            return manifest
        return build_manifest(urls, where, decode=decode, opts=opts, stats=stats, each=_with_progress)


def _current_manifest(where: str, urls: Sequence[str], opts: OpenOptions, stats: IOStats | None) -> Manifest | None:
    """The cached manifest at ``where`` when it lists exactly ``urls`` and every shard is
    unchanged since; None when it is absent, of another version or stale."""
    try:
        manifest = load_manifest(where, opts)
    except ValueError:
        return None
    return manifest if is_current(manifest, urls, opts, stats) else None


def is_current(manifest: Manifest, urls: Sequence[str], opts: OpenOptions, stats: IOStats | None = None) -> bool:
    """Whether ``manifest`` lists exactly ``urls`` and every shard is what it indexed (one ``stat`` each)."""
    return manifest.urls == urls and all(
        manifest.identity(i) == shard_identity.identity(u, opts, stats) for i, u in enumerate(urls))


def _with_progress(work: Callable[[str], ShardTotals], urls: Sequence[str]) -> list[ShardTotals]:
    from tqdm import tqdm

    return [work(u) for u in tqdm(urls, desc="streampack: indexing shards (once)", unit="shard", disable=None,
                                  file=sys.stderr)]


def manifest_arrays(manifest: Manifest) -> dict[str, np.ndarray]:
    """The arrays of the manifest file (what :func:`load_manifest` reads back, checked)."""
    urls, url_ends = manifest.urls.blob()
    tags, tag_ends = manifest.tags.blob()
    digests, digest_ends = manifest.digests.blob()
    limits = np.asarray([getattr(manifest.limits, n) for n in LIMITS], dtype=np.int64)
    arrays = {"version": np.array(MANIFEST_VERSION), "tokens_key": np.array(manifest.tokens_key),
              "settings": np.array(manifest.settings),
              "urls": urls, "url_ends": url_ends, "tags": tags, "tag_ends": tag_ends, "sizes": manifest.sizes,
              "samples": manifest.samples, "tokens": manifest.tokens, "byte_costs": manifest.byte_costs,
              "digests": digests, "digest_ends": digest_ends, "limits": limits}
    return arrays


def save_manifest(manifest: Manifest, opts: OpenOptions) -> None:
    """Write the manifest file atomically (local: temp file + rename, mode ``0666 & ~umask``;
    object stores: one PUT)."""
    arrays = manifest_arrays(manifest)
    path = join_path(manifest.location, MANIFEST_FILE)
    if not save_arrays(path, arrays, opts):
        raise OSError(f"cannot write the manifest {path!r}")
    # A copy named by its fingerprint: a resume state names the manifest it was saved under, so
    # when the shards have changed since, the refusal can name which (one more write per build).
    history = join_path(manifest.location, HISTORY_DIR)
    save_arrays(join_path(history, f"{manifest.fingerprint('all')}{HISTORY_SUFFIX}"), arrays, opts)
    if not is_remote(history):
        _prune(history)


def load_saved(location: str, fingerprint: str, opts: OpenOptions = OpenOptions()) -> Manifest | None:
    """The manifest once saved in ``location`` whose :meth:`Manifest.fingerprint` ``("all")`` is
    ``fingerprint`` (one read), or None when it is no longer kept."""
    if not fingerprint.isalnum():
        return None
    try:
        return load_manifest(location, opts, name=f"{HISTORY_DIR}/{fingerprint}{HISTORY_SUFFIX}")
    except ValueError:
        return None


def _prune(history: str) -> None:
    """Keep the newest :data:`HISTORY_KEEP` copies (a local cache only: listing a bucket is a cost)."""
    try:
        kept = sorted((e for e in os.scandir(history) if e.name.endswith(HISTORY_SUFFIX)),
                      key=lambda e: e.stat().st_mtime_ns, reverse=True)
        for entry in kept[HISTORY_KEEP:]:
            os.remove(entry.path)
    except OSError:
        pass  # another process pruned first, or a read-only cache: copies are only for naming shards


def load_manifest(location: str, opts: OpenOptions = OpenOptions(), *, name: str = MANIFEST_FILE) -> Manifest:
    """The manifest in ``location`` (one read), every field checked; ``ValueError`` naming the file
    when it is absent, damaged, of another version or not what ``streampack index`` writes."""
    path = join_path(location, name)
    try:
        data = read_arrays(path, opts)
    except DamagedFile as e:
        raise ValueError(f"the manifest {e}: it is cut short or not a manifest: rebuild it with "
                         f"`streampack index URLS --out {location}`") from None
    if data is None:
        raise ValueError(f"no manifest at {path!r}: write one with `streampack index URLS --out {location}`")
    fields = checked_fields(path, data, MANIFEST_VERSION)
    try:
        limits = Limits(**fields.pop("limits"))
    except ValueError as e:
        raise ValueError(f"the manifest {path!r} is not valid: field 'limits' ({e}): rebuild it with "
                         f"`streampack index URLS --out DIR`") from None
    return Manifest(location=location, limits=limits, **fields)


__all__ = ["MANIFEST_FILE", "MANIFEST_VERSION", "Manifest", "ShardChange", "ShardTotals", "build_entry",
           "build_manifest", "is_current", "load_manifest", "load_saved", "manifest_arrays", "obtain_manifest",
           "save_manifest"]
