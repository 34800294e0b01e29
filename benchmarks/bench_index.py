"""What the manifest and ``streampack index`` cost (numbers quoted in io/manifest.py, io/tar_sparse.py
and cli/index_cmd.py).

    python benchmarks/bench_index.py manifest --shards 100000
    python benchmarks/bench_index.py local --shards 200 --samples 1000 --jobs 2
    python benchmarks/bench_index.py http --shards 20 --samples 1000 --member 262144 --jobs 4
    python benchmarks/bench_index.py parquet --samples 20000
    python benchmarks/bench_index.py ranks --shards 2000 --samples 20 --ranks 1 2 4 8
    python benchmarks/bench_index.py merge --shards 100000 --ranks 64
    python benchmarks/bench_index.py pack --shards 16 --samples 500 --ranks 1 2 4 8

``parquet`` times one pre-tokenized parquet shard's index: the footer alone (row positions),
with each row's token count (the token list column's lengths, ``io.parquet.token_lengths``), and
a whole read of the shard through the reader's decoder, for scale.

``ranks`` runs ``streampack index --rank r --world-size W`` as W processes at once over a loopback server (a
job's ranks, simulated on one box) and reports per rank its CPU seconds, requests and shards, and rank 0's merge;
on a box with fewer cores than ranks the wall time says nothing about a real job, the CPU and requests per rank do.

``http`` serves the shards from a loopback server (Range support) and indexes them with
``--ranged always`` and ``never``; member data is written as file holes, so a 5 GB data set
takes no disk.
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def write_shard(path: str, samples: int, member: int, seed: int) -> None:
    """A webdataset tar: per sample a 100-token ``npy`` and a ``bin`` member of ``member``
    zero bytes, written as a hole."""
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        for i in range(samples):
            buf = io.BytesIO()
            np.save(buf, rng.integers(0, 50_000, int(rng.integers(50, 2000)), dtype=np.int32))
            for name, data, size in ((f"{i:08d}.npy", buf.getvalue(), None), (f"{i:08d}.bin", None, member)):
                info = tarfile.TarInfo(name)
                info.size = len(data) if data is not None else size
                f.write(info.tobuf(format=tarfile.USTAR_FORMAT))
                if data is not None:
                    f.write(data)
                else:
                    f.seek(size, io.SEEK_CUR)
                pad = -info.size % 512
                f.write(b"\0" * pad)
        f.write(b"\0" * 1024)


def make_set(directory: str, shards: int, samples: int, member: int) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, f"shard-{s:06d}.tar") for s in range(shards)]
    for s, p in enumerate(paths):
        write_shard(p, samples, member, s)
    return paths


def timed_index(urls: list[str], out: str, *extra: str) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "streampack", "index", *urls, "--out", out, "--quiet", *extra],
                   check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def bench_manifest(shards: int) -> list[dict[str, Any]]:
    from streampack.io.manifest import MANIFEST_FILE, Manifest, ShardTotals, save_manifest
    from streampack.io.storage import OpenOptions

    rng = np.random.default_rng(0)
    totals = [ShardTotals(url=f"s3://my-bucket/datasets/web-2026/train/shard-{i:06d}.tar",
                          size=int(rng.integers(1e8, 1e9)), tag=f'"{rng.bytes(16).hex()}-{int(rng.integers(1, 99))}"',
                          samples=int(rng.integers(5e4, 1e5)), tokens=int(rng.integers(1e7, 1e8)),
                          byte_cost=int(rng.integers(1e8, 1e9)),
                          digest="digest=" + rng.bytes(20).hex()) for i in range(shards)]
    with tempfile.TemporaryDirectory() as d:
        save_manifest(Manifest.of(d, totals), OpenOptions())
        size = os.path.getsize(os.path.join(d, MANIFEST_FILE))
        script = ("import os, time; from streampack.io.manifest import load_manifest\n"
                  "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**20\n"
                  "base = rss(); t = time.perf_counter()\n"
                  f"m = load_manifest({d!r}); dt = time.perf_counter() - t\n"
                  "print(dt, rss() - base, len(m))")
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    print(f"manifest of {shards} shards: {size} bytes ({size / shards:.1f} B/shard); "
          f"load {float(out[0]) * 1e3:.0f} ms, "
          f"RSS +{float(out[1]):.1f} MiB")
    return [{"what": "manifest", "shards": shards, "bytes_per_shard": round(size / shards, 1),
             "load_ms": round(float(out[0]) * 1e3, 1), "rss_mib": round(float(out[1]), 1)}]


def bench_local(shards: int, samples: int, jobs: int) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        urls = make_set(os.path.join(d, "d"), shards, samples, 0)
        for pool in ("threads", "processes"):
            dt = timed_index(urls, os.path.join(d, pool), "--pool", pool, "--jobs", str(jobs))
            print(f"local {shards}x{samples} samples, {pool} x{jobs}: {dt:.2f} s, {shards / dt:.1f} shards/s")
            rows.append({"what": f"local {pool}", "shards": shards, "samples": samples, "s": round(dt, 2)})
        dt = timed_index(urls, os.path.join(d, "threads"), "--jobs", str(jobs))
        print(f"local, again (resume: every index kept): {dt:.2f} s")
        rows.append({"what": "local again", "shards": shards, "samples": samples, "s": round(dt, 2)})
    return rows


def bench_http(shards: int, samples: int, member: int, jobs: int) -> list[dict[str, Any]]:
    rows = []
    from helpers_data import serve_directory

    with tempfile.TemporaryDirectory() as d:
        paths = make_set(os.path.join(d, "d"), shards, samples, member)
        size = sum(os.path.getsize(p) for p in paths)
        with serve_directory(os.path.join(d, "d")) as server:
            urls = server.urls_for(paths)
            for mode in ("never", "always", "auto"):
                server.requests.clear()
                dt = timed_index(urls, os.path.join(d, mode), "--ranged", mode, "--jobs", str(jobs))
                got = sum(int(b) - int(a) + 1 for _, r in server.requests if r
                          for a, b in [r.split("=")[1].split("-")])
                print(f"http {shards}x{samples}, members {member} B ({size / 1e6:.0f} MB), ranged={mode}, "
                      f"jobs {jobs}: {dt:.2f} s, {shards / dt:.2f} shards/s, {len(server.requests)} requests, "
                      f"{got / 1e6:.1f} MB fetched")
                rows.append({"what": f"http ranged={mode}", "shards": shards, "member": member, "s": round(dt, 2),
                             "requests": len(server.requests), "mb_fetched": round(got / 1e6, 1)})
    return rows


def bench_ranks(shards: int, samples: int, worlds: list[int]) -> list[dict[str, Any]]:
    from helpers_data import serve_directory

    rows = []
    with tempfile.TemporaryDirectory() as d:
        paths = make_set(os.path.join(d, "d"), shards, samples, 0)
        size = sum(os.path.getsize(p) for p in paths)
        position = {f"/{os.path.basename(p)}": i for i, p in enumerate(paths)}
        with serve_directory(os.path.join(d, "d")) as server:
            pattern = f"{server.url}/shard-{{{0:06d}..{shards - 1:06d}}}.tar"
            for world in worlds:
                server.requests.clear()
                out = os.path.join(d, f"w{world}")
                t = time.perf_counter()
                procs = [subprocess.Popen([sys.executable, "-m", "streampack", "index", pattern, "--out", out,
                                           "--quiet", "--rank", str(r), "--world-size", str(world)],
                                          stdout=subprocess.PIPE, text=True) for r in range(world)]
                cpu = []
                for p in procs:
                    _, status, usage = os.wait4(p.pid, 0)
                    p.returncode = os.waitstatus_to_exitcode(status)
                    cpu.append(usage.ru_utime + usage.ru_stime)
                wall = time.perf_counter() - t
                said = [p.stdout.read() for p in procs]
                if any(p.returncode for p in procs):
                    raise RuntimeError(f"a rank failed: {said}")
                merge = float(said[0].split("merged in ")[1].split(" s")[0]) if world > 1 else 0.0
                requests = [0] * world
                for path, _ in server.requests:
                    if path in position:
                        requests[position[path] % world] += 1
                print(f"ranks W={world}: {shards} shards x {samples} samples ({size / 1e6:.0f} MB) on loopback: wall "
                      f"{wall:.1f} s (all ranks on this box); per rank CPU {min(cpu):.1f}-{max(cpu):.1f} s, "
                      f"requests {min(requests)}-{max(requests)} ({sum(requests) / shards:.2f} per shard), "
                      f"shards {shards // world}-{-(-shards // world)}; rank 0's merge {merge:.2f} s")
                rows.append({"what": f"ranks W={world}", "shards": shards, "wall_s": round(wall, 1),
                             "cpu_s_per_rank_max": round(max(cpu), 2), "cpu_s_all_ranks": round(sum(cpu), 1),
                             "requests_per_rank_max": max(requests), "merge_s": merge})
    return rows


def bench_merge(shards: int, world: int) -> list[dict[str, Any]]:
    """Rank 0's merge alone: ``world`` parts of ``shards`` synthetic entries in all, merged in a fresh process."""
    from streampack.cli.index_parts import JobArguments, write_part
    from streampack.cli.ranks import JobRank
    from streampack.io.decode import DecodeOptions
    from streampack.io.index import index_decode
    from streampack.io.manifest import ShardTotals
    from streampack.io.storage import OpenOptions

    rng = np.random.default_rng(0)
    urls = [f"s3://my-bucket/datasets/web-2026/train/shard-{i:06d}.tar" for i in range(shards)]
    totals = [ShardTotals(url=u, size=int(rng.integers(1e8, 1e9)), tag=f'"{rng.bytes(16).hex()}-3"',
                          samples=int(rng.integers(5e4, 1e5)), tokens=int(rng.integers(1e7, 1e8)),
                          byte_cost=int(rng.integers(1e8, 1e9)), digest="digest=" + rng.bytes(20).hex())
              for u in urls]
    decode = index_decode(DecodeOptions())
    asked = JobArguments.of(urls, decode)
    with tempfile.TemporaryDirectory() as d:
        for r in range(world):
            write_part(d, JobRank(rank=r, world_size=world, source="bench"), asked, totals[r::world], decode,
                       OpenOptions())
        part_bytes = sum(e.stat().st_size for e in os.scandir(os.path.join(d, "parts")))
        with open(os.path.join(d, "urls.txt"), "w") as f:
            f.write("\n".join(urls))
        script = ("import os, time\n"
                  "from streampack.cli.index_parts import JobArguments, merge_parts\n"
                  "from streampack.cli.ranks import JobRank\n"
                  "from streampack.io.decode import DecodeOptions\n"
                  "from streampack.io.index import index_decode\n"
                  "from streampack.io.storage import OpenOptions\n"
                  "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**20\n"
                  f"urls = open({os.path.join(d, 'urls.txt')!r}).read().split('\\n')\n"
                  "decode = index_decode(DecodeOptions()); base = rss(); t = time.perf_counter()\n"
                  f"m = merge_parts({d!r}, JobRank(rank=0, world_size={world}, source='bench'), urls, "
                  "JobArguments.of(urls, decode), decode, OpenOptions(), timeout=0)\n"
                  "print(time.perf_counter() - t, rss() - base, len(m))")
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    seconds, rss, n = out.split()[-3:]
    print(f"merge of {shards} shards from {world} parts ({part_bytes / 1e6:.1f} MB of parts): {float(seconds):.2f} s, "
          f"RSS +{float(rss):.0f} MiB ({float(rss) * 2**20 / shards:.0f} B/shard)")
    return [{"what": f"merge W={world}", "shards": int(n), "s": round(float(seconds), 2),
             "rss_mib": round(float(rss), 1)}]


def bench_pack_ranks(shards: int, samples: int, worlds: list[int], capacity: int = 4096) -> list[dict[str, Any]]:
    """``streampack pack`` as W ranks (run one after another in this process, rank 0 last): the fill of the whole
    set and of each rank's share, beside one process's on the same documents (packs never span two shares)."""
    import json

    from helpers_data import write_tar_shards

    from streampack.cli.main import main as cli

    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(600), 1.0, shards * samples), 1, capacity).astype(int)
    docs = [rng.integers(0, 50_000, n).tolist() for n in lengths]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        urls = write_tar_shards(os.path.join(d, "in"), docs, shards, fmt="npy")
        for world in worlds:
            out = os.path.join(d, f"w{world}")
            for r in range(world - 1, -1, -1):
                flags = ["--rank", str(r), "--world-size", str(world)] if world > 1 else []
                if cli(["pack", *urls, "--out", out, "--capacity", str(capacity), "--no-progress", *flags]):
                    raise RuntimeError(f"pack rank {r} of {world} failed")
            with open(os.path.join(out, "manifest.json")) as f:
                m = json.load(f)
            per_rank = [r["fill"] for r in m.get("ranks", [])] or [m["metrics"]["fill"]]
            print(f"pack W={world}: {len(docs)} documents, capacity {capacity}: fill {m['metrics']['fill']:.2%}, "
                  f"per rank {min(per_rank):.2%}-{max(per_rank):.2%}, {m['num_packs']} packs")
            rows.append({"what": f"pack W={world}", "fill": round(m["metrics"]["fill"], 4),
                         "fill_rank_min": round(min(per_rank), 4), "packs": m["num_packs"]})
    return rows


def bench_parquet(samples: int, mean: int = 600) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from streampack.io.decode import DecodeOptions
    from streampack.io.index import build_index
    from streampack.io.parquet import iter_parquet_items

    rng = np.random.default_rng(0)
    lengths = np.maximum(1, rng.lognormal(np.log(mean), 1.0, samples)).astype(np.int64)
    values = rng.integers(0, 50_000, int(lengths.sum()), dtype=np.int32)
    column = pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)), values)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "shard.parquet")
        pq.write_table(pa.table({"input_ids": column, "id": np.arange(samples)}), path, row_group_size=1000)
        for case, work in (("footer only (row positions)", lambda: build_index(path, lengths=False)),
                           ("with token counts", lambda: build_index(path)),
                           ("whole read through the reader", lambda: sum(1 for _ in iter_parquet_items(
                               open(path, "rb"), DecodeOptions(), url=path, start=0, end=None)))):
            best = min(_timed(work) for _ in range(3))
            rows.append({"case": f"parquet index, {samples:,} rows x ~{mean} ids ({os.path.getsize(path) / 1e6:.0f} MB): "
                                 f"{case}", "seconds": round(best, 4)})
            print(f"{rows[-1]['case']}: {best:.4f} s")
    return rows


def _timed(work: Any) -> float:
    t = time.perf_counter()
    work()
    return time.perf_counter() - t


def run(quick: bool = False) -> list[dict[str, Any]]:
    """The manifest at 10^4 (quick) or 10^5 shards, and a local build; over HTTP only in the full run."""
    if quick:
        return bench_manifest(10_000) + bench_local(10, 200, 2)
    return bench_manifest(100_000) + bench_local(100, 1000, 2) + bench_http(20, 1000, 0, 4) + \
        bench_http(20, 100, 2 << 20, 4) + bench_ranks(400, 20, [1, 4])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("manifest", "local", "http", "parquet", "ranks", "merge", "pack"))
    p.add_argument("--shards", type=int, default=20)
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--member", type=int, default=0)
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8], help="ranks: world sizes to run")
    a = p.parse_args()
    if a.what == "manifest":
        bench_manifest(a.shards)
    elif a.what == "parquet":
        bench_parquet(a.samples)
    elif a.what == "ranks":
        bench_ranks(a.shards, a.samples, a.ranks)
    elif a.what == "merge":
        bench_merge(a.shards, a.ranks[0])
    elif a.what == "pack":
        bench_pack_ranks(a.shards, a.samples, a.ranks)
    elif a.what == "local":
        bench_local(a.shards, a.samples, a.jobs)
    else:
        bench_http(a.shards, a.samples, a.member, a.jobs)
    print(f"(peak RSS of this process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")


if __name__ == "__main__":
    main()
