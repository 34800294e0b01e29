"""Storage benchmark: the choices made in ``streampack.io`` (open.py, index.py), measured.

1. Local shards: plain ``open`` vs streampack's resumable stream (the fault-retry layer every
   read goes through), for a tar shard parsed sample by sample and for jsonl read line by line.
2. HTTP on loopback, with and without 20 ms of latency before each response (an object
   store's first-byte time): streampack's block reads (``fs.cat_file`` of ``block_size`` bytes
   through fsspec/aiohttp, the next block prefetched in a thread) vs one streaming ``urllib3``
   GET of the whole object vs fsspec's own file object (``fs.open``, readahead cache).
3. The index of a jsonl shard of N lines: build time, peak traced memory and file size, next
   to the json sidecar the old code wrote for the same index.

    python benchmarks/bench_storage.py [--quick]

Numbers from one run on a shared 2-core machine are provisional (benchmarks/README.md has the last full run).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
import tracemalloc
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def _best(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_local(directory: str, docs: int, repeat: int) -> list[dict[str, Any]]:
    from helpers_data import make_token_docs, write_jsonl_shards, write_tar_shards

    from streampack.io.open import open_shard

    data = make_token_docs(docs, seed=1, min_len=100, max_len=1000)
    (tar,) = write_tar_shards(os.path.join(directory, "local"), data, 1)
    (jsonl,) = write_jsonl_shards(os.path.join(directory, "local"), data, 1)

    def parse_tar(f: Any) -> int:
        return _parse(f, tar, True)

    def lines(f: Any) -> int:
        return sum(1 for _ in iter(f.readline, b""))

    rows = []
    for name, path, consume in (("tar, parsed", tar, parse_tar), ("jsonl, readline", jsonl, lines)):
        def plain() -> None:
            with open(path, "rb") as f:
                consume(f)

        def stream() -> None:
            with open_shard(path) as f:
                consume(f)

        a, b = _best(plain, repeat), _best(stream, repeat)
        mb = os.path.getsize(path) / 1e6
        rows.append({"bench": f"local {name}", "MB": round(mb, 1), "plain open MB/s": round(mb / a),
                     "streampack MB/s": round(mb / b), "overhead %": round(100 * (b - a) / a, 1)})
    return rows


def bench_http(directory: str, size_mb: int, repeat: int, tars: list[str]) -> list[dict[str, Any]]:
    import fsspec
    import urllib3
    from helpers_faults import Fault, serve_faulty

    from streampack.io.open import open_shard
    from streampack.io.storage import OpenOptions

    path = os.path.join(directory, "blob.bin")
    with open(path, "wb") as f:
        f.write(np.random.default_rng(0).bytes(size_mb << 20))
    rows = []
    with serve_faulty(directory) as server:
        url = f"{server.url}/blob.bin"
        pool = urllib3.PoolManager()

        def drain(f: Any) -> None:
            while f.read(1 << 20):
                pass

        def ours() -> None:
            with open_shard(url, opts=OpenOptions()) as f:
                drain(f)

        def one_get() -> None:
            resp = pool.request("GET", url, preload_content=False)
            for _ in resp.stream(1 << 20):
                pass
            resp.release_conn()

        def fsspec_file() -> None:
            fs = fsspec.filesystem("http", skip_instance_cache=True)
            with fs.open(url, "rb", block_size=8 << 20, cache_type="readahead") as f:
                drain(f)

        tar_mb = sum(os.path.getsize(p) for p in tars) / 1e6
        remote = [f"{server.url}/local/{os.path.basename(p)}" for p in tars]

        def parse_local() -> None:
            for p in tars:
                with open(p, "rb") as f:
                    _parse(f, p, True)

        def parse_ours() -> None:
            for u in remote:
                with open_shard(u) as f:
                    _parse(f, u, True)

        def parse_one_get() -> None:
            for u in remote:
                resp = pool.request("GET", u, preload_content=False)
                _parse(io.BufferedReader(resp, 1 << 18), u, False)
                resp.release_conn()

        for warm in (ours, one_get, parse_ours):  # sessions and connections opened before timing
            warm()
        for latency in (0.0, 0.02):
            server.plan.clear()
            if latency:
                server.plan.add(Fault("delay", delay=latency, method="*"), times=10**6)
            row: dict[str, Any] = {"bench": f"http read {size_mb} MB, {latency * 1000:.0f} ms latency"}
            for label, fn in (("streampack blocks MB/s", ours), ("urllib3 one GET MB/s", one_get),
                              ("fsspec fs.open MB/s", fsspec_file)):
                row[label] = round(size_mb * 1.048576 / _best(fn, repeat))
            rows.append(row)
            row = {"bench": f"http tar parsed {tar_mb:.0f} MB, {latency * 1000:.0f} ms latency",
                   "local open MB/s": round(tar_mb / _best(parse_local, repeat))}
            for label, fn in (("streampack blocks MB/s", parse_ours), ("urllib3 one GET MB/s", parse_one_get)):
                row[label] = round(tar_mb / _best(fn, repeat))
            rows.append(row)
    return rows


def _parse(f: Any, url: str, seekable: bool) -> int:
    from streampack.io.decode import DecodeOptions
    from streampack.io.tar import iter_tar_items

    return sum(1 for _ in iter_tar_items(f, DecodeOptions(), url=url, start=0, first_index=0, end=None,
                                         seekable=seekable))


def bench_index(directory: str, lines: int) -> list[dict[str, Any]]:
    from streampack.io.index import build_index, cache_path, load_or_build_index

    path = os.path.join(directory, "index.jsonl")
    with open(path, "wb") as f:
        for start in range(0, lines, 100_000):
            stop = min(lines, start + 100_000)
            f.write(b"".join(b'{"input_ids": [%d, %d, 7]}\n' % (i, i % 100) for i in range(start, stop)))
    t = time.perf_counter()
    index = load_or_build_index(path, cache_dir=os.path.join(directory, "cache"))
    seconds = time.perf_counter() - t
    stored = os.path.getsize(cache_path(path, os.path.join(directory, "cache")))
    old = {"url": path, "fingerprint": "", "offsets": index.offsets.tolist(), "numbers": index.numbers.tolist(),
           "keys": [str(n) for n in index.numbers.tolist()], "lengths": index.lengths.tolist(), "end": index.end}
    old_bytes = len(json.dumps(old))
    del old, index
    tracemalloc.start()  # (slows allocation-heavy code several-fold: timed apart)
    build_index(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return [{"bench": f"index of {lines:,} jsonl lines", "build + save s": round(seconds, 2),
             "peak traced MiB": round(peak / 2**20, 1), "index file KiB": round(stored / 1024),
             "old json sidecar KiB": round(old_bytes / 1024), "bytes/sample": round(stored / lines, 2)}]


def run(quick: bool = False) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as directory:
        rows = bench_local(directory, 2_000 if quick else 20_000, 2 if quick else 3)
        tars = [os.path.join(directory, "local", "shard-000000.tar")]
        rows += bench_http(directory, 16 if quick else 128, 1 if quick else 3, tars)
        rows += bench_index(directory, 200_000 if quick else 4_000_000)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    for row in run(quick=args.quick):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
