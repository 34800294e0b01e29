"""What a restore costs one reader: time to the next batch, and the CPU and bytes of the batches after it.

    PYTHONPATH=. python benchmarks/bench_restore.py [--tokens 4e6] [--rounds 3] [--formats tar,parquet]
        [--baseline ROOT] [--dir DIR]
    PYTHONPATH=. python benchmarks/bench_restore.py --phases [--rounds 5] [--dir DIR] [--gc-off]

The peers' corpus (``benchmarks/peers/corpus.py``: lognormal lengths, mean 600, int32 ids, 16
shards), ``PackedDataset`` with capacity 4096, window 1024 and 8 packs a batch, as
``bench_loaders.py`` runs it. Per tree (this one, and ``--baseline ROOT``, another checkout, for
side by side), format and round, in fresh processes, the trees alternating:

- ``save``: iterate in-process to ``--at`` of the epoch's batches, save the state, then time the
  next ``--after`` batches' CPU and bytes read (the uninterrupted cost) and keep their ids;
- ``w0``: ``torch.load`` of that state to the first batch (wall), then the CPU and bytes read
  (``/proc/self/io`` ``rchar``) of the ``--after`` batches from the restore (``torch.load``,
  building the loader and the restore included), checked equal to the uninterrupted ones;
- ``w2``: the same state's restore under ``StatefulDataLoader`` with 2 workers, ``torch.load`` to
  the first batch (wall; each worker restores its own window; the state is saved with 2 workers).

Best (least) of the rounds per cell: a shared machine only ever slows a run down. Then, in this
process and this tree only, the constants of a tar restore's pick (``io/tar_pick.py``): k random
documents of one shard, each its own read (the worst case), least of 30: ms a call, µs a document.

``--phases``: where a restore's time goes instead, this tree only, least CPU ms of ``--rounds``
fresh processes per phase (CPU, not wall: the box is shared). w0: ``torch.load`` of the state,
``PackedDataset(...)``, ``StatefulDataLoader`` + ``load_loader_state``, ``iter()`` (the graph
built and restored: of it, the window packer's reset), the first batch (of it, the re-read of its
carried documents). w2: the parent's phases (``iter()`` forks the workers), and in each worker
(timing wrappers around ``PackedDataset.__iter__``, ``manifest_of``, the epoch's plan (``EpochPlanner.plan``:
its spans, cut again or taken from the state) and the packer's re-read; the
code paths are unchanged) its CPU before ``__iter__`` (the worker's start and ``load_state_dict``),
then from ``__iter__`` to its first batch, with the manifest, plan and re-read parts; the worst worker.
``--gc-off`` collects and disables the garbage collector before the restore: a collection (~1 ms here)
falls wherever the process's allocation count says, so any change to what a process allocates before or
during a restore moves it in or out of these phases; without it the phases compare code paths alone.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CAPACITY, WINDOW, PACKS = 4096, 1024, 8


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def _loader(urls: list[str], workers: int, state=None):
    from torchdata.stateful_dataloader import StatefulDataLoader

    from streampack import PackedDataset
    from streampack.options import PackOptions
    from streampack.plan.state import load_loader_state

    ds = PackedDataset(urls, capacity=CAPACITY, epochs=1, seed=0, packs_per_batch=PACKS, packing=PackOptions(window=WINDOW))
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=workers, prefetch_factor=8 if workers else None)
    if state is not None:
        load_loader_state(loader, state)
    return loader


def _child(what: str, urls: list[str], scratch: str, at: float, after: int) -> dict:
    import pyarrow.parquet  # noqa: F401 - imports out of the timings (a job imports them once)
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: F401

    from streampack import PackedDataset  # noqa: F401
    from streampack.plan.state import load_loader_state  # noqa: F401

    workers = 2 if what in ("w2", "save2") else 0
    path = os.path.join(scratch, f"state-w{workers}.pt")
    if what.startswith("save"):
        total = sum(1 for _ in _loader(urls, 0))
        stop = int(at * total)
        loader = _loader(urls, workers)
        it = iter(loader)
        for _ in range(stop):
            next(it)
        blob = io.BytesIO()
        torch.save(loader.state_dict(), blob)
        cpu, rchar = time.process_time(), _rchar()
        ids = [next(it).input_ids for _ in range(min(after, total - stop))] if not workers else []
        out = {"batches": total, "at": stop, "state_bytes": len(blob.getvalue()), "cpu_after": time.process_time() - cpu,
               "read_after": _rchar() - rchar}
        del it, loader
        torch.save({"state": blob.getvalue(), "ids": ids}, path)
        return out
    saved = torch.load(path, weights_only=False)
    torch.load(io.BytesIO(saved["state"]), weights_only=True)  # the unpickler's first call, out of the timing
    cpu, rchar, start = time.process_time(), _rchar(), time.perf_counter()
    it = iter(_loader(urls, workers, torch.load(io.BytesIO(saved["state"]), weights_only=True)))
    first = next(it)
    out = {"resume_s": time.perf_counter() - start}
    if not workers:
        got = [first.input_ids] + [next(it).input_ids for _ in range(len(saved["ids"]) - 1)]
        out["cpu_after"] = time.process_time() - cpu
        out["read_after"] = _rchar() - rchar
        out["exact"] = all(torch.equal(a, b) for a, b in zip(got, saved["ids"]))
    del it
    return out


_WRAPPED: dict[str, float] = {}


def _timed(owner: object, name: str, label: str, log: str | None = None) -> None:
    """Wrap ``owner.name`` to add its CPU seconds to ``_WRAPPED[label]`` (and append them to ``log``: workers)."""
    import functools

    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        cpu = time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            _WRAPPED[label] = _WRAPPED.get(label, 0.0) + time.process_time() - cpu
            if log is not None:
                _worker_log(log, label, time.process_time() - cpu)

    setattr(owner, name, wrapper)


def _worker_log(path: str, what: str, value: float) -> None:
    with open(path, "a") as f:
        f.write(json.dumps([os.getpid(), what, value]) + "\n")


def _phases(urls: list[str], scratch: str, workers: int, gc_off: bool = False) -> dict:
    """CPU seconds of each phase of one restore in this fresh process (see the module docstring)."""
    import pyarrow.parquet  # noqa: F401 - imports out of the timings
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    import streampack.graph.build as build
    from streampack import PackedDataset
    from streampack.nodes.window_packer import WindowPacker
    from streampack.options import PackOptions
    from streampack.plan.epoch_plan import EpochPlanner
    from streampack.plan.state import load_loader_state

    log = os.path.join(scratch, f"workers-{os.getpid()}.jsonl") if workers else None
    _timed(WindowPacker, "reset", "of which packer reset", log)
    _timed(WindowPacker, "_read", "of which re-read", log)
    _timed(build, "manifest_of", "of which manifest", log)
    _timed(EpochPlanner, "plan", "of which plan", log)
    if workers:
        first_of = PackedDataset.__iter__

        def iterate(self):
            _worker_log(log, "before __iter__", time.process_time())
            cpu = time.process_time()
            for n, batch in enumerate(first_of(self)):
                if n == 0:
                    _worker_log(log, "__iter__ to first batch", time.process_time() - cpu)
                yield batch

        PackedDataset.__iter__ = iterate
    with open(os.path.join(scratch, f"state-w{workers}.pt"), "rb") as f:
        blob = torch.load(f, weights_only=False)["state"]
    torch.load(io.BytesIO(blob), weights_only=True)  # the unpickler's first call, out of the timing
    if gc_off:  # forked workers inherit it
        gc.collect()
        gc.disable()
    out, cpu = {}, time.process_time()

    def mark(name: str) -> None:
        nonlocal cpu
        out[name] = time.process_time() - cpu
        cpu = time.process_time()

    state = torch.load(io.BytesIO(blob), weights_only=True)
    mark("torch.load")
    ds = PackedDataset(urls, capacity=CAPACITY, epochs=1, seed=0, packs_per_batch=PACKS,
                       packing=PackOptions(window=WINDOW))
    mark("PackedDataset()")
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=workers, prefetch_factor=8 if workers else None)
    load_loader_state(loader, state)
    mark("loader + load_loader_state")
    _WRAPPED.clear()
    it = iter(loader)
    mark("iter()")
    out.update({f"iter(): {k}": v for k, v in _WRAPPED.items()})
    _WRAPPED.clear()
    next(it)
    mark("first batch")
    out.update({f"first batch: {k}": v for k, v in _WRAPPED.items()})
    out["total"] = sum(v for k, v in out.items() if ":" not in k)
    del it, loader
    if workers:
        per: dict[int, dict[str, float]] = {}
        with open(log) as f:
            for line in f:
                pid, what, value = json.loads(line)
                per.setdefault(pid, {})[what] = per.setdefault(pid, {}).get(what, 0.0) + value
        for what in ("before __iter__", "__iter__ to first batch", "of which manifest", "of which plan",
                     "of which re-read"):
            out[f"worker: {what}"] = max(w.get(what, 0.0) for w in per.values())
    return out


def phases(rounds: int = 5, directory: str | None = None, tokens: float = 4e6, at: float = 0.5,
           gc_off: bool = False) -> list[dict]:
    """Least CPU seconds per phase of a tar restore at w0 and w2 over ``rounds`` fresh processes."""
    from peers.corpus import Corpus, CorpusSpec, write_tar

    urls = write_tar(Corpus(CorpusSpec(tokens=int(tokens)), directory or tempfile.mkdtemp(prefix="streampack-restore-")))
    root = str(HERE.parent)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        _spawn(root, "save", urls, scratch, at, 1)
        _spawn(root, "save2", urls, scratch, at, 1)
        for workers in (0, 2):
            runs = [_spawn(root, f"phases{workers}{'-gc-off' if gc_off else ''}", urls, scratch, at, 1)
                    for _ in range(rounds)]
            rows += [{"workers": workers, "phase": k, "cpu_ms": min(r[k] for r in runs) * 1e3} for k in runs[0]]
    return rows


def _spawn(root: str, what: str, urls: list[str], scratch: str, at: float, after: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, str(HERE), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, __file__, "--child", what, json.dumps(urls), scratch, str(at), str(after)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise RuntimeError(f"{what} in {root} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(tokens: float = 4e6, rounds: int = 3, formats: tuple[str, ...] = ("tar", "parquet"), at: float = 0.5,
        after: int = 25, baseline: str | None = None, directory: str | None = None, quick: bool = False) -> list[dict]:
    """One row per format and tree, the best of ``rounds`` (see the module docstring)."""
    from peers.corpus import Corpus, CorpusSpec, write_parquet, write_tar

    if quick:
        tokens, rounds = min(tokens, 1e6), 1
    corpus = Corpus(CorpusSpec(tokens=int(tokens)), directory or tempfile.mkdtemp(prefix="streampack-restore-"))
    writers = {"tar": write_tar, "parquet": write_parquet}
    trees = {"this": str(HERE.parent)} | ({"baseline": os.path.abspath(baseline)} if baseline else {})
    cells: dict[tuple[str, str], list[dict]] = {}
    for fmt in formats:
        urls = writers[fmt](corpus)
        for r in range(rounds):
            order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]
            for name, root in order:
                with tempfile.TemporaryDirectory() as scratch:
                    saved = _spawn(root, "save", urls, scratch, at, after)
                    _spawn(root, "save2", urls, scratch, at, after)
                    w0, w2 = (_spawn(root, w, urls, scratch, at, after) for w in ("w0", "w2"))
                cells.setdefault((fmt, name), []).append({**saved, "w0": w0, "w2": w2})
    rows = _pick_rows(writers["tar"](corpus)[0]) if "tar" in formats else []
    for (fmt, name), runs in cells.items():
        rows.append({"format": fmt, "tree": name, "tokens": corpus.num_tokens, "batches": runs[0]["batches"],
                     "saved_at": runs[0]["at"], "after": after,
                     "resume_w0_ms": min(r["w0"]["resume_s"] for r in runs) * 1e3,
                     "resume_w2_ms": min(r["w2"]["resume_s"] for r in runs) * 1e3,
                     "cpu_uninterrupted_ms": min(r["cpu_after"] for r in runs) * 1e3,
                     "cpu_restored_ms": min(r["w0"]["cpu_after"] for r in runs) * 1e3,
                     "read_uninterrupted_mb": min(r["read_after"] for r in runs) / 1e6,
                     "read_restored_mb": min(r["w0"]["read_after"] for r in runs) / 1e6,
                     "exact": all(r["w0"]["exact"] for r in runs), "state_bytes": runs[0]["state_bytes"]})
    return rows


def _pick_rows(url: str, counts: tuple[int, ...] = (1, 10, 50, 200), repeats: int = 30) -> list[dict]:
    """This tree's tar pick (``io/tar_pick.py``) of k random documents of one shard, each its own
    cluster (the worst case: a read each), least of ``repeats``: its cost per call and per document."""
    import numpy as np

    from streampack.io.blocks import read_blocks, read_samples_at
    from streampack.io.decode import DecodeOptions
    from streampack.io.formats import ShardRange
    from streampack.io.storage import OpenOptions

    decode, opts, streams = DecodeOptions(), OpenOptions(), []
    block = next(iter(read_blocks(url, ShardRange(start=0, first=0), decode=decode, opts=opts, streams=streams)))
    rows = []
    for k in counts:
        docs = np.sort(np.random.default_rng(k).choice(len(block), min(k, len(block)), replace=False)).tolist()
        clusters = [([(int(block.offsets[d]), int(block.numbers[d]))], 4 * int(block.lengths[d]) + 2048) for d in docs]
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            read_samples_at([(url, clusters)], decode=decode, opts=opts, streams=streams)
            best = min(best, time.perf_counter() - start)
        rows.append({"format": "tar", "tree": "this", "pick_docs": len(docs), "pick_ms": best * 1e3,
                     "pick_us_per_doc": best * 1e6 / len(docs)})
    for f in streams:
        f.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=float, default=4e6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--formats", default="tar,parquet")
    ap.add_argument("--at", type=float, default=0.5, help="where in the epoch the state is saved")
    ap.add_argument("--after", type=int, default=25, help="batches timed after the restore")
    ap.add_argument("--baseline", default=None, help="another checkout's root, measured side by side")
    ap.add_argument("--dir", default=None, help="keep the written corpus here and reuse it")
    ap.add_argument("--phases", action="store_true", help="where a restore's CPU goes, per phase (tar, this tree)")
    ap.add_argument("--gc-off", action="store_true", help="--phases with the garbage collector off (see above)")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        what, urls, scratch, at, after = args.child
        work = (lambda: _phases(json.loads(urls), scratch, int(what[6]), what.endswith("-gc-off"))) if what.startswith(
            "phases") else (
            lambda: _child(what, json.loads(urls), scratch, float(at), int(after)))
        print(json.dumps(work()))
        return
    if args.phases:
        rows = phases(args.rounds, args.dir, args.tokens, args.at, args.gc_off)
        print(f"Where a tar restore's CPU goes (least of {args.rounds} fresh processes; ms"
              f"{'; garbage collector off' if args.gc_off else ''}):\n")
        print("| workers | phase | CPU ms |\n|---:|---|---:|")
        for r in rows:
            print(f"| {r['workers']} | {r['phase']} | {r['cpu_ms']:.1f} |")
        return
    rows = run(args.tokens, args.rounds, tuple(args.formats.split(",")), args.at, args.after, args.baseline, args.dir)
    cells, picks = [r for r in rows if "pick_ms" not in r], [r for r in rows if "pick_ms" in r]
    print(f"{cells[0]['tokens']:,} tokens, {cells[0]['batches']} batches (the peers' corpus); capacity {CAPACITY}, "
          f"window {WINDOW}, {PACKS} packs a batch; state saved after batch {cells[0]['saved_at']}; best of "
          f"{args.rounds} rounds, fresh processes\n")
    print(f"| format | tree | resume w0 | resume w2 | CPU of {args.after} batches: uninterrupted | after a restore "
          "| bytes read: uninterrupted | after a restore | exact | state |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in cells:
        print(f"| {r['format']} | {r['tree']} | {r['resume_w0_ms']:.0f} ms | {r['resume_w2_ms']:.0f} ms "
              f"| {r['cpu_uninterrupted_ms']:.0f} ms | {r['cpu_restored_ms']:.0f} ms | {r['read_uninterrupted_mb']:.1f} MB "
              f"| {r['read_restored_mb']:.1f} MB | {r['exact']} | {r['state_bytes']:,} B |")

    if picks:
        print("\nPicking k documents of one tar shard, each its own read (`io/tar_pick.py`, least of 30):\n")
        print("| documents | ms a call | µs a document |\n|---:|---:|---:|")
        for r in picks:
            print(f"| {r['pick_docs']} | {r['pick_ms']:.2f} | {r['pick_us_per_doc']:.1f} |")


if __name__ == "__main__":
    main()
