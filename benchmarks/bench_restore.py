"""What a restore costs one reader: time to the next batch, and the CPU and bytes of the batches after it.

    PYTHONPATH=. python benchmarks/bench_restore.py [--tokens 4e6] [--rounds 3] [--formats tar,parquet]
        [--baseline ROOT] [--dir DIR]

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
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        what, urls, scratch, at, after = args.child
        print(json.dumps(_child(what, json.loads(urls), scratch, float(at), int(after))))
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
