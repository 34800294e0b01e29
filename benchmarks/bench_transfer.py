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

``--snapshot``: what ``StatefulDataLoader``'s snapshot after every step costs per batch, part by part, for
``PackedDataset`` over the peers' tar corpus (``peers/corpus.py``, capacity 4096, window 1024, 8 packs a batch,
as ``bench_loaders.py`` runs it), all in this process in the order the loader runs them: in the worker the
dataset's ``state_dict()`` (of it, the metrics record) and torchdata's delta against the previous state
(flatten + compare), the delta through ``ForkingPickler`` (what the worker queue does, with the tensor reduction
every worker installs, ``transfer.inline_small_tensors``) and back, then in the training process the delta
applied and every worker's state rebuilt (``get_state``, ``--workers`` of them, as ``_take_snapshot`` does each step); and
what ``PackedLoader`` sends instead, the dataset's whole state through the same pickle and back. Least of
``--rounds`` epochs, µs a batch of CPU time.

``--parts``: the ring hand-over of one such batch (with its doc keys and the ``WorkerStats`` the collate attaches),
part by part, all in this process: in the worker ``transfer.to_wire`` (the storages copied into a slot) and the
pickle, in the training process the unpickle and ``transfer.from_wire`` (the slot mapped, the batch rebuilt); least
of ``--rounds`` passes of 2,000 batches, µs a batch of CPU time, with the pickle's bytes; for scale, what
``StatefulDataLoader`` with 2 workers costs an item (all processes) when each item is an int.

``--in-worker``: the ring hand-over's copy where it really runs, in a worker's queue feeder thread, for
``PackedDataset`` over the peers' 16 M-token tar corpus with one worker (window 1024, no per-step snapshot), at
``--packs`` packs of 4,096 tokens a batch: thread CPU time a batch of taking a slot and of copying the batch's
storages into it, the page faults of each (``RUSAGE_THREAD``), and for scale a ``clone`` of the ids in the worker's
main thread right after the batch is laid out (its cache still warm); least of ``--rounds`` epochs.

Usage: ``python benchmarks/bench_transfer.py [--batches 400] [--quick]``,
``PYTHONPATH=. python benchmarks/bench_transfer.py --in-worker [--packs 8,32] [--rounds 3]``,
``PYTHONPATH=. python benchmarks/bench_transfer.py --parts [--rounds 3]``,
``PYTHONPATH=. python benchmarks/bench_transfer.py --snapshot [--tokens 4e6] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import resource
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
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


def handover_parts(rounds: int, n: int = 2000) -> list[dict[str, object]]:
    """µs a batch of each part of the ring hand-over (see the module docstring), least of ``rounds`` passes."""
    import pickle

    from streampack.layout.stats import WorkerStats

    batch = pack_batch(_packs(), capacity=CAPACITY)
    batch.stats = WorkerStats(dp_rank=0, worker_id=1, batches=100, packs=800, docs=6400, tokens=3_200_000,
                              slots=3_276_800, targets=3_193_600, build_seconds=1.5, events={"retry": 0})
    transfer.register(PackedBatch)
    parts = ("worker: to_wire", "worker: pickle", "training process: unpickle", "training process: from_wire")
    best = dict.fromkeys(parts, float("inf"))
    for _ in range(rounds):
        spent = dict.fromkeys(parts, 0.0)
        for _ in range(n):
            t0 = time.process_time()
            wire = transfer.to_wire(batch)
            t1 = time.process_time()
            data = ForkingPickler.dumps(wire)
            t2 = time.process_time()
            back = pickle.loads(data)
            t3 = time.process_time()
            got = transfer.from_wire(back)
            t4 = time.process_time()
            del got, back, wire  # the slot goes back, as when the training loop drops a batch
            for part, spent_now in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                spent[part] += spent_now
        for part in parts:
            best[part] = min(best[part], 1e6 * spent[part] / n)
    rows = [{"part": k, "µs a batch": round(v, 1)} for k, v in best.items()]
    rows.append({"part": "in all", "µs a batch": round(sum(best.values()), 1)})
    rows.append({"part": "pickle bytes a batch", "µs a batch": len(data)})
    rows.append({"part": "for scale: StatefulDataLoader's 2 workers and queues, an int an item", "µs a batch":
                 round(queue_floor(), 1)})
    return rows


class _Numbers(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def queue_floor(workers: int = 2, sizes: tuple[int, int] = (500, 2500), rounds: int = 3) -> float:
    """µs of CPU (all processes) a DataLoader item costs when the item is an int: ``StatefulDataLoader``'s worker
    loop, its queues and their feeder threads with nothing of ours in them (no snapshot; the difference of two epoch
    sizes takes the workers' start out), least of ``rounds``."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def epoch(n: int) -> float:
        start = _cpu()
        for _ in StatefulDataLoader(_Numbers(n), batch_size=None, num_workers=workers, prefetch_factor=8,
                                    snapshot_every_n_steps=1 << 40):
            pass
        return _cpu() - start  # the workers are joined: counted

    small, large = (min(epoch(n) for _ in range(rounds)) for n in sizes)
    return 1e6 * (large - small) / (workers * (sizes[1] - sizes[0]))


def snapshot_parts(tokens: float, rounds: int, workers: int = 2) -> list[dict[str, object]]:
    """µs a batch of each part of the per-step snapshot (see the module docstring), least of ``rounds`` epochs."""
    import sys
    import tempfile
    from pathlib import Path

    from torch.utils.data import _DatasetKind
    from torchdata.stateful_dataloader.incremental_state import _IncrementalWorkerState
    from torchdata.stateful_dataloader.worker import _make_state_dict

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peers.corpus import Corpus, CorpusSpec
    from peers.streampack_peer import PACKS_PER_BATCH, StreampackPeer

    from streampack import PackedDataset
    from streampack.options import PackOptions
    from streampack.plan.state import record_text

    class Fetcher:  # what torchdata's worker hands _make_state_dict
        ended = False

    transfer.inline_small_tensors()  # what settle_worker installs in every DataLoader worker
    parts = ("state_dict", "of which metrics", "delta", "pickle + unpickle", "apply + get_state")
    whole = "PackedLoader: the whole dataset state through the pickle and back"
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        peer = StreampackPeer(capacity=CAPACITY)
        peer.prepare(Corpus(CorpusSpec(tokens=int(tokens)), tmp))
        for _ in range(rounds):
            ds = PackedDataset(peer.urls, capacity=CAPACITY, epochs=1, seed=0, packs_per_batch=PACKS_PER_BATCH,
                               packing=PackOptions(window=peer.window))
            it = iter(ds)
            fetcher = Fetcher()
            fetcher.dataset, fetcher.dataset_iter = ds, it
            first = _make_state_dict(0, _DatasetKind.Iterable, fetcher, ds)
            worker, main = _IncrementalWorkerState(first), _IncrementalWorkerState(first)
            others = [_IncrementalWorkerState(first) for _ in range(workers - 1)]  # the other workers' states
            spent = dict.fromkeys(parts, 0.0)
            n = shipped = tensors = whole_bytes = 0
            for _ in it:
                t0 = time.process_time()
                state = _make_state_dict(0, _DatasetKind.Iterable, fetcher, ds)
                t1 = time.process_time()
                record_text(ds.metrics())
                t2 = time.process_time()
                delta = worker.generate_delta(state)
                t3 = time.process_time()
                wire = bytes(ForkingPickler.dumps(delta))
                back = ForkingPickler.loads(wire)
                t4 = time.process_time()
                main.apply_delta(back)
                for w in (main, *others):
                    w.get_state()
                t5 = time.process_time()
                spent["state_dict"] += t1 - t0
                spent["of which metrics"] += t2 - t1
                spent["delta"] += t3 - t2
                spent["pickle + unpickle"] += t4 - t3
                spent["apply + get_state"] += t5 - t4
                t6 = time.process_time()
                whole_wire = bytes(ForkingPickler.dumps(state["dataset_state"]))  # what a PackedLoader worker sends
                ForkingPickler.loads(whole_wire)
                spent[whole] = spent.get(whole, 0.0) + time.process_time() - t6
                whole_bytes += len(whole_wire)
                shipped += len(wire)
                tensors += sum(isinstance(v, torch.Tensor) for v in (delta.get("dataset_state") or {}).values())
                n += 1
            for k, v in spent.items():
                best[k] = min(best.get(k, float("inf")), 1e6 * v / n)
            best["delta bytes a batch"], best["tensors a batch"] = shipped / n, tensors / n
            best["PackedLoader: state bytes a batch"] = whole_bytes / n
    rows = [{"part": k, "µs a batch": round(best[k], 1)} for k in parts]
    rows.append({"part": "all (metrics counted once)", "µs a batch": round(sum(best[k] for k in parts)
                                                                           - best["of which metrics"], 1)})
    rows += [{"part": k, "µs a batch": round(best[k], 2)} for k in ("delta bytes a batch", "tensors a batch")]
    rows += [{"part": whole, "µs a batch": round(best[whole], 1)},
             {"part": "PackedLoader: state bytes a batch", "µs a batch": round(best["PackedLoader: state bytes a batch"])}]
    return rows


_IN_WORKER: dict[str, list[float]] = {}


def _timed(fn: Any, part: str) -> Any:
    """``fn``, adding its thread CPU time and page faults to ``part`` at each call."""
    def timed(*args: Any) -> Any:
        c0, f0 = time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        try:
            return fn(*args)
        finally:
            _add(part, time.thread_time() - c0, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)
    return timed


def _add(part: str, cpu: float, faults: float) -> None:
    got = _IN_WORKER.setdefault(part, [0, 0.0, 0.0])
    got[0] += 1
    got[1] += cpu
    got[2] += faults


def _report_in_worker(out: str) -> None:
    """The worker's totals, written to ``out`` as it exits (``multiprocessing``'s finalizers run then)."""
    import json
    import multiprocessing.util

    def write() -> None:
        with open(out, "w") as f:
            json.dump(_IN_WORKER, f)
    multiprocessing.util.Finalize(None, write, exitpriority=100)


def in_worker_parts(packs: tuple[int, ...], rounds: int) -> list[dict[str, object]]:
    """Thread CPU a batch of the hand-over's copy in a worker (see the module docstring)."""
    import json
    import sys
    import tempfile
    from pathlib import Path

    from torchdata.stateful_dataloader import StatefulDataLoader

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peers.corpus import Corpus, CorpusSpec
    from peers.streampack_peer import StreampackPeer

    from streampack import PackedDataset
    from streampack.options import PackOptions

    class Clones(IterableDataset):
        def __init__(self, dataset: PackedDataset) -> None:
            self.dataset = dataset

        def __iter__(self) -> object:
            for batch in self.dataset:
                c0 = time.thread_time()
                batch.input_ids.clone()
                _add("for scale: a clone of the ids in the worker's main thread", time.thread_time() - c0, 0)
                yield batch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        peer = StreampackPeer(capacity=CAPACITY)
        peer.prepare(Corpus(CorpusSpec(tokens=16_000_000), tmp))
        out = str(Path(tmp) / "worker.json")

        def init(_: int) -> None:
            shm_ring.take = _timed(shm_ring.take, "take a slot")
            transfer._into_slot = _timed(transfer._into_slot, "into a slot")
            _report_in_worker(out)

        for ppb in packs:
            best: dict[str, list[float]] = {}
            for _ in range(rounds):
                ds = PackedDataset(peer.urls, capacity=CAPACITY, epochs=1, seed=0, packs_per_batch=ppb,
                                   packing=PackOptions(window=peer.window))
                loader = StatefulDataLoader(Clones(ds), batch_size=None, num_workers=1, prefetch_factor=8,
                                            snapshot_every_n_steps=1 << 40, worker_init_fn=init)
                for _ in loader:
                    pass
                del loader  # joins the worker, which writes its totals as it exits
                with open(out) as f:
                    parts = json.load(f)
                into, take = parts.pop("into a slot"), parts["take a slot"]
                parts["copy into it"] = [into[0], into[1] - take[1], into[2] - take[2]]  # the rest of _into_slot
                for part, (n, cpu, faults) in parts.items():
                    if part not in best or cpu / n < best[part][1] / best[part][0]:
                        best[part] = [n, cpu, faults]
            for part, (n, cpu, faults) in best.items():
                rows.append({"tokens a batch": f"{ppb * CAPACITY:,}", "part": part,
                             "µs a batch": round(1e6 * cpu / n, 1), "page faults a batch": round(faults / n, 1)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=400, help="per worker")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--snapshot", action="store_true", help="the per-step snapshot's parts, per batch")
    parser.add_argument("--parts", action="store_true", help="the ring hand-over's parts, per batch")
    parser.add_argument("--in-worker", action="store_true", help="the hand-over's copy in a worker's feeder thread")
    parser.add_argument("--packs", default="8,32", help="with --in-worker: packs of 4,096 tokens a batch")
    parser.add_argument("--tokens", type=float, default=4e6, help="with --snapshot: the corpus size")
    parser.add_argument("--rounds", type=int, default=3, help="with --snapshot / --parts: passes, the least kept")
    args = parser.parse_args()
    if args.in_worker:
        rows = in_worker_parts(tuple(int(p) for p in args.packs.split(",")), args.rounds)
    elif args.parts:
        rows = handover_parts(args.rounds)
    else:
        rows = snapshot_parts(args.tokens, args.rounds) if args.snapshot else run(args.batches, args.quick)
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
