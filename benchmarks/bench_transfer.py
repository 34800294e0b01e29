"""What handing a PackedBatch from a DataLoader worker to the training process costs.

A worker sends every tensor storage of a batch through its own shared-memory segment (torch's
``ForkingPickler``), so the number of storages per batch, not their bytes, sets the price.
``pack_batch`` keeps its three ``[T]`` int64 fields on one storage and its int32 offsets on
another; the "one storage per field" row rebuilds the same batch with a fresh tensor per field
(what ``pack_batch`` did before). Same batches, same loader, side by side in one run.

Usage: ``python benchmarks/bench_transfer.py [--batches 400] [--quick]``
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from streampack.layout.batch import PackedBatch, pack_batch
from streampack.sample import Sample

CAPACITY, PACKS, DOCS_PER_PACK = 4096, 8, 8


def _packs() -> list[list[Sample]]:
    rng = np.random.default_rng(0)
    return [[Sample(key=f"{p}-{i}", url="/data/train-000001.tar", tokens=rng.integers(0, 50_000, 500))
             for i in range(DOCS_PER_PACK)] for p in range(PACKS)]


def _separate(batch: PackedBatch) -> PackedBatch:
    """The same batch with one fresh storage per tensor field."""
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return dataclasses.replace(batch, **{k: v.clone() for k, v in fields.items() if isinstance(v, torch.Tensor)})


class _Batches(IterableDataset):
    def __init__(self, n: int, separate: bool) -> None:
        self.n, self.separate = n, separate

    def __iter__(self):
        packs = _packs()
        for _ in range(self.n):
            batch = pack_batch(packs, capacity=CAPACITY)
            yield _separate(batch) if self.separate else batch


def rate(num_workers: int, separate: bool, n: int, repeats: int = 3) -> float:
    """Best batches/s over ``repeats`` passes (the first batch, worker start-up, excluded)."""
    best = 0.0
    for _ in range(repeats):
        it = iter(DataLoader(_Batches(n, separate), batch_size=None, num_workers=num_workers))
        next(it)
        start = time.perf_counter()
        count = sum(1 for _ in it)
        best = max(best, count / (time.perf_counter() - start))
    return best


def run(batches: int = 400, quick: bool = False) -> list[dict[str, object]]:
    n = 60 if quick else batches
    rows = []
    for workers in (0, 1, 2):
        one = rate(workers, False, n)
        sep = rate(workers, True, n)
        rows.append({"num_workers": workers, "batch": f"{PACKS} x {CAPACITY} tokens",
                     "batches/s, pack_batch (2 storages)": round(one), "batches/s, one storage per field": round(sep),
                     "ratio": round(one / sep, 2)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=400)
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
