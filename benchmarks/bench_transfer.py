"""What handing a PackedBatch from a DataLoader worker to the training process costs, per batch.

The same pre-built batches (8 x 4096 tokens; the worker only lays them out with ``pack_batch``)
cross from 1 or 2 workers three ways, side by side in one run:

- ``torch fd``: torch's default reduction (``file_descriptor`` sharing): every storage into a new
  shared-memory segment whose descriptor the training process fetches over a socket from the
  worker's ``resource_sharer`` thread.
- ``torch named``: each large storage in a new segment of torch's ``file_system`` sharing, which
  the receiver opens by name (the first worker batch starts ``torch_shm_manager``).
- ``ring``: :mod:`streampack.layout.shm_ring`: a batch's storages copied into a reused slot of the
  worker's ring, which the training process keeps mapped and releases when the batch is freed.

CPU per batch counts the training process and the workers (``RUSAGE_CHILDREN`` once they are
joined), worker start-up included; the loop reads every token once (as a copy to a GPU would).

Usage: ``python benchmarks/bench_transfer.py [--batches 400] [--quick]``
"""

from __future__ import annotations

import argparse
import resource
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np
from torch.utils.data import DataLoader, IterableDataset

from streampack.layout import shm_ring, transfer
from streampack.layout.batch import PackedBatch, pack_batch
from streampack.sample import Sample

CAPACITY, PACKS, DOCS_PER_PACK = 4096, 8, 8
WAYS = ("torch fd", "torch named", "ring")


def _packs() -> list[list[Sample]]:
    rng = np.random.default_rng(0)
    return [[Sample(key=f"{p}-{i}", url="/data/train-000001.tar", tokens=rng.integers(0, 50_000, 500))
             for i in range(DOCS_PER_PACK)] for p in range(PACKS)]


class _Batches(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        packs = _packs()
        for _ in range(self.n):
            yield pack_batch(packs, capacity=CAPACITY)


def _way(name: str) -> None:
    """Set up the hand-over ``name`` in this process (the workers are forked from it)."""
    if name == "torch fd":
        ForkingPickler._extra_reducers.pop(PackedBatch, None)
    else:
        transfer.register(PackedBatch)
    shm_ring._available = None if name == "ring" else False


def _cpu() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def measure(way: str, num_workers: int, n: int) -> dict[str, float]:
    _way(way)
    try:
        cpu, start = _cpu(), time.perf_counter()
        checksum = 0
        for batch in DataLoader(_Batches(n), batch_size=None, num_workers=num_workers):
            checksum += int(batch.input_ids[::512].sum())  # touch every page of the token rows
        wall, cpu = time.perf_counter() - start, _cpu() - cpu  # the workers are joined: counted
    finally:
        _way("ring")
    batches = n * max(num_workers, 1)
    return {"batches/s": batches / wall, "CPU ms/batch": 1e3 * cpu / batches}


def run(batches: int = 400, quick: bool = False) -> list[dict[str, object]]:
    n = 60 if quick else batches
    rows = []
    for workers in (1, 2):
        for way in WAYS:
            best = min((measure(way, workers, n) for _ in range(2)), key=lambda r: r["CPU ms/batch"])
            rows.append({"num_workers": workers, "hand-over": way, "batches/s": round(best["batches/s"]),
                         "CPU ms/batch (all processes)": round(best["CPU ms/batch"], 2)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=400, help="per worker")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rows = run(args.batches, args.quick)
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
