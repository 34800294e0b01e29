"""What the hostile-input checks cost on good data, and what hostile data costs in memory.

Rows (``run()``):

- ``json_depth``: ``loads_bounded`` (json.loads with the ``max_json_depth`` check) against
  plain ``json.loads`` on typical lines, and the exact byte scan used only in processes that
  raised their recursion limit;
- ``reader``: ``ShardReader`` samples/s over pre-tokenized tar (npy) and jsonl shards
  (600-token lognormal documents). Run it against another tree to compare, e.g.
  ``PYTHONPATH=/work/main python benchmarks/bench_hostile.py --only reader``;
- ``key_set``: µs per insert and bytes per key of the repeated-key set;
- ``rss``: peak RSS growth of a child process reading a gzip bomb (one huge line in a tiny
  ``.jsonl.gz``), a huge-line ``.jsonl`` and a tar with a huge member through a pipe.

Run it from a neutral cwd (``cd /tmp && PYTHONPATH=<tree> python <tree>/benchmarks/bench_hostile.py``).
The last run's rows are in ``benchmarks/README.md`` ("bench_hostile"), the limits it checks in
``docs/reliability.md``, and what the limits cost against the reader without them in
``docs/changelog.md``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from streampack.nodes.reader import ShardReader

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
from report import emit_rows  # noqa: E402
from rss_child import read_in_child  # noqa: E402


def _per_call(fn: Callable[[], Any], min_seconds: float = 0.3) -> float:
    """Seconds per call (best of 3 timed loops)."""
    n, best = 1, float("inf")
    while True:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        took = time.perf_counter() - start
        if took >= min_seconds / 3:
            break
        n *= 4
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n)
    return best


def json_depth_rows() -> list[dict[str, Any]]:
    from streampack.io.decode import json_depth, loads_bounded
    from streampack.io.limits import Limits

    limit = Limits().max_json_depth
    rng = np.random.default_rng(0)
    turn = {"role": "user", "content": 'he said "hi" \\ and [x] {y} ' * 8}
    code = "def f(x):\n    return [x[i] for i in range(len(x)) if x[i] in {1: [2]}]\n" * 60
    lines = {
        "tokens (600 ids)": {"input_ids": rng.integers(0, 50_000, 600).tolist()},
        "text (3 KB)": {"text": " ".join(["word"] * 600)},
        "code text (4.6 KB, 360 brackets)": {"text": code},
        "chat (30 turns)": {"messages": [turn] * 30},
        "chat (200 turns)": {"messages": [turn] * 200},
    }
    rows = []
    for name, record in lines.items():
        raw = json.dumps(record).encode()
        text = raw.decode()
        parse = _per_call(lambda: json.loads(text))
        bounded = _per_call(lambda: loads_bounded(raw, text, limit))
        scan = _per_call(lambda: json_depth(raw, limit))
        rows.append({"bench": "json_depth", "line": name, "bytes": len(raw), "json_loads_us": parse * 1e6,
                     "bounded_loads_us": bounded * 1e6, "overhead_pct": 100 * (bounded - parse) / parse,
                     "byte_scan_us": scan * 1e6, "over_limit_brackets": raw.count(b"[") + raw.count(b"{") > limit})
    return rows


def reader_rows(docs: int) -> list[dict[str, Any]]:
    from helpers_data import write_jsonl_shards, write_tar_shards

    rng = np.random.default_rng(1)
    lengths = np.maximum(1, rng.lognormal(np.log(600) - 0.5, 1.0, docs).round()).astype(int)
    token_docs = [rng.integers(0, 50_000, n).tolist() for n in lengths.tolist()]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        shards = {"tar-npy": write_tar_shards(os.path.join(tmp, "t"), token_docs, 4),
                  "jsonl": write_jsonl_shards(os.path.join(tmp, "j"), token_docs, 4)}
        for fmt, urls in shards.items():
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                n = sum(1 for _ in ShardReader(urls, shuffle=False, epochs=1))
                best = min(best, time.perf_counter() - start)
            assert n == docs
            rows.append({"bench": "reader", "format": fmt, "samples": n, "samples_per_s": n / best,
                         "us_per_sample": best / n * 1e6})
    return rows


def key_set_rows(n: int) -> list[dict[str, Any]]:
    import tracemalloc

    from streampack.io.keys import KeySet

    keys = [f"{i:012d}" for i in range(n)]
    tracemalloc.start()
    start = time.perf_counter()
    ks = KeySet()
    for k in keys:
        ks.add(k)
    took = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # tracemalloc slows allocation: time again without it
    start = time.perf_counter()
    ks = KeySet()
    for k in keys:
        ks.add(k)
    took = min(took, time.perf_counter() - start)
    return [{"bench": "key_set", "keys": n, "us_per_insert": took / n * 1e6, "bytes_per_key_peak": peak / n}]


def _bomb(f: Any, mib: int) -> None:
    f.write(b'{"input_ids": [1, 2]}\n{"text": "')
    for _ in range(mib):
        f.write(b"a" * (1 << 20))
    f.write(b'"}\n{"input_ids": [3, 4]}\n')


def rss_rows(mib: int) -> list[dict[str, Any]]:
    from helpers_hostile import archive, header, samples

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        bomb, line, tar = (os.path.join(tmp, n) for n in ("bomb.jsonl.gz", "line.jsonl", "member.tar"))
        with gzip.open(bomb, "wb", compresslevel=9) as f:
            _bomb(f, mib)
        with open(line, "wb") as f:
            _bomb(f, mib)
        with open(tar, "wb") as f:
            f.write(b"".join(samples(2)) + header("00000002.npy", mib << 20))
            f.seek(mib << 20, 1)
            f.write(archive(*samples(1, start=3)))
        for name, url, size in ((f"gzip bomb ({mib} MiB line)", bomb, os.path.getsize(bomb)),
                                (f"jsonl ({mib} MiB line)", line, os.path.getsize(line)),
                                (f"tar via pipe ({mib} MiB member)", f"pipe:cat {tar}", os.path.getsize(tar))):
            try:
                read = read_in_child(url, cwd=tmp)
            except RuntimeError as exc:
                rows.append({"bench": "rss", "input": name, "error": str(exc)})
                continue
            rows.append({"bench": "rss", "input": name, "file_bytes": size, "kept": len(read.keys),
                         "peak_rss_growth_mib": read.growth_mib, "errors": read.errors})
    return rows


def run(quick: bool = False, only: tuple[str, ...] = ("json_depth", "reader", "key_set", "rss")) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    if "json_depth" in only:
        rows += json_depth_rows()
    if "reader" in only:
        rows += reader_rows(2_000 if quick else 20_000)
    if "key_set" in only:
        rows += key_set_rows(100_000 if quick else 1_000_000)
    if "rss" in only:
        rows += rss_rows(100 if quick else 400)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="json_depth,reader,key_set,rss")
    parser.add_argument("--out", help="also write the rows as json here")
    args = parser.parse_args()
    rows = run(args.quick, tuple(args.only.split(",")))
    emit_rows(rows, args.out)


if __name__ == "__main__":
    main()
