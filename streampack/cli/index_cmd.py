"""``streampack index URLS --out DIR``: write a data set's manifest and shard indexes once, ahead of training.

With ``--out DIR`` (local or any fsspec URL) it writes ``DIR/manifest.spm.npz`` and ``DIR/shards/*.spidx.npz``: pass
``manifest=DIR`` to ``PackedDataset`` and no training process indexes or HEADs a shard to plan. Without ``--out`` it
fills the per-shard cache (``--cache-dir``). It resumes (a shard whose index is there for its identity and settings is
not read again); damaged shards are indexed up to the damage and listed; an unreadable shard fails the run (exit 1, no
manifest).

Run by every rank of a ``torchrun`` or SLURM job (or W processes given ``--rank R --world-size W``), each rank
indexes every W-th shard and writes a part file under ``DIR/parts``; rank 0 merges the W parts into the manifest a
single process would write (:mod:`streampack.cli.ranks`, :mod:`streampack.cli.index_parts`). A rank killed and
launched again re-reads none of the shards whose index files it wrote; a launch with another world size merges to
the same manifest.

**Cost** per shard: 1 stat / HEAD, 2 ranged reads of ≤ 64 KiB (the digest), one scan unless its
index is there, 1 write. Remote shards run on ``--jobs`` threads (default 16: the work waits on
requests), local ones on one process per core (the scan is Python, serialized by the GIL:
100 shards 37 s with processes, 46 s with threads, ``benchmarks/bench_index.py``); under torchrun the
processes of one node share its cores (``LOCAL_WORLD_SIZE``). Per rank of W: ⌈N/W⌉ shards as above, 1 listing of
the URLs, 1 part write; rank 0 also W part reads and O(N) memory to merge.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from streampack.cli._data import CliError, add_limit_arguments, no_bar, parsed_limits
from streampack.cli.ranks import JobRank, add_rank_arguments, job_of
from streampack.io.tar_sparse import RANGED_MODES
from streampack.io.token_array import TOKEN_DTYPES

if TYPE_CHECKING:
    from streampack.io.decode import DecodeOptions
    from streampack.io.manifest import Manifest
    from streampack.io.storage import OpenOptions


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("urls", nargs="+", help="shards: paths, globs, brace patterns, directories or fsspec URLs")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write the manifest and index files here (PackedDataset's manifest=DIR); local or a URL")
    p.add_argument("--cache-dir", default=None,
                   help="without --out: where the per-shard index files go (PackedDataset's cache_dir; default "
                        "$STREAMPACK_CACHE/index or ~/.cache/streampack/index)")
    p.add_argument("--tokens-key", default="input_ids", help="field holding token ids (for the lengths)")
    p.add_argument("--eos-id", type=int, default=None,
                   help="flat token arrays: documents end at this id (default: at the offsets file beside each)")
    p.add_argument("--megatron-sample", choices=("document", "sequence"), default="document",
                   help="Megatron-core indexed data sets: a sample per document (default) or per sequence")
    p.add_argument("--token-dtype", choices=TOKEN_DTYPES, default=None,
                   help="flat token arrays without a numpy header (raw .bin, memmap .npy): the ids' dtype")
    add_limit_arguments(p, note=" of the training run: an over-limit sample is indexed with an unknown length")
    p.add_argument("--jobs", type=int, default=None,
                   help="shards indexed at once (default: 16 threads for remote shards, one process per core "
                        "for local ones)")
    p.add_argument("--pool", choices=("auto", "threads", "processes"), default="auto",
                   help="auto: processes for local shards, threads for remote ones")
    p.add_argument("--ranged", choices=RANGED_MODES, default="auto",
                   help="remote tar: read headers by ranged requests (auto: where the members are large)")
    p.add_argument("--retry-budget", type=float, default=120.0, help="seconds a failing read keeps retrying")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an fsspec storage option (VALUE parsed as JSON when it can be), repeatable")
    p.add_argument("--quiet", "--no-progress", dest="quiet", action="store_true",
                   help="no progress bar (it is off anyway when stderr is not a terminal)")
    add_rank_arguments(p)
    p.set_defaults(run=run)


def _storage_options(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliError(f"--storage-option {pair!r}: want KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def _one(work: Callable[[str], Any], url: str) -> tuple[str, Any]:
    from streampack.errors import DataError

    try:
        return url, work(url)
    except DataError as e:
        return url, e


def _mapped(pool: Executor, work: Callable[[str], Any], urls: Sequence[str], jobs: int) -> Iterator[tuple[str, Any]]:
    """``(url, result or DataError)`` in URL order, at most ``2 * jobs`` shards in flight."""
    one = functools.partial(_one, work)
    pending: list[Any] = []
    for url in urls:
        pending.append(pool.submit(one, url))
        if len(pending) >= 2 * jobs:
            yield pending.pop(0).result()
    for future in pending:
        yield future.result()


def _default_jobs(processes: bool) -> int:
    """One process per core this rank may use (torchrun starts ``LOCAL_WORLD_SIZE`` ranks on a node, each of
    which would otherwise start one per core), or 16 threads: remote work waits on requests."""
    if not processes:
        return 16
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, cores // local)


def run(args: argparse.Namespace) -> int:
    from streampack.io.decode import DecodeOptions
    from streampack.io.index import index_decode
    from streampack.io.manifest import Manifest
    from streampack.io.retry import RetryPolicy
    from streampack.io.storage import OpenOptions
    from streampack.io.urls import expand_urls

    if args.jobs is not None and args.jobs < 1:
        raise CliError(f"--jobs={args.jobs} must be >= 1")
    if args.out is not None and args.cache_dir is not None:
        raise CliError("--out writes a manifest and its index files; --cache-dir fills the per-shard cache: pick one")
    if args.eos_id is not None and args.eos_id < 0:
        raise CliError(f"--eos-id={args.eos_id} must be >= 0")
    job = job_of(args)
    limits = parsed_limits(args)
    opts = OpenOptions(retry=RetryPolicy(budget=args.retry_budget),
                       storage_options=_storage_options(args.storage_option))
    urls = expand_urls(args.urls, opts=opts)
    decode = index_decode(DecodeOptions(tokens_key=args.tokens_key, limits=limits, eos_id=args.eos_id,
                                        token_dtype=args.token_dtype, megatron_sample=args.megatron_sample))
    if job.world_size == 1:
        results, failed = _index(args, urls, decode, opts, desc="indexing")
        if args.out is not None:
            if failed:
                print(f"no manifest written: {len(failed)} shard(s) failed (their index files are kept: run it "
                      f"again to resume)", file=sys.stderr)
            else:
                _save(Manifest.of(args.out, results, decode), opts)
        return 1 if failed else 0
    return _run_rank(args, job, urls, decode, opts)


def _run_rank(args: argparse.Namespace, job: JobRank, urls: list[str], decode: DecodeOptions,
              opts: OpenOptions) -> int:
    """One rank of a job: its share, its part, and on rank 0 the merge (see :mod:`streampack.cli.ranks`)."""
    from streampack.cli.index_parts import JobArguments, clear_own, merge_parts, write_failure, write_part

    share = [urls[i] for i in job.share(len(urls))]
    asked = JobArguments.of(urls, decode)
    if args.out is not None:
        clear_own(args.out, job, opts)
    print(f"{job.describe()}: {len(share)} of {len(urls)} shard(s)")
    results, failed = _index(args, share, decode, opts, desc=f"indexing (rank {job.rank}/{job.world_size})")
    if args.out is None:  # the per-shard cache needs no merge
        return 1 if failed else 0
    if failed:
        write_failure(args.out, job, failed, opts)
        print(f"no part written: {len(failed)} shard(s) failed (their index files are kept: run the job again to "
              f"resume)", file=sys.stderr)
        return 1
    print(f"part: {write_part(args.out, job, asked, results, decode, opts)}")
    if job.rank != 0:
        return 0
    _save(merge_parts(args.out, job, urls, asked, decode, opts, timeout=args.wait_timeout), opts)
    return 0


def _save(manifest: Manifest, opts: OpenOptions) -> None:
    from streampack.io.manifest import save_manifest

    save_manifest(manifest, opts)
    print(f"manifest: {len(manifest)} shard(s) -> {manifest.location}")


def _index(args: argparse.Namespace, urls: list[str], decode: DecodeOptions, opts: OpenOptions, *,
           desc: str) -> tuple[list[Any], list[str]]:
    """Index ``urls`` (into ``--out`` or the cache) on the pool; prints damaged and failed shards and the totals;
    returns the results in URL order (manifest entries with ``--out``, else indexes) and the failure lines."""
    from tqdm import tqdm

    from streampack.io.index import load_or_build_index
    from streampack.io.index_cache import index_dir
    from streampack.io.manifest import build_entry
    from streampack.io.retry import IOStats
    from streampack.io.storage import is_remote

    remote = any(is_remote(u) for u in urls)
    processes = args.pool == "processes" or (args.pool == "auto" and not remote)
    jobs = args.jobs or _default_jobs(processes)
    stats = None if processes else IOStats()  # counters do not cross processes
    if args.out is not None:
        work: Callable[[str], Any] = functools.partial(build_entry, location=args.out, decode=decode, opts=opts,
                                                       stats=stats, ranged=args.ranged)
    else:
        work = functools.partial(load_or_build_index, decode=decode, opts=opts, cache_dir=args.cache_dir, stats=stats)
    pool: Executor = ProcessPoolExecutor(jobs) if processes else ThreadPoolExecutor(jobs)
    results, damaged, failed, samples = [], [], [], 0
    with pool:
        for url, result in tqdm(_mapped(pool, work, urls, jobs), total=len(urls), unit="shard",
                                desc=desc, file=sys.stderr, disable=no_bar(args.quiet)):
            if isinstance(result, Exception):
                failed.append(f"failed: {result}")
                continue
            results.append(result)
            readable = result.samples if args.out is not None else len(result)  # a manifest entry or an index
            samples += readable
            if result.damage:
                damaged.append(f"damaged: {url}: {readable} readable sample(s), then {result.damage}")
    for line in damaged + failed:
        print(line)
    where = args.out if args.out is not None else index_dir(args.cache_dir)
    print(f"indexed {len(urls) - len(failed)} of {len(urls)} shard(s): {samples} samples, {len(damaged)} damaged "
          f"-> {where}")
    if stats is not None and stats.retries:
        print(f"({stats.retries} read(s) retried: {stats.faults})", file=sys.stderr)
    return results, failed
