"""``streampack index URLS --cache-dir DIR``: build the sample index of every shard once, ahead of training.

A reader needs a shard's index to split it between workers (fewer shards than workers) and
planners read its token lengths. Without this command the first worker that needs an index
builds it (under a lock, so once per cache directory); for remote data build them here once
and point every node's ``cache_dir`` at the same ``DIR`` (a shared filesystem, or a URL such as
``s3://bucket/index/``), so no training process downloads a shard just to index it. Damaged
shards are indexed up to the damage and listed; a shard that cannot be read at all is listed
as failed (exit code 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from streampack.cli._data import CliError, describe, no_bar


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments (``streampack.cli.main`` made ``p`` with its name and help)."""
    p.description = describe(__doc__)
    p.add_argument("urls", nargs="+", help="shards: paths, globs, brace patterns, directories or fsspec URLs")
    p.add_argument("--cache-dir", default=None,
                   help="where the index files go (PackedDataset's cache_dir; default $STREAMPACK_CACHE/index "
                        "or ~/.cache/streampack/index)")
    p.add_argument("--tokens-key", default="input_ids", help="field holding token ids (for the lengths)")
    p.add_argument("--jobs", type=int, default=4, help="shards indexed at once (default %(default)s)")
    p.add_argument("--retry-budget", type=float, default=120.0, help="seconds a failing read keeps retrying")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an fsspec storage option (VALUE parsed as JSON when it can be), repeatable")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
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


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from streampack.errors import DataError
    from streampack.io.decode import DecodeOptions
    from streampack.io.index import index_dir, load_or_build_index
    from streampack.io.retry import IOStats, RetryPolicy
    from streampack.io.storage import OpenOptions
    from streampack.io.urls import expand_urls

    if args.jobs < 1:
        raise CliError(f"--jobs={args.jobs} must be >= 1")
    opts = OpenOptions(retry=RetryPolicy(budget=args.retry_budget),
                       storage_options=_storage_options(args.storage_option))
    urls = expand_urls(args.urls, opts=opts)
    decode, stats = DecodeOptions(tokens_key=args.tokens_key), IOStats()

    def one(url: str) -> tuple[str, Any]:
        try:
            return url, load_or_build_index(url, decode=decode, opts=opts, cache_dir=args.cache_dir, stats=stats)
        except DataError as e:
            return url, e

    samples, damaged, failed = 0, [], []
    with ThreadPoolExecutor(args.jobs) as pool:
        for url, result in tqdm(pool.map(one, urls), total=len(urls), unit="shard", disable=no_bar(args.no_progress)):
            if isinstance(result, DataError):
                failed.append(f"failed: {result}")
                continue
            samples += len(result)
            if result.damage:
                damaged.append(f"damaged: {url}: {len(result)} readable sample(s), then {result.damage}")
    for line in damaged + failed:
        print(line)
    print(f"indexed {len(urls) - len(failed)} of {len(urls)} shard(s): {samples} samples, {len(damaged)} damaged "
          f"-> {index_dir(args.cache_dir)}")
    if stats.retries:
        print(f"({stats.retries} read(s) retried: {stats.faults})", file=sys.stderr)
    return 1 if failed else 0
