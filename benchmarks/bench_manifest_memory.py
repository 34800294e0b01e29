"""What holding the data set's manifest costs one reader process: bytes per shard, measured.

A manifest of ``--shards`` (default 10^5) shards shaped like a real bucket's
(``s3://my-bucket/datasets/web-2026/train/shard-NNNNNN.tar``, 34-char quoted ETags, ``digest=<sha1>``)
is written once; then a fresh interpreter per measurement imports streampack, loads it and takes
the four fingerprints a planned reader takes (``ShardReader`` names its plan's manifest by them):

- ``rss``: the process's resident set before and after (psutil), with the loaded manifest alive;
- ``traced``: tracemalloc's current bytes held after the load and its peak during it;
- ``pickle``: the bytes a spawned DataLoader worker receives when the dataset carries the manifest.

Then a small data set is read by ``PackedDataset(manifest=<loopback URL>)`` through a DataLoader
with ``multiprocessing_context="spawn"`` and the loopback store counts the GETs of the manifest
file: what one rank pays (one fetch, not one more in every spawned worker).

Usage: ``python benchmarks/bench_manifest_memory.py [--shards 100000] [--workers 2] [--out FILE]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from report import emit  # benchmarks/report.py (this folder is on sys.path)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from helpers_data import bucket_manifest  # noqa: E402  (the tests' bucket-shaped manifest)

CHILD = r"""
import gc, json, pickle, sys, time, tracemalloc
import numpy as np, psutil
import streampack.io.manifest as mm
cfg = json.loads(sys.argv[1])
proc = psutil.Process()
if cfg["trace"]:
    tracemalloc.start()
gc.collect()
rss0 = proc.memory_info().rss
t0 = time.perf_counter()
m = mm.load_manifest(cfg["location"])
t1 = time.perf_counter()
prints = [m.fingerprint(mode) for mode in ("all", "tag", "size", "digest")]
t2 = time.perf_counter()
gc.collect()
out = {"rss_delta": proc.memory_info().rss - rss0, "shards": len(m), "prints": prints, "load_s": t1 - t0,
       "prints_s": t2 - t1}
if cfg["trace"]:
    out["traced"], out["traced_peak"] = tracemalloc.get_traced_memory()
    tracemalloc.stop()
out["pickle"] = len(pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL))
print(json.dumps(out))
"""

SPAWN = r"""
import json, sys
import torch
from streampack import PackedDataset
from streampack.options import ReadOptions, TopologyOptions
cfg = json.loads(sys.argv[1])
# rank 0 of 2 alone, no store: it counts rank 1's batches itself
ds = PackedDataset(cfg["urls"], capacity=256, epochs=1, seed=1,
                   read=ReadOptions(manifest=cfg["manifest"], cache_dir=cfg["cache"]),
                   topology=TopologyOptions(dp_rank=0, dp_size=2, equal_batches="count"))
loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=cfg["workers"],
                                     multiprocessing_context="spawn")
print(json.dumps({"batches": sum(1 for _ in loader)}))
"""


def _child(code: str, cfg: dict) -> dict:
    import streampack  # the children import the same streampack as this process (PYTHONPATH=... to compare)

    env = {**os.environ, "PYTHONPATH": str(Path(streampack.__file__).resolve().parent.parent)}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory(work: Path, shards: int) -> dict:
    location = work / f"manifest-{shards}"
    if not (location / "manifest.spm.npz").exists():
        bucket_manifest(location, shards)
    rss = _child(CHILD, {"location": str(location), "trace": False})
    traced = _child(CHILD, {"location": str(location), "trace": True})
    return {"shards": shards, "file_bytes": (location / "manifest.spm.npz").stat().st_size,
            "rss_B_per_shard": rss["rss_delta"] / shards, "rss_MB": rss["rss_delta"] / 2**20,
            "traced_B_per_shard": traced["traced"] / shards, "traced_MB": traced["traced"] / 2**20,
            "traced_peak_MB": traced["traced_peak"] / 2**20, "pickle_B_per_shard": rss["pickle"] / shards,
            "load_s": rss["load_s"], "fingerprints_s": rss["prints_s"]}


def spawn_fetches(work: Path, workers: int) -> dict:
    """GETs of the manifest file while one rank (dp_size=2) reads an epoch through ``workers``
    spawned DataLoader workers, over a loopback store."""
    from helpers_data import make_token_docs, serve_directory, write_tar_shards

    from streampack.cli.main import main as cli

    data = work / "spawn"
    paths = write_tar_shards(data / "d", make_token_docs(96, seed=2), 8) if not (data / "d").exists() \
        else sorted(str(p) for p in (data / "d").glob("*.tar"))
    with serve_directory(data) as store:
        urls = [f"{store.url}/d/{Path(p).name}" for p in paths]
        if cli(["index", *urls, "--out", str(data / "m"), "--quiet", "--pool", "threads"]) != 0:
            raise RuntimeError("streampack index failed")
        store.requests.clear()
        got = _child(SPAWN, {"urls": urls, "manifest": f"{store.url}/m", "workers": workers,
                             "cache": str(data / "cache")})
        fetches = sum(1 for path, _ in store.requests if path.endswith("/manifest.spm.npz"))
    return {"workers": workers, "manifest_fetches_per_rank": fetches, "batches": got["batches"]}


def table(mem: dict, spawn: dict) -> str:
    return "\n".join([
        f"Manifest of {mem['shards']:,} shards (file {mem['file_bytes'] / 2**20:.1f} MiB), held by one reader "
        "process after loading it and taking its four fingerprints:", "",
        "| measure | total | per shard |", "|---|---|---|",
        f"| RSS growth (psutil) | {mem['rss_MB']:.1f} MB | {mem['rss_B_per_shard']:.0f} B |",
        f"| traced, held (tracemalloc) | {mem['traced_MB']:.1f} MB | {mem['traced_B_per_shard']:.0f} B |",
        f"| traced, peak while loading | {mem['traced_peak_MB']:.1f} MB | "
        f"{mem['traced_peak_MB'] * 2**20 / mem['shards']:.0f} B |",
        f"| pickled (what a spawned worker receives) | {mem['pickle_B_per_shard'] * mem['shards'] / 2**20:.1f} MB | "
        f"{mem['pickle_B_per_shard']:.0f} B |", "",
        f"Loading took {mem['load_s']:.2f} s and the four fingerprints {mem['fingerprints_s']:.2f} s (wall, untraced).",
        "",
        f"One rank (dp_size=2) reading an epoch through {spawn['workers']} spawned DataLoader workers: "
        f"{spawn['manifest_fetches_per_rank']} GET(s) of the manifest file ({spawn['batches']} batches).",
    ])


def run(quick: bool = False) -> list[dict]:
    """``run_all`` rows: the memory of a 10^5-shard manifest (quick: 2x10^4) and the spawn fetch count."""
    work = Path(tempfile.gettempdir()) / "streampack-bench-manifest-memory"
    work.mkdir(parents=True, exist_ok=True)
    return [memory(work, 20_000 if quick else 100_000), spawn_fetches(work, 2)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=100_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "streampack-bench-manifest-memory"))
    ap.add_argument("--out")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    return emit(table(memory(work, args.shards), spawn_fetches(work, args.workers)), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
