"""The part files of ``streampack index`` run as the ranks of a job (:mod:`streampack.cli.ranks`), and rank 0's merge.

Rank ``r`` of ``W`` writes ``DIR/parts/rank-r-of-W.spm.npz``: the manifest arrays of its share (the same file format
and checks as ``manifest.spm.npz``) plus what the job was asked, the expanded URL list's count and SHA-1 and the
index settings, and the launch's id (:attr:`JobRank.launch`: a part of an earlier launch is waited past), so rank 0 refuses a rank started with other arguments instead of merging its entries. A rank whose
shards fail writes ``rank-r-of-W.failed.npz`` naming them, and rank 0 stops at once. Rank 0 then puts entry ``i``
of part ``r`` at shard ``r + i·W`` and writes the manifest through the one path a single process takes
(:meth:`Manifest.of` + :func:`save_manifest`), so the result is the single-process manifest of the same URLs.

**Cost**: each rank 1 write of ``≈ 70 B × ⌈N/W⌉``; rank 0 W part reads and O(N) memory (the manifest's columns and
one :class:`ShardTotals` per shard while merging).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from streampack.cli._data import CliError
from streampack.cli.ranks import PARTS_DIR, JobRank, gather
from streampack.io.decode import DecodeOptions
from streampack.io.index_cache import DamagedFile, join_path, read_arrays, save_arrays
from streampack.io.limits import Limits
from streampack.io.manifest import MANIFEST_VERSION, Manifest, ShardTotals, manifest_arrays
from streampack.io.manifest_file import checked_fields
from streampack.io.storage import OpenOptions, filesystem, is_remote
from streampack.io.urls import list_digest

PART_SUFFIX = ".spm.npz"
FAILED_SUFFIX = ".failed.npz"


@dataclass(frozen=True, slots=True, kw_only=True)
class JobArguments:
    """What every rank of one job must agree on: the expanded URL list and the index settings."""

    count: int
    urls_sha1: str
    settings: str

    @classmethod
    def of(cls, urls: Sequence[str], decode: DecodeOptions) -> JobArguments:
        return cls(count=len(urls), urls_sha1=list_digest(urls),
                   settings=repr(decode))

    def arrays(self) -> dict[str, np.ndarray]:
        return {"job_count": np.array(self.count), "job_urls_sha1": np.array(self.urls_sha1),
                "job_settings": np.array(self.settings)}

    def differences(self, data: dict[str, np.ndarray]) -> list[str]:
        """What a part's recorded job says otherwise than this one (empty when it agrees)."""
        count, sha1, settings = (str(data.get(k, "?")) for k in ("job_count", "job_urls_sha1", "job_settings"))
        out = []
        if (count, sha1) != (str(self.count), self.urls_sha1):
            out.append(f"its URL list is {count} shard(s), SHA-1 {sha1[:12]} (rank 0's: {self.count}, "
                       f"{self.urls_sha1[:12]})")
        if settings != self.settings:
            out.append(f"its settings are {settings} (rank 0's: {self.settings})")
        return out


def _path(out: str, job: JobRank, suffix: str, rank: int | None = None) -> str:
    return join_path(join_path(out, PARTS_DIR), job.part_name(rank=rank) + suffix)


def _remove(path: str, opts: OpenOptions) -> None:
    with contextlib.suppress(FileNotFoundError):
        if is_remote(path):
            fs, p = filesystem(path, opts)
            fs.rm_file(p)
        else:
            os.remove(path)


def clear_own(out: str, job: JobRank, opts: OpenOptions) -> None:
    """Remove this rank's part and failure note of an earlier launch, so rank 0 never merges a part this launch
    has not written (its shards may have changed since)."""
    for suffix in (PART_SUFFIX, FAILED_SUFFIX):
        _remove(_path(out, job, suffix), opts)


def write_part(out: str, job: JobRank, asked: JobArguments, totals: Sequence[ShardTotals],
               decode: DecodeOptions, opts: OpenOptions) -> str:
    """This rank's entries (in share order) as a part file, atomically; returns its path."""
    path = _path(out, job, PART_SUFFIX)
    arrays = {**manifest_arrays(Manifest.of(out, totals, decode)), **asked.arrays(), "launch": np.array(job.launch)}
    if not save_arrays(path, arrays, opts):
        raise OSError(f"cannot write the part {path!r}")
    return path


def write_failure(out: str, job: JobRank, lines: Sequence[str], opts: OpenOptions) -> None:
    """Tell rank 0 this rank failed (so it stops at once instead of waiting its timeout)."""
    save_arrays(_path(out, job, FAILED_SUFFIX), {"failed": np.array("\n".join(lines)), "launch": np.array(job.launch)},
                opts)


def _load_part(out: str, job: JobRank, rank: int, asked: JobArguments, share: Sequence[str],
               opts: OpenOptions) -> Manifest | None:
    failed = read_arrays(_path(out, job, FAILED_SUFFIX, rank), opts)
    if failed is not None and str(failed.get("launch", "")) == job.launch:
        lines = str(failed["failed"]).splitlines()
        raise CliError(f"rank {rank} could not index {len(lines)} shard(s), e.g. {lines[0] if lines else '?'}: no "
                       f"manifest written (the index files made are kept: run the job again to resume)")
    path = _path(out, job, PART_SUFFIX, rank)
    try:
        data = read_arrays(path, opts)
        if data is None or str(data.get("launch", "")) != job.launch:
            return None  # not written yet, or left by an earlier launch: this launch's rank r will replace it
        differ = asked.differences(data)
        if differ:
            raise CliError(f"rank {rank} was started with other arguments than rank 0: {'; '.join(differ)}; "
                           f"every rank must run the same `streampack index` command (or the part {path!r} is "
                           f"left from an earlier launch with other arguments and rank {rank} has not yet started: "
                           f"delete it)")
        fields = checked_fields(path, data, MANIFEST_VERSION)
        part = Manifest(location=out, limits=Limits(**fields.pop("limits")), **fields)
    except (DamagedFile, ValueError) as e:
        if isinstance(e, CliError):
            raise
        raise CliError(f"rank {rank}'s part is not valid ({e})") from None
    if part.urls != share:
        raise CliError(f"rank {rank}'s part {path!r} lists {len(part.urls)} shard(s), not its share of "
                       f"{len(share)}: every rank must run the same `streampack index` command")
    return part


def merge_parts(out: str, job: JobRank, urls: Sequence[str], asked: JobArguments, decode: DecodeOptions,
                opts: OpenOptions, *, timeout: float) -> Manifest:
    """Rank 0: wait for every rank's part and return the manifest of all ``urls`` (not yet saved)."""
    world = job.world_size
    start = time.perf_counter()
    parts = gather(lambda r: _load_part(out, job, r, asked, urls[r::world], opts), world, timeout=timeout,
                   where=join_path(out, PARTS_DIR))
    waited = time.perf_counter() - start
    totals: list[ShardTotals | None] = [None] * len(urls)
    for r, part in enumerate(parts):
        digests = list(part.digests) if len(part.digests) == len(part) else [""] * len(part)
        for i, (url, size, tag, samples, tokens, cost, digest) in enumerate(zip(
                part.urls, part.sizes.tolist(), part.tags, part.samples.tolist(), part.tokens.tolist(),
                part.byte_costs.tolist(), digests)):
            totals[r + i * world] = ShardTotals(url=url, size=size, tag=tag, samples=samples, tokens=tokens,
                                                byte_cost=cost, digest=digest)
    assert all(t is not None for t in totals), "the strided shares cover every shard"
    manifest = Manifest.of(out, totals, decode)  # type: ignore[arg-type]
    print(f"rank 0: the {world} parts were there after {waited:.2f} s; merged in {time.perf_counter() - start - waited:.2f} s")
    return manifest


__all__ = ["JobArguments", "clear_own", "merge_parts", "write_failure", "write_part"]
