"""Why a DataLoader worker's batch costs more than the same batch in-process: page faults.

Runs one epoch of the peers' corpus (``benchmarks/peers/corpus.py``: pre-tokenized tar shards,
lognormal lengths, mean 600; capacity 4096, window 1024, 8 packs a batch) ``--epochs`` times,
in-process (w0) and under ``StatefulDataLoader(num_workers=2, prefetch_factor=8)`` (w2), each in a
fresh process, and reports for each reading thread (the process's own for w0, each worker's
main thread for w2): batches, CPU of the dataset's ``next()`` calls, page faults, and how much
of both the layout (``pack_slices``) took. The first in-process epoch of a fresh process and
every worker epoch start from an empty heap; a later in-process epoch shows the warm state.
``--fault`` measures what one page fault costs here (touching fresh anonymous memory).

    PYTHONPATH=. python benchmarks/profile_worker_faults.py [--tokens 4e6] [--epochs 2] [--dir DIR]

Run it with another checkout first on ``PYTHONPATH`` to compare trees.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def fault_cost_us(megabytes: int = 100, rounds: int = 3) -> float:
    """Median µs per page fault when touching fresh anonymous memory (zeroing included)."""
    import numpy as np

    costs = []
    for _ in range(rounds):
        memory = mmap.mmap(-1, megabytes << 20)
        pages = np.frombuffer(memory, np.uint8)
        t = time.perf_counter()
        pages[::mmap.PAGESIZE] = 1
        costs.append((time.perf_counter() - t) / (megabytes * (1 << 20) // mmap.PAGESIZE) * 1e6)
        del pages
        memory.close()
    return sorted(costs)[len(costs) // 2]


def _child(urls: list[str], workers: int, epochs: int) -> None:
    """One fresh process: ``epochs`` epochs, one JSON line per reading thread and epoch."""
    import torch.utils.data as tud
    from torchdata.stateful_dataloader import StatefulDataLoader

    import streampack.nodes.row_collate as row_collate
    from streampack import PackedDataset
    from streampack.options import PackOptions

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt

    layout = {"faults": 0, "cpu": 0.0}
    lay_out = row_collate.pack_slices

    def measured(*args, **kwargs):
        f, t = faults(), time.thread_time()
        out = lay_out(*args, **kwargs)
        layout["faults"] += faults() - f
        layout["cpu"] += time.thread_time() - t
        return out

    row_collate.pack_slices = measured

    class Measured(PackedDataset):
        def __iter__(self):
            layout.update(faults=0, cpu=0.0)
            inner, batches, cpu, f0 = super().__iter__(), 0, 0.0, faults()
            while True:
                t = time.thread_time()
                try:
                    batch = next(inner)
                except StopIteration:
                    break
                cpu += time.thread_time() - t
                batches += 1
                yield batch
            info = tud.get_worker_info()
            print(json.dumps({"where": "worker" if info else "in-process", "batches": batches,
                              "next_ms": cpu * 1e3, "faults": faults() - f0, "layout_ms": layout["cpu"] * 1e3,
                              "layout_faults": layout["faults"]}), flush=True)

    for _ in range(epochs):
        ds = Measured(urls, capacity=4096, epochs=1, seed=0, packs_per_batch=8, packing=PackOptions(window=1024))
        loader = StatefulDataLoader(ds, batch_size=None, num_workers=workers,
                                    prefetch_factor=8 if workers else None)
        for _batch in loader:
            pass
        del loader


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=float, default=4e6)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="fresh processes per case, interleaved")
    ap.add_argument("--dir", default=None, help="keep the written corpus here and reuse it")
    ap.add_argument("--fault", action="store_true", help="also measure one page fault's cost")
    ap.add_argument("--child", nargs=3, metavar=("URLS", "WORKERS", "EPOCHS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(json.loads(args.child[0]), int(args.child[1]), int(args.child[2]))
        return
    from peers.corpus import Corpus, CorpusSpec, write_tar

    root = args.dir or tempfile.mkdtemp(prefix="streampack-faults-")
    urls = write_tar(Corpus(CorpusSpec(tokens=int(args.tokens)), root))
    import streampack

    print(f"streampack at {os.path.dirname(streampack.__file__)}")
    if args.fault:
        print(f"one page fault (fresh anonymous memory, zeroing included): {fault_cost_us():.2f} µs")
    rows = []
    for _ in range(args.rounds):
        for workers in (0, 2):
            out = subprocess.run([sys.executable, __file__, "--child", json.dumps(urls), str(workers),
                                  str(args.epochs)], capture_output=True, text=True, check=True).stdout
            for epoch_line, line in enumerate(out.splitlines()):
                record = json.loads(line)
                record["epoch"] = epoch_line // (2 if workers else 1)
                rows.append(record)
    print("| reader | epoch of the process | batches | next() CPU ms | ms a batch | faults | faults a batch "
          "| layout ms a batch | layout faults |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for where in ("in-process", "worker"):
        for epoch in range(args.epochs):
            mine = [r for r in rows if r["where"] == where and r["epoch"] == epoch]
            best = min(mine, key=lambda r: r["next_ms"])
            print(f"| {where} | {epoch + 1} | {best['batches']} | {best['next_ms']:.0f} | "
                  f"{best['next_ms'] / best['batches']:.2f} | {best['faults']:,} | "
                  f"{best['faults'] / best['batches']:.0f} | {best['layout_ms'] / best['batches']:.2f} | "
                  f"{best['layout_faults']:,} |")
    print(f"(best of {args.rounds} fresh processes by next() CPU; a worker row is one of the two workers)")


if __name__ == "__main__":
    main()
