"""What checking a resume against changed shards costs one reader (numbers quoted in
nodes/reader.py and io/manifest.py).

    python benchmarks/bench_resume_check.py --shards 100000

Measured on a synthetic manifest of N shards (S3-like URLs, 36-char ETags, digests), no I/O but
the manifest copy's write and read:

- ``fingerprint``: the four fingerprints a planned reader's state records (``all``, ``tag``,
  ``size``, ``digest``), computed once per process on a fresh manifest — the O(N) CPU a resume
  check adds; the compare at restore is one string compare;
- ``changes_since``: naming the changed shards once a fingerprint differs (one shard changed),
  under ``tag`` (a Python pass over the tags) and ``size`` (numpy only);
- side by side, loading the manifest itself (what every planned reader pays already, once per process);
- ``save`` / ``load_saved``: writing the manifest with its history copy, and reading the copy
  back (what a refusal reads once to name the shards).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from typing import Any

import numpy as np

from streampack.io.manifest import Manifest, ShardTotals, load_manifest, load_saved, save_manifest
from streampack.io.storage import OpenOptions


def synthetic(shards: int, location: str) -> Manifest:
    rng = np.random.default_rng(0)
    totals = [ShardTotals(url=f"s3://my-bucket/datasets/web-2026/train/shard-{i:06d}.tar",
                          size=int(rng.integers(1e8, 1e9)), tag=f'"{rng.bytes(16).hex()}-{int(rng.integers(1, 99))}"',
                          samples=int(rng.integers(5e4, 1e5)), tokens=int(rng.integers(1e7, 1e8)),
                          byte_cost=int(rng.integers(1e8, 1e9)),
                          digest="digest=" + rng.bytes(20).hex()) for i in range(shards)]
    return Manifest.of(location, totals)


def best(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure(shards: int) -> dict[str, Any]:
    """One row: the costs above at ``shards`` shards (seconds)."""
    with tempfile.TemporaryDirectory() as d:
        m = synthetic(shards, d)
        fresh = lambda: dataclasses.replace(m)  # noqa: E731 - a new object: no cached fingerprint
        t_print = best(lambda: [fresh().fingerprint(mode) for mode in ("all", "tag", "size", "digest")])
        tags = list(m.tags)
        tags[shards // 2] = '"re-staged"'
        other = dataclasses.replace(m, tags=tuple(tags))
        t_tag = best(lambda: other.changes_since(m, "tag"))
        t_size = best(lambda: other.changes_since(m, "size"))
        assert [c.shard for c in other.changes_since(m, "tag")] == [shards // 2]
        t_save = best(lambda: save_manifest(m, OpenOptions()), repeat=2)
        key = m.fingerprint("all")
        t_load = best(lambda: load_saved(d, key), repeat=3)
        t_manifest = best(lambda: load_manifest(d), repeat=3)  # what every planned reader pays already
        size = os.path.getsize(os.path.join(d, "history", f"{key}.spm.npz"))
    return {"what": "resume_check", "shards": shards, "fingerprint_s": t_print, "manifest_load_s": t_manifest,
            "changes_tag_s": t_tag, "changes_size_s": t_size, "save_s": t_save, "load_saved_s": t_load,
            "copy_bytes": size}


def run(quick: bool = False) -> list[dict[str, Any]]:
    """10^4 shards (quick) or 10^5."""
    return [measure(10_000 if quick else 100_000)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=100_000)
    r = measure(p.parse_args().shards)
    n = r["shards"]
    print(f"N={n:,} shards")
    print(f"fingerprint (4 modes, once per process): {r['fingerprint_s'] * 1e3:.1f} ms = "
          f"{r['fingerprint_s'] / n * 1e9:.0f} ns x N; loading the manifest (side by side): "
          f"{r['manifest_load_s'] * 1e3:.0f} ms (fingerprint / load = {r['fingerprint_s'] / r['manifest_load_s']:.2f})")
    print(f"changes_since, tag: {r['changes_tag_s'] * 1e3:.1f} ms = {r['changes_tag_s'] / n * 1e9:.0f} ns x N; "
          f"size: {r['changes_size_s'] * 1e3:.1f} ms = {r['changes_size_s'] / n * 1e9:.0f} ns x N")
    print(f"save with history copy: {r['save_s'] * 1e3:.0f} ms; load_saved: {r['load_saved_s'] * 1e3:.0f} ms; "
          f"copy {r['copy_bytes'] / 1e6:.1f} MB ({r['copy_bytes'] / n:.0f} B x N)")


if __name__ == "__main__":
    main()
