"""What StatefulDataLoader's per-batch snapshot costs a worker: ``state_dict()`` and torchdata's delta.

With ``snapshot_every_n_steps=1`` (its default) every DataLoader worker, after every batch, calls
the dataset's ``state_dict()``, flattens it and diffs it leaf by leaf against the last one
(``_IncrementalState.generate_delta``); the training process rebuilds every worker's state from
its leaves. This measures, in one process over the peers' corpus (``benchmarks/peers/corpus.py``,
pre-tokenized tar shards; capacity 4096, window 1024, 8 packs per batch): the state's leaves as
torchdata counts them, and per batch the CPU of ``metrics()``, of ``state_dict()`` and of
``state_dict()`` plus the delta (the batch itself is read outside the timings), and what the
training process then does per worker: apply the delta and rebuild the whole state from its flat
leaves (``_IncrementalState.get_state``; ``StatefulDataLoader`` does it for every worker after
every batch).

    python benchmarks/profile_state_step.py [--tokens 4e6] [--batches 100] [--dir DIR]

Run it with another checkout first on ``PYTHONPATH`` (e.g. a worktree of an older commit) to
compare trees: the 154 -> 80 leaves and 285 -> 221 µs in ``streampack/plan/state.py``'s
``record_text`` are this script at the commit before that change and after it (2026-11-27, the
2-core box running CI beside it).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from peers.corpus import Corpus, CorpusSpec, write_tar  # noqa: E402
from torchdata.stateful_dataloader.incremental_state import _flatten, _IncrementalState  # noqa: E402

import streampack  # noqa: E402
from streampack import PackedDataset  # noqa: E402
from streampack.options import PackOptions  # noqa: E402


def per_batch_us(fn, it, batches: int) -> float:
    """Median CPU µs of ``fn()`` right after each of ``batches`` batches of ``it``."""
    times = []
    for _ in range(batches):
        next(it)
        start = time.process_time_ns()
        fn()
        times.append((time.process_time_ns() - start) / 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=float, default=4e6)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--dir", default=None, help="keep the written corpus here and reuse it")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="state-step-")
    urls = write_tar(Corpus(CorpusSpec(tokens=int(args.tokens)), root))
    ds = PackedDataset(urls, capacity=4096, seed=0, packs_per_batch=8, packing=PackOptions(window=1024))  # no end
    it = iter(ds)
    for _ in range(10):  # past the packer's warm-up rounds
        next(it)
    leaves = len(_flatten(ds.state_dict()))
    metrics = per_batch_us(ds.metrics, it, args.batches)
    state = per_batch_us(ds.state_dict, it, args.batches)
    incremental = _IncrementalState(ds.state_dict())
    delta = per_batch_us(lambda: incremental.generate_delta(ds.state_dict()), it, args.batches)
    # the training process's side: apply a worker's delta, then rebuild its whole state from the
    # flat leaves (StatefulDataLoader._update_snapshot does this for every worker after every batch)
    sender, receiver = _IncrementalState(ds.state_dict()), _IncrementalState(ds.state_dict())
    deltas = []
    for _ in range(args.batches):
        next(it)
        deltas.append(sender.generate_delta(ds.state_dict()))
    rebuild = []
    for d in deltas:
        start = time.process_time_ns()
        receiver.apply_delta(d)
        receiver.get_state()
        rebuild.append((time.process_time_ns() - start) / 1e3)
    rebuilt = sorted(rebuild)[len(rebuild) // 2]
    depth = sum(len(k) for k in _flatten(ds.state_dict()))
    print(f"streampack at {os.path.dirname(streampack.__file__)}")
    print(f"state leaves (torchdata's count): {leaves}; their key depths summed: {depth}")
    print(f"per batch, median CPU: metrics() {metrics:.0f} µs, state_dict() {state:.0f} µs, "
          f"state_dict() + delta {delta:.0f} µs; training process, per worker: apply the delta + "
          f"rebuild the state {rebuilt:.0f} µs")


if __name__ == "__main__":
    main()
