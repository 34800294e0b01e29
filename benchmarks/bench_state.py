"""Resume-state size and the cost of equal batch counts: what a checkpoint pays per worker.

- ``state``: ``len(torch.save(ds.state_dict()))`` of one reader (one DataLoader worker), the
  largest of several checkpoints taken mid-stream, at capacities 4k, 32k and 128k (window
  1024; and 32k with window 256), lognormal document lengths with mean ``capacity / 16``
  (sigma 1, so some documents are split). ``refs`` is the library's state (carried samples
  as references); ``tokens`` is the same graph with a user node stage, which keeps storing
  tokens (what every state stored before). Also the time to restore from the largest state.
- ``long document``: one 4M-token document under ``overlong="split"`` at capacity 4096,
  checkpointed while its chunks are being emitted.
- ``plan`` (``--plan``): time to plan one finite epoch (every reader simulates every reader's
  packer) and the filler batches it leaves, against the fewest possible.
- ``sync`` (``--sync``): per-step cost of ``streampack.sync_batches`` (one all-reduce) on gloo
  with 2 local processes.

    python benchmarks/bench_state.py               # state sizes (~1 min on 2 cores)
    python benchmarks/bench_state.py --plan --sync
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
from report import emit_rows  # noqa: E402  (benchmarks/report.py; this folder is on sys.path)

from streampack.dataset import PackedDataset
from streampack.nodes.stages import MapSamples, NodeStage
from streampack.options import PackOptions
from streampack.plan.state import state_nbytes

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def write_shards(directory: str, lengths: np.ndarray, num_shards: int = 4, seed: int = 0) -> list[str]:
    from helpers_data import write_tar_shards

    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 30_000, int(n), dtype=np.int32) for n in lengths]
    return write_tar_shards(directory, docs, num_shards)  # type: ignore[arg-type]


def lognormal(n: int, mean: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.maximum(1, rng.lognormal(np.log(mean) - 0.5, 1.0, n)).astype(np.int64)


def _largest_state(ds: PackedDataset, checkpoints: list[int]) -> tuple[int, dict[str, Any]]:
    it = iter(ds)
    best, best_state, step = 0, {}, 0
    for stop in checkpoints:
        while step < stop and next(it, None) is not None:
            step += 1
        state = ds.state_dict()
        size = state_nbytes(state)
        if size > best:
            best, best_state = size, state
    return best, best_state


def state_rows(capacity: int, window: int, docs: int, directory: str) -> list[dict[str, Any]]:
    urls = write_shards(directory, lognormal(docs, capacity / 16))
    rows = []
    for mode, stages in (("refs", ()), ("tokens", (NodeStage(lambda up: MapSamples(up, lambda s: s)),))):
        def make() -> PackedDataset:
            return PackedDataset(urls, capacity=capacity, stages=list(stages), packing=PackOptions(window=window))

        size, state = _largest_state(make(), [1, 3, 10, 30])
        buf = io.BytesIO()
        torch.save(state, buf)
        start = time.perf_counter()
        buf.seek(0)
        fresh = make()
        fresh.load_state_dict(torch.load(buf, weights_only=True))
        next(iter(fresh))
        rows.append({"case": f"state per worker, capacity {capacity}, window {window}", "mode": mode,
                     "state_bytes": size, "restore_seconds": time.perf_counter() - start})
    return rows


def long_document_rows(directory: str, total: int = 4_000_000, capacity: int = 4096) -> list[dict[str, Any]]:
    lengths = np.concatenate([lognormal(50, 600), [total], lognormal(50, 600, seed=1)])
    urls = write_shards(directory, lengths, num_shards=1)
    rows = []
    for mode, stages in (("refs", ()), ("tokens", (NodeStage(lambda up: MapSamples(up, lambda s: s)),))):
        ds = PackedDataset(urls, capacity=capacity, shuffle=False, stages=list(stages), packing=PackOptions(window=256))
        size, _ = _largest_state(ds, [5, 50, 200, 600])
        rows.append({"case": f"one {total:,}-token document, overlong='split', capacity {capacity}",
                     "mode": mode, "state_bytes": size})
    return rows


def plan_rows(samples: int, ranks: tuple[int, ...], workers: int = 2, capacity: int = 4096) -> list[dict[str, Any]]:
    """Plan one finite epoch of ``samples`` lognormal(600) samples in 16 shards: one reader's own
    plan (what a distributed run pays, the counts agreed through the store) and the fallback
    without an agreement (every reader counts every reader: what this in-process run pays)."""
    from streampack.io.index import ShardIndex
    from streampack.io.manifest import Manifest, ShardTotals
    from streampack.io.storage import ShardStat
    from streampack.packing.window_rounds import PackerRules
    from streampack.plan.epoch_plan import Counting, EpochPlanner

    lengths = lognormal(samples, 600)
    shards = np.array_split(lengths, 16)
    indexes = [ShardIndex(url=f"s{i}.tar", fingerprint="", offsets=np.arange(len(s), dtype=np.int64),
                          lengths=s.astype(np.int32), end=len(s)) for i, s in enumerate(shards)]
    manifest = Manifest.of("", [ShardTotals.of(ix, ShardStat(size=ix.end, tag="")) for ix in indexes])
    rows = []
    for dp in ranks:
        counting = Counting(rules=PackerRules(capacity=capacity, window=1024), max_len=capacity, policy="split",
                            packs_per_batch=2)
        everyone = EpochPlanner(manifest, lambda i: indexes[i], seed=0, shuffle=True, dp_size=dp,
                                num_workers=workers, counting=counting)
        start = time.perf_counter()
        plan = everyone.plan(0, 0)
        settled = plan.quota.get()  # settled now, as when the reader's data runs out
        seconds = time.perf_counter() - start
        batches = sum(everyone.count(0, g) for g in range(dp * workers))
        own = EpochPlanner(manifest, lambda i: indexes[i], seed=0, shuffle=True, dp_size=dp, num_workers=workers,
                           counting=counting, agree=lambda key, r, w, n, c: _Agreed(target=c * n, workers=(c,) * n))
        start = time.perf_counter()
        own.plan(0, 0).quota.get()
        mine = time.perf_counter() - start
        rows.append({"case": f"plan one epoch, {samples:,} samples, {dp} ranks x {workers} workers",
                     "seconds_everyone": seconds, "us_per_sample": 1e6 * seconds / samples,
                     "seconds_own_share": mine, "batches": batches,
                     "fillers": plan.quota.info["fillers_all_ranks"],
                     "fewest_possible": plan.quota.info["min_fillers_all_ranks"], "quota": settled})
    return rows


@dataclasses.dataclass(frozen=True)
class _Agreed:
    target: int
    workers: tuple[int, ...]


def _sync_worker(rank: int, world: int, init: str, steps: int, out: str) -> None:
    import torch.distributed as dist

    from streampack.plan.sync import sync_batches

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)

    class Tiny:
        def filler(self) -> int:
            return 0

    dist.barrier()
    start = time.perf_counter()
    n = sum(1 for _ in sync_batches(range(steps - rank), Tiny()))  # type: ignore[arg-type]
    seconds = time.perf_counter() - start
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"steps": n, "seconds": seconds}, f)
    dist.destroy_process_group()


def sync_rows(steps: int = 2000) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "sync.json")
        mp.spawn(_sync_worker, args=(2, f"file://{tmp}/init", steps, out), nprocs=2)
        with open(out) as f:
            got = json.load(f)
    return [{"case": "sync_batches, gloo, 2 processes", "steps": got["steps"],
             "us_per_step": 1e6 * got["seconds"] / got["steps"]}]


def run(quick: bool = False, plan: bool = True, sync: bool = True) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        cases = [(4096, 1024), (32768, 256), (32768, 1024), (131072, 1024)]
        for i, (capacity, window) in enumerate(cases[:2] if quick else cases):
            rows += state_rows(capacity, window, int(window * 1.5), os.path.join(tmp, f"c{i}"))
        rows += long_document_rows(os.path.join(tmp, "long"), total=400_000 if quick else 4_000_000)
    if plan:
        rows += plan_rows(20_000 if quick else 1_000_000, (2, 8) if quick else (2, 8, 64))
    if sync:
        rows += sync_rows(200 if quick else 2000)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--plan", action="store_true", help="also time epoch planning")
    parser.add_argument("--sync", action="store_true", help="also time sync_batches on gloo")
    parser.add_argument("--out", help="write the rows as json here")
    args = parser.parse_args()
    rows = run(quick=args.quick, plan=args.plan, sync=args.sync)
    emit_rows(rows, args.out)


if __name__ == "__main__":
    main()
