"""Where a ``StatefulDataLoader`` epoch's CPU goes, per part, in the training process and its workers.

One epoch of the peers' corpus (``benchmarks/peers/corpus.py``: pre-tokenized tar shards; capacity
4096, window 1024, 8 packs a batch) under ``StatefulDataLoader(num_workers=W, prefetch_factor=8)``,
each run in a fresh process. ``time.thread_time`` (1 µs a call here) is taken around:

- in the training process: ``__next__`` and, inside it, torchdata's ``_take_snapshot`` (after
  every batch it rebuilds every worker's state from its flat leaves), ``_get_data`` (receiving a
  batch: queue, unpickling, the shared-memory views) and ``_try_put_index`` (asking for the next);
- in each worker: the dataset's ``next()``, its ``state_dict()`` and torchdata's delta
  (``_IncrementalWorkerState.generate_delta``), and the worker process's CPU at the end of its
  epoch (all its threads: the queue's feeder thread pickles what the loop puts);

and the epoch's total CPU: the training process's and its joined workers' (``getrusage``).
cProfile is not used: inside a worker it charges wall time, preemption included.

    PYTHONPATH=TREE python benchmarks/profile_loader_parts.py [--tokens 32e6] [--workers 2] \\
        [--rounds 2] [--dir DIR]

Run it with two checkouts on ``PYTHONPATH`` in turn to compare trees.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _cpu(who: int = resource.RUSAGE_SELF) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def _child(urls: list[str], workers: int) -> None:
    """One fresh process, one epoch: one JSON line per worker, then one for the whole epoch."""
    import torch.utils.data as tud
    import torchdata.stateful_dataloader.incremental_state as incremental
    import torchdata.stateful_dataloader.stateful_dataloader as sdl
    from torchdata.stateful_dataloader import StatefulDataLoader

    from streampack import PackedDataset
    from streampack.options import PackOptions

    spent: dict[str, float] = {}

    def timed(owner: type, name: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.thread_time() - start

        setattr(owner, name, wrapper)

    # wrapped before the workers fork, so they run the wrapped delta too; nothing here is pickled
    timed(incremental._IncrementalWorkerState, "generate_delta")
    for name in ("_take_snapshot", "_get_data", "_try_put_index"):
        timed(sdl._StatefulMultiProcessingDataLoaderIter, name)
    timed(sdl._StatefulBaseDataLoaderIter, "__next__")

    class Measured(PackedDataset):
        def state_dict(self):
            start = time.thread_time()
            try:
                return super().state_dict()
            finally:
                spent["state_dict"] = spent.get("state_dict", 0.0) + time.thread_time() - start

        def __iter__(self):
            inner, batches, nexts = super().__iter__(), 0, 0.0
            while True:
                start = time.thread_time()
                try:
                    batch = next(inner)
                except StopIteration:
                    break
                nexts += time.thread_time() - start
                batches += 1
                yield batch
            if tud.get_worker_info() is not None:  # one write of one line: workers share the pipe
                line = json.dumps({"worker": True, "batches": batches, "next": nexts,
                                   "state_dict": spent.get("state_dict", 0.0),
                                   "delta": spent.get("generate_delta", 0.0), "process": _cpu()})
                os.write(sys.stdout.fileno(), (line + "\n").encode())

    main0, kids0 = _cpu(), _cpu(resource.RUSAGE_CHILDREN)
    ds = Measured(urls, capacity=4096, epochs=1, seed=0, packs_per_batch=8, packing=PackOptions(window=1024))
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=workers, prefetch_factor=8)
    batches = sum(1 for _ in loader)
    del loader
    print(json.dumps({"worker": False, "batches": batches, "main": _cpu() - main0,
                      "workers": _cpu(resource.RUSAGE_CHILDREN) - kids0,
                      **{k: spent.get(k, 0.0) for k in ("__next__", "_take_snapshot", "_get_data", "_try_put_index")}}),
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=float, default=32e6)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="fresh processes (epochs) to take the median of")
    ap.add_argument("--dir", default=None, help="keep the written corpus here and reuse it")
    ap.add_argument("--child", nargs=2, metavar=("URLS", "WORKERS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(json.loads(args.child[0]), int(args.child[1]))
        return
    from peers.corpus import Corpus, CorpusSpec, write_tar

    import streampack

    root = args.dir or tempfile.mkdtemp(prefix="streampack-parts-")
    urls = write_tar(Corpus(CorpusSpec(tokens=int(args.tokens)), root))
    epochs, workers = [], []
    for _ in range(args.rounds):
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps(urls), str(args.workers)],
                             capture_output=True, text=True, check=True).stdout
        records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        epochs += [r for r in records if not r["worker"]]
        workers += [r for r in records if r["worker"]]

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    n = med(epochs, "batches")
    print(f"streampack at {os.path.dirname(streampack.__file__)}; {args.workers} workers, {n:.0f} batches, "
          f"median of {args.rounds} fresh processes")
    print(f"epoch CPU-s: training process {med(epochs, 'main'):.2f}, workers {med(epochs, 'workers'):.2f}, "
          f"total {statistics.median(r['main'] + r['workers'] for r in epochs):.2f}")
    print("training process, µs a batch: " + ", ".join(
        f"{k} {med(epochs, k) / n * 1e6:.0f}" for k in ("__next__", "_take_snapshot", "_get_data", "_try_put_index")))
    w = med(workers, "batches")
    print(f"a worker ({w:.0f} batches), CPU-ms: process {med(workers, 'process') * 1e3:.0f}, next() "
          f"{med(workers, 'next') * 1e3:.0f}, state_dict() {med(workers, 'state_dict') * 1e3:.0f}, "
          f"delta {med(workers, 'delta') * 1e3:.0f}")


if __name__ == "__main__":
    main()
