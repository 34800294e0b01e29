"""What one reader of a big world pays to reach its first batch (issue 17): requests, bytes, CPU,
RSS and time, over a loopback HTTP store that counts every request.

The data set is ``--shards`` tiny pre-tokenized jsonl shards (default 20,000 of 8 samples) served
over loopback HTTP, with a prebuilt manifest (``streampack index`` equivalent) served beside them.
Each measurement is a fresh interpreter playing reader ``dp_rank=0`` of ``dp_size=D``
(``num_workers=0``): an infinite stream, a finite planned epoch and an elastic start (the states
of every reader of a run on ``D/2`` ranks — at most ``--old-max``, 64: each old reader is run to
its first batch to make its state — or 2 for D=1, resumed on D). No ``torch.distributed``
runs here, so the store agreement (``streampack.plan.agree``) is absent; without it a reader would
count every reader's batches (the documented fallback, O(samples)). To measure the path a
distributed run takes, the child injects a fake agreement that returns the reader's own count
as its rank's (what one store round returns, minus the round itself) — said in the table.
Cold: remote shards without a manifest (refused, naming ``streampack index``), and local shards
without one (built once under a lock in the cache directory: reads every shard).

Then the per-reader costs are extrapolated to N=10^5 shards, T=10^9 samples, G=8,192 readers
with measured constants (``--extrapolate`` only: no store).

Usage: ``python benchmarks/bench_scale.py [--shards 20000] [--sizes 1,64,1024] [--work DIR] [--out FILE]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from report import emit  # benchmarks/report.py (this folder is on sys.path)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

CHILD = r"""
import json, resource, sys, time, types, urllib.request
cfg = json.loads(sys.argv[1])
t0 = time.perf_counter(); c0 = time.process_time()
import torch
import streampack.dataset as dataset, streampack.graph.build as graph, streampack.plan.reshard as reshard
from streampack import PackedDataset
from streampack.options import PackOptions, ReadOptions, TopologyOptions
if cfg["fake_agree"]:
    own = lambda key, r, w, n, c: types.SimpleNamespace(target=c, workers=(c,))
    real = graph.make_planner
    def make_planner(*a, **kw):
        kw["agree"] = kw.get("agree") or own
        return real(*a, **kw)
    graph.make_planner = reshard.make_planner = make_planner
    dataset._agreement = lambda *a, **kw: object()  # the job's store, as the dataset sees it: plan, not refuse
urls = open(cfg["urls"]).read().split()
kw = dict(capacity=1024, seed=1, packing=PackOptions(window=64), topology=TopologyOptions(dp_rank=0, dp_size=cfg["D"]),
          read=ReadOptions(manifest=cfg["manifest"], cache_dir=cfg["cache"]),
          epochs=None if cfg["mode"] == "infinite" else 1)
t1 = time.perf_counter()
try:
    ds = PackedDataset(urls, **kw)
    if cfg["mode"] == "elastic":
        ds.load_state_dict(torch.load(cfg["states"], weights_only=True))
    batch = next(iter(ds))
    first = time.perf_counter() - t1
    urllib.request.urlopen(cfg["mark"]).read()  # the store notes its request count at the first batch
    out = {"ok": True, "tokens": batch.num_tokens}
    late = getattr(ds._graph.nodes.get("collate"), "late", None)
    t2 = time.perf_counter()
    out["quota"] = late.get() if late is not None else None  # the background count and agreement, to the end
    out["settle_s"] = time.perf_counter() - t2
    out["plan"] = ds.metrics().get("plan", {})
except ValueError as e:
    first = time.perf_counter() - t1
    out = {"ok": False, "error": str(e)[:100]}
    urllib.request.urlopen(cfg["mark"]).read()
out.update(first_batch_s=first, total_s=time.perf_counter() - t0,
           cpu_s=time.process_time() - c0, rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
print(json.dumps(out))
"""


def write_shards(root: Path, n: int, per: int) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(n):
        p = root / f"s{s:06d}.jsonl"
        if not p.exists():
            lines = [json.dumps({"input_ids": [(s * 7 + i * 13 + k) % 997 for k in range(8 + (s + i) % 40)]})
                     for i in range(per)]
            p.write_text("\n".join(lines) + "\n")
        paths.append(p)
    return paths


class Counting:
    """A loopback store (tests/helpers_data.RangeRequestHandler) that counts requests and body bytes."""

    def __init__(self, directory: Path, port: int = 0) -> None:
        import functools
        import http.server

        from helpers_data import RangeRequestHandler

        counter = self

        class Handler(RangeRequestHandler):
            def send_header(self, key: str, value: str) -> None:
                if key.lower() == "content-length" and self.command == "GET":
                    with counter.lock:
                        counter.bytes += int(value)
                super().send_header(key, value)

            def send_head(self):  # type: ignore[no-untyped-def]
                if self.path.startswith("/__mark__"):  # not a data request: the count at a child's first batch
                    with counter.lock:
                        counter.mark = counter.requests
                    self.send_response(204)
                    self.end_headers()
                    return None
                with counter.lock:
                    counter.requests += 1
                return super().send_head()

        self.lock, self.requests, self.bytes, self.mark = threading.Lock(), 0, 0, 0
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), functools.partial(Handler, directory=str(directory)))
        self.server.requests = []  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def snapshot(self) -> tuple[int, int]:
        with self.lock:
            return self.requests, self.bytes


def child(cfg: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def old_states(urls: list[str], manifest: str, dp_size: int, path: Path) -> None:
    """The states of every reader of a run on ``dp_size`` ranks, each after its first batch (the
    old readers plan with the same fake agreement as the measured ones)."""
    import types

    import torch

    import streampack.dataset as dataset
    import streampack.graph.build as graph
    import streampack.plan.reshard as reshard
    from streampack import PackedDataset
    from streampack.options import PackOptions, ReadOptions, TopologyOptions

    real, real_store = graph.make_planner, dataset._agreement

    def make_planner(*a, **kw):  # type: ignore[no-untyped-def]
        kw["agree"] = kw.get("agree") or (lambda key, r, w, n, c: types.SimpleNamespace(target=c, workers=(c,)))
        return real(*a, **kw)

    graph.make_planner = reshard.make_planner = make_planner
    dataset._agreement = lambda *a, **kw: object()  # a store for the dataset to plan with (the counts: above)
    states = []
    try:
        for r in range(dp_size):
            ds = PackedDataset(urls, capacity=1024, seed=1, epochs=1, read=ReadOptions(manifest=manifest),
                               packing=PackOptions(window=64), topology=TopologyOptions(dp_rank=r, dp_size=dp_size))
            next(iter(ds))
            states.append(ds.state_dict())
    finally:
        graph.make_planner = reshard.make_planner = real
        dataset._agreement = real_store
    torch.save(states, path)


def local_manifest(paths: list[Path], urls: list[str], location: Path) -> None:
    """What ``streampack index URLS --out DIR`` writes, made from the local files the store serves
    (the store's identity of a file is its size and Last-Modified date): building it through the
    loopback store takes ~2 s per 10 shards on this loaded box, and it is not what is measured."""
    import dataclasses
    import email.utils

    from streampack.io.decode import DecodeOptions
    from streampack.io.index import build_index, cache_path, encode_index, fingerprint_of
    from streampack.io.index_cache import save_arrays
    from streampack.io.manifest import SHARDS_DIR, Manifest, ShardTotals, save_manifest
    from streampack.io.storage import OpenOptions, ShardStat

    decode, opts, totals = DecodeOptions(), OpenOptions(), []
    for path, url in zip(paths, urls):
        st = path.stat()
        ident = ShardStat(size=st.st_size, tag=email.utils.formatdate(st.st_mtime, usegmt=True))
        index = build_index(str(path), fingerprint=fingerprint_of(url, decode, ident), decode=decode)
        index = dataclasses.replace(index, url=url)
        save_arrays(cache_path(url, str(location / SHARDS_DIR)), encode_index(index), opts)
        totals.append(ShardTotals.of(index, ident))
    save_manifest(Manifest.of(str(location), totals, decode), opts)


def measure(args: argparse.Namespace) -> list[dict]:
    work = Path(args.work)
    paths = write_shards(work / "data", args.shards, args.per_shard)
    store = Counting(work / "data", port=args.port)
    urls = [f"{store.url}/{p.name}" for p in paths]
    (work / "urls.txt").write_text("\n".join(urls))
    mdir = work / "data" / "manifest"
    if args.rebuild or args.port == 0 or not (mdir / "manifest.spm.npz").exists() or not (work / "port").exists() or \
            (work / "port").read_text() != store.url:  # the manifest names the URLs, port included
        t = time.perf_counter()
        local_manifest(paths, urls, mdir)
        (work / "port").write_text(store.url)
        print(f"# manifest of {len(urls)} shards built in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    manifest = f"{store.url}/manifest"
    rows = []
    for d in args.sizes:
        states = work / f"states-{d}.pt"
        if not states.exists():  # in a child process: the old readers' background counts end with it, so
            # none of their requests overlaps a measurement
            import multiprocessing

            maker = multiprocessing.get_context("fork").Process(
                target=old_states, args=(urls, manifest, min(max(d // 2, 2), args.old_max), states))
            maker.start()
            maker.join()
            time.sleep(1.0)
        for mode in ("infinite", "finite", "elastic"):
            before = store.snapshot()
            cfg = {"mode": mode, "D": d, "urls": str(work / "urls.txt"), "manifest": None if mode == "infinite" else manifest,
                   "cache": str(work / "cache"), "states": str(states), "fake_agree": mode != "infinite",
                   "mark": f"{store.url}/__mark__"}
            got = child(cfg)
            after = store.snapshot()
            rows.append({"mode": mode, "D": d, "requests": store.mark - before[0], "later": after[0] - store.mark,
                         "MB": (after[1] - before[1]) / 2**20,
                         **{k: got.get(k) for k in ("first_batch_s", "settle_s", "cpu_s", "rss_mb", "ok")}})
    before = store.snapshot()
    cold = child({"mode": "finite", "D": 64, "urls": str(work / "urls.txt"), "manifest": None,
                  "cache": str(work / "cache"), "states": "", "fake_agree": True, "mark": f"{store.url}/__mark__"})
    rows.append({"mode": "cold remote, no manifest", "D": 64, "requests": store.snapshot()[0] - before[0], "later": 0,
                 "MB": 0.0, **{k: cold.get(k) for k in ("first_batch_s", "settle_s", "cpu_s", "rss_mb", "ok")}})
    local = work / "local-urls.txt"
    local.write_text("\n".join(str(p) for p in paths))
    with tempfile.TemporaryDirectory() as cache:
        got = child({"mode": "finite", "D": 64, "urls": str(local), "manifest": None, "cache": cache, "states": "",
                     "fake_agree": True, "mark": f"{store.url}/__mark__"})
    rows.append({"mode": "cold local, built once", "D": 64, "requests": 0, "later": 0, "MB": 0.0,
                 **{k: got.get(k) for k in ("first_batch_s", "settle_s", "cpu_s", "rss_mb", "ok")}})
    return rows


def constants() -> dict[str, float]:
    """Measured per-unit costs of planning: prefix sums and cut per shard, packer count per sample."""
    import numpy as np

    from streampack.packing.window_rounds import PackerRules
    from streampack.plan.epoch_plan import Counting as Count
    from streampack.plan.epoch_plan import count_batches
    from streampack.plan.sharding import PrefixCut, epoch_permutation

    n = 100_000
    rng = np.random.default_rng(0)
    samples = rng.integers(5_000, 15_000, n)
    costs = samples * 600
    t = time.perf_counter()
    cut = PrefixCut(epoch_permutation(n, seed=1, epoch=0), samples, costs, lambda s: np.full(samples[s], 600))
    cut.bounds(1024, 8, 4321)
    per_shard = (time.perf_counter() - t) / n
    lengths = np.maximum(1, rng.lognormal(np.log(600), 1.0, 200_000)).astype(np.int64)
    counting = Count(rules=PackerRules(capacity=4096, window=1024, algorithm="bfd", align=1, seed=1, max_wait=8,
                                       slack=None), max_len=4096, policy="split", packs_per_batch=1)
    count_batches(counting, 0, lengths[:1000])  # compile
    t = time.perf_counter()
    count_batches(counting, 0, lengths)
    per_sample = (time.perf_counter() - t) / len(lengths)
    import tracemalloc

    own = lengths.astype(np.int32)  # what a late count holds: its own samples' int32 lengths, then the count's
    tracemalloc.start()  # temporaries (no shard index kept)
    count_batches(counting, 0, own)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"cut_s_per_shard": per_shard, "count_s_per_sample": per_sample,
            "count_bytes_per_sample": 4 + peak / len(own), **manifest_bytes()}


def manifest_bytes(shards: int = 20_000) -> dict[str, float]:
    """Measured bytes per shard a loaded manifest holds (tracemalloc, after its four fingerprints)
    and its peak while loading, on a manifest shaped like a bucket's
    (``bench_manifest_memory.py`` measures RSS in a fresh process too)."""
    import gc
    import tracemalloc

    from bench_manifest_memory import synthetic_manifest

    from streampack.io.manifest import load_manifest

    with tempfile.TemporaryDirectory() as location:
        synthetic_manifest(Path(location), shards)
        gc.collect()
        tracemalloc.start()
        m = load_manifest(location)
        for mode in ("all", "tag", "size", "digest"):
            m.fingerprint(mode)
        gc.collect()
        held, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return {"manifest_bytes_per_shard": held / shards, "manifest_peak_bytes_per_shard": peak / shards}


def extrapolate(c: dict[str, float], n: int = 100_000, t: int = 10**9, g: int = 8192) -> str:
    own_samples = t / g
    cpu = c["cut_s_per_shard"] * n + c["count_s_per_sample"] * own_samples
    manifest = n * c["manifest_bytes_per_shard"]
    count = own_samples * c["count_bytes_per_sample"]
    return "\n".join([
        f"Extrapolated per reader at N={n:,} shards, T={t:.0e} samples, G={g:,} readers (measured constants: "
        f"cut {c['cut_s_per_shard'] * 1e9:.0f} ns per shard, manifest {c['manifest_bytes_per_shard']:.0f} B held "
        f"per shard, packer count {c['count_s_per_sample'] * 1e6:.2f} µs "
        f"and {c['count_bytes_per_sample']:.0f} B at its peak per own sample):",
        "",
        "| cost | formula | value |",
        "|---|---|---|",
        "| requests before the first batch, beyond infinite mode | 1 (manifest) + ≤ 4 (boundary indexes) | 5 |",
        f"| requests after the first batch, in the background | ⌈N/G⌉ (own indexes, boundary ones reused) + 5 "
        f"(store round) | {int(-(-n // g)) + 5} |",
        f"| plan CPU per epoch | {c['cut_s_per_shard'] * 1e9:.0f} ns · N (before the first batch) + "
        f"{c['count_s_per_sample'] * 1e6:.2f} µs · T/G (background) | {c['cut_s_per_shard'] * n:.3f} s + "
        f"{c['count_s_per_sample'] * own_samples:.2f} s = {cpu:.2f} s |",
        f"| plan memory | {c['manifest_bytes_per_shard']:.0f} B · N (the manifest as held, measured; "
        f"{c['manifest_peak_bytes_per_shard']:.0f} B · N at its load's peak) + "
        f"{c['count_bytes_per_sample']:.0f} B · T/G "
        f"(the count's peak: own int32 lengths + the packer's temporaries; no index kept) | "
        f"{manifest / 2**20:.0f} + {count / 2**20:.1f} = {(manifest + count) / 2**20:.0f} MB |",
        "| elastic start | the above; the old readers' plans come from their states (``work_ends``): no index read "
        "(a never-started old reader: its plan's <= 2 boundary indexes) | 5 requests before the first batch |",
    ])


def table(rows: list[dict]) -> str:
    lines = ["| mode | D | requests to the first batch | after it (count, agreement) | MB read | first batch s | "
             "quota settled s later | CPU s | RSS MB | ok |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        settle = "" if r.get("settle_s") is None else f"{r['settle_s']:.2f}"
        lines.append(f"| {r['mode']} | {r['D']} | {r['requests']} | {r['later']} | {r['MB']:.2f} | "
                     f"{r['first_batch_s']:.2f} | {settle} | {r['cpu_s']:.2f} | {r['rss_mb']:.0f} | {r['ok']} |")
    return "\n".join(lines)


def run(quick: bool = False) -> list[dict]:
    """``run_all`` rows: the measurements (quick: 500 shards, D in {1, 16}) and the extrapolation."""
    args = argparse.Namespace(shards=500 if quick else 20_000, per_shard=8, sizes=[1, 16] if quick else [1, 64, 1024],
                              work=str(Path(tempfile.gettempdir()) / f"streampack-bench-scale-{'quick' if quick else 'full'}"),
                              rebuild=False, port=0, old_max=8 if quick else 64)
    c = constants()
    return measure(args) + [{"mode": "extrapolated N=1e5 T=1e9 G=8192", **c}]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=20_000)
    ap.add_argument("--per-shard", type=int, default=8)
    ap.add_argument("--sizes", default="1,64,1024")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "streampack-bench-scale"))
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--port", type=int, default=18734, help="the store's port (the manifest names it)")
    ap.add_argument("--old-max", type=int, default=64, help="most ranks of the old run of an elastic start")
    ap.add_argument("--extrapolate", action="store_true", help="only the measured constants and the extrapolation")
    ap.add_argument("--out")
    args = ap.parse_args()
    args.sizes = [int(x) for x in args.sizes.split(",")]
    parts = []
    if not args.extrapolate:
        rows = measure(args)
        parts.append(f"One reader (dp_rank=0 of D, no workers) of {args.shards:,} jsonl shards x {args.per_shard} samples "
                     f"over loopback HTTP; finite and elastic use a fake store agreement (the reader's own count):\n")
        parts.append(table(rows))
    parts.append("\n" + extrapolate(constants()))
    return emit("\n".join(parts), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
