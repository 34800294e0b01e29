"""Cold start: a fresh process, empty caches, ``PackedDataset(...)`` construction to first batch.

What a new user (or every rank of a job on a fresh node) pays before training sees a batch.
Each measurement runs in a new interpreter with ``NUMBA_CACHE_DIR`` and ``STREAMPACK_CACHE``
pointing at empty temporary directories, so no compiled kernel or shard index from an earlier
run helps. Reported: the import of ``streampack`` + ``PackedDataset``, the construction, the
first batch, and which heavy modules the process loaded (numba must not be among them).

Usage: ``python benchmarks/bench_cold_start.py [--runs 3] [--out FILE]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import emit  # benchmarks/report.py (this folder is on sys.path)

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from streampack import PackedDataset, PackOptions, TokenizeOptions
t1 = time.perf_counter()
ds = PackedDataset(sys.argv[1:-1], capacity=4096, tokenizer=sys.argv[-1], seed=1,
                   tokenize=TokenizeOptions(eos_id=0), packing=PackOptions(window=1024))
t2 = time.perf_counter()
batch = next(iter(ds))
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "construct": t2 - t1, "first_batch": t3 - t2,
                  "numba_loaded": "numba" in sys.modules, "tokens": batch.num_tokens}))
"""


def corpus(root: Path) -> tuple[list[str], str]:
    from streampack.cli.corpus import train_demo_tokenizer, write_demo_corpus

    urls = write_demo_corpus(root / "corpus", num_shards=4, docs_per_shard=500, vocab_size=4000)
    return urls, str(train_demo_tokenizer(urls, root / "tokenizer.json", vocab_size=2000))


def one_run(urls: list[str], tokenizer: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as numba_cache, tempfile.TemporaryDirectory() as sp_cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": numba_cache, "STREAMPACK_CACHE": sp_cache}
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", CHILD, *urls, tokenizer], env=env, check=True,
                             capture_output=True, text=True).stdout
        wall = time.perf_counter() - start
    result = json.loads(out.strip().splitlines()[-1])
    return {**result, "process": wall}


def run(runs: int = 3, quick: bool = False) -> list[dict[str, object]]:
    """One row: medians over ``runs`` fresh processes (``benchmarks/run_all.py`` calls this)."""
    runs = 1 if quick else runs
    with tempfile.TemporaryDirectory() as tmp:
        urls, tokenizer = corpus(Path(tmp))
        results = [one_run(urls, tokenizer) for _ in range(runs)]
    row: dict[str, object] = {k: round(statistics.median(r[k] for r in results), 3)
                              for k in ("import", "construct", "first_batch", "process")}
    row["construct_to_first_batch"] = round(float(row["construct"]) + float(row["first_batch"]), 3)  # type: ignore[arg-type]
    row["numba_loaded"] = any(r["numba_loaded"] for r in results)
    row["runs"] = runs
    return [row]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the markdown table here")
    args = parser.parse_args()
    med = run(args.runs)[0]
    lines = [
        f"Cold start, median of {args.runs} fresh processes with empty numba and streampack caches "
        f"(Python {sys.version.split()[0]}, {os.cpu_count()} cores, text shards + BPE tokenizer, capacity 4096, window 1024):",
        "",
        "| import streampack | PackedDataset(...) | first batch | construction → first batch | whole process | numba loaded |",
        "|---|---|---|---|---|---|",
        f"| {med['import']:.2f} s | {med['construct']:.2f} s | {med['first_batch']:.2f} s | "
        f"{med['construct_to_first_batch']:.2f} s | {med['process']:.2f} s | "
        f"{'yes' if med['numba_loaded'] else 'no'} |",
    ]
    text = "\n".join(lines)
    return emit(text, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
