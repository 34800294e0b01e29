"""Where each microsecond of the pipeline goes, per sample and per batch, and what workers add.

Part 1, stages (in-process, ``num_workers=0``): every stage's hot function is wrapped with a
timer that charges it its *own* CPU time (``time.thread_time``; time spent in the stages it
calls is charged to them), so the rows add up to the epoch:

    read        ShardReader.next, minus decode: tar headers and members, or parquet row groups
    decode      the tar member / parquet row -> Sample (npy parse, token validation)
    overlong    OverlongNode.next (split / truncate / drop)
    packer      WindowPacker.next (window rounds, the packing kernel, carry bookkeeping)
    pack_batch  the THD layout: tokens, labels, positions, cu_seqlens
    collate     ThdCollate.next minus pack_batch (counters, WorkerStats, fillers)
    gc          Python's cyclic garbage collector (charged to no stage; it runs where allocation trips it)
    rest        everything else in the epoch loop (EpochLoop, the dataset's iterator, DataLoader)

Part 2, the worker -> training-process hand-over: the same epoch with 0 and 2 DataLoader workers,
CPU of the training process and of the workers (``RUSAGE_CHILDREN`` once they are joined), with
torch's default tensor reduction (``file_descriptor`` strategy: one authenticated socket
handshake per storage) next to streampack's (:mod:`streampack.layout.transfer`: each batch in a
reused slot of the worker's shared-memory ring, :mod:`streampack.layout.shm_ring`), interleaved,
in this process. ``benchmarks/profile_workers.py`` breaks a 2-worker epoch down per process and
phase, each case in a fresh process, side by side with another checkout (``--baseline``).

Data: the peers' corpus (``benchmarks/peers/corpus.py``: lognormal lengths, mean 600, clipped to
[16, 4096], int32 ids), tar (webdataset ``.input_ids.npy``) and parquet (``list<int32>``),
capacity 4096, window 1024, 8 packs per batch, one epoch.

    PYTHONPATH=. python benchmarks/profile_pipeline.py --tokens 5e6 --repeats 2 --out benchmarks/PROFILE.md
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# --root DIR profiles another checkout's streampack (e.g. the main branch, for a before/after)
ROOT = sys.argv[sys.argv.index("--root") + 1] if "--root" in sys.argv else str(HERE.parent)
if (Path(ROOT) / "streampack").is_dir():
    sys.path.insert(0, ROOT)

from multiprocessing.reduction import ForkingPickler  # noqa: E402

from peers.corpus import Corpus, CorpusSpec, write_parquet, write_tar  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import streampack  # noqa: E402
import streampack.io.parquet as parquet_io  # noqa: E402
import streampack.io.tar as tar_io  # noqa: E402
import streampack.nodes.collate as collate_mod  # noqa: E402
from streampack import PackedDataset  # noqa: E402

try:
    from streampack.layout import transfer  # noqa: E402
except ImportError:  # a checkout from before the hand-over change: torch's reduction only
    transfer = None
from streampack.layout.batch import PackedBatch  # noqa: E402
from streampack.nodes.collate import ThdCollate  # noqa: E402
from streampack.nodes.overlong import OverlongNode  # noqa: E402
from streampack.nodes.reader import ShardReader  # noqa: E402
from streampack.nodes.window_packer import WindowPacker  # noqa: E402
from streampack.options import PackOptions  # noqa: E402

CAPACITY, WINDOW, PACKS = 4096, 1024, 8
STAGES = ("read", "decode", "overlong", "packer", "pack_batch", "collate", "gc", "rest")


class SelfTime:
    """Charges each wrapped function its own thread CPU time (callees' time goes to them)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._children: list[float] = []

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock, stack = time.thread_time, self._children

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            stack.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                spent = clock() - start
                self.seconds[name] += spent - stack.pop()
                self.calls[name] += 1
                if stack:
                    stack[-1] += spent
        return timed

    def gc_callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.thread_time()
            return
        spent = time.thread_time() - self._gc_start
        self.seconds["gc"] += spent
        if self._children:
            self._children[-1] += spent


def _patches(clock: SelfTime) -> list[tuple[Any, str, Any]]:
    """(owner, attribute, timed replacement) for every stage's hot function."""
    targets = [(ShardReader, "next", "read"), (tar_io, "decode_tar_sample", "decode"),
               (parquet_io, "_item", "decode"), (OverlongNode, "next", "overlong"),
               (WindowPacker, "next", "packer"), (collate_mod, "pack_batch", "pack_batch"),
               (ThdCollate, "next", "collate")]
    return [(owner, attr, clock.wrap(name, getattr(owner, attr))) for owner, attr, name in targets]


def dataset(urls: list[str]) -> PackedDataset:
    return PackedDataset(urls, capacity=CAPACITY, packing=PackOptions(window=WINDOW), epochs=1, seed=0,
                         packs_per_batch=PACKS)


def stage_profile(urls: list[str]) -> dict[str, Any]:
    clock = SelfTime()
    patches = _patches(clock)
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
    for owner, attr, timed in patches:
        setattr(owner, attr, timed)
    gc.callbacks.append(clock.gc_callback)
    try:
        ds = dataset(urls)
        start = time.thread_time()
        batches = tokens = 0
        for batch in DataLoader(ds, batch_size=None, num_workers=0):
            batches += 1
            tokens += batch.num_tokens
        total = time.thread_time() - start
    finally:
        gc.callbacks.remove(clock.gc_callback)
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)
    seconds = dict(clock.seconds)
    seconds["rest"] = total - sum(seconds.values())
    return {"seconds": seconds, "total": total, "batches": batches, "tokens": tokens,
            "samples": clock.calls["overlong"]}


def _cpu() -> tuple[float, float]:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def handover(urls: list[str], workers: int, reducer: str) -> dict[str, Any]:
    """One epoch; ``reducer`` "torch" (the default fd reduction) or "streampack"."""
    if reducer == "torch":
        ForkingPickler._extra_reducers.pop(PackedBatch, None)
    elif transfer is not None:
        transfer.register(PackedBatch)
    try:
        loader = DataLoader(dataset(urls), batch_size=None, num_workers=workers,
                            prefetch_factor=8 if workers else None)
        gc.collect()
        cpu0, wall0 = _cpu(), time.perf_counter()
        it = iter(loader)
        tokens = batches = 0
        for batch in it:
            tokens += batch.num_tokens
            batches += 1
        wall = time.perf_counter() - wall0
        del it, loader, batch
        gc.collect()  # workers joined: their CPU is in RUSAGE_CHILDREN
        cpu1 = _cpu()
    finally:
        if transfer is not None:
            transfer.register(PackedBatch)
    main, kids = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
    return {"workers": workers, "reducer": reducer, "wall": wall, "main_cpu": main, "worker_cpu": kids,
            "tokens": tokens, "batches": batches}


def resume_times(urls: list[str], workers: int, repeats: int) -> dict[str, float]:
    """Seconds from ``torch.load`` of a state saved 60% into the epoch to the first batch of a
    fresh ``StatefulDataLoader``, best of ``repeats``: the old hand-over and replay read-through
    (torch's reduction, ``REOPEN_GAP`` for local files) next to the current ones, alternating."""
    import io

    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    import streampack.nodes.replay as replay

    def make() -> StatefulDataLoader:
        return StatefulDataLoader(dataset(urls), batch_size=None, num_workers=workers,
                                  prefetch_factor=8 if workers else None)

    loader = make()
    it = iter(loader)
    total = sum(1 for _ in DataLoader(dataset(urls), batch_size=None))
    for _ in range(int(0.6 * total)):
        next(it)
    buf = io.BytesIO()
    torch.save(loader.state_dict(), buf)
    want = next(it)
    del it, loader
    gc.collect()
    local_gap = getattr(replay, "LOCAL_REOPEN_GAP", replay.REOPEN_GAP)
    times: dict[str, float] = {}
    for _ in range(repeats):
        for case in ("before", "after"):
            if case == "before":
                ForkingPickler._extra_reducers.pop(PackedBatch, None)
            elif transfer is not None:
                transfer.register(PackedBatch)
            if hasattr(replay, "LOCAL_REOPEN_GAP"):
                replay.LOCAL_REOPEN_GAP = replay.REOPEN_GAP if case == "before" else local_gap
            buf.seek(0)
            start = time.perf_counter()
            loader = make()
            loader.load_state_dict(torch.load(buf, weights_only=True))
            it = iter(loader)
            got = next(it)
            seconds = time.perf_counter() - start
            assert torch.equal(got.input_ids, want.input_ids), "resume is not exact"
            times[case] = min(seconds, times.get(case, float("inf")))
            del it, loader
            gc.collect()
    if transfer is not None:
        transfer.register(PackedBatch)
    if hasattr(replay, "LOCAL_REOPEN_GAP"):
        replay.LOCAL_REOPEN_GAP = local_gap
    return times


def best(rows: list[dict[str, Any]], key: Callable[[dict[str, Any]], float]) -> dict[str, Any]:
    return min(rows, key=key)


def stage_table(fmt: str, runs: list[dict[str, Any]]) -> str:
    run = best(runs, lambda r: r["total"])
    n, b, total = run["samples"], run["batches"], run["total"]
    lines = [f"**{fmt}**: {n:,} samples, {b} batches, {run['tokens'] / 1e6:.1f} M tokens, "
             f"{total:.2f} CPU-s in-process = {run['tokens'] / total / 1e6:.2f} M tokens per CPU-second",
             "", "| stage | µs per sample | ms per batch | share |", "|---|---:|---:|---:|"]
    for name in STAGES:
        s = run["seconds"].get(name, 0.0)
        lines.append(f"| {name} | {1e6 * s / n:.1f} | {1e3 * s / b:.2f} | {100 * s / total:.0f}% |")
    lines.append(f"| **total** | {1e6 * total / n:.1f} | {1e3 * total / b:.2f} | 100% |")
    return "\n".join(lines)


def handover_table(fmt: str, runs: list[dict[str, Any]]) -> str:
    lines = [f"**{fmt}**, one epoch (best of the repeats by total CPU)", "",
             "| workers | reducer | tokens/s | training process CPU ms/batch | workers CPU ms/batch | "
             "total CPU-s | tokens per CPU-s | CPU vs in-process |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    base = best([r for r in runs if r["workers"] == 0], lambda r: r["main_cpu"] + r["worker_cpu"])
    base_cpu = base["main_cpu"] + base["worker_cpu"]
    keys = sorted({(r["workers"], r["reducer"]) for r in runs}, key=lambda k: (k[0], k[1] != "torch"))
    for w, reducer in keys:
        r = best([x for x in runs if (x["workers"], x["reducer"]) == (w, reducer)],
                 lambda x: x["main_cpu"] + x["worker_cpu"])
        cpu = r["main_cpu"] + r["worker_cpu"]
        lines.append(f"| {w} | {reducer if w else '–'} | {r['tokens'] / r['wall'] / 1e6:.2f} M | "
                     f"{1e3 * r['main_cpu'] / r['batches']:.2f} | {1e3 * r['worker_cpu'] / r['batches']:.2f} | "
                     f"{cpu:.2f} | {r['tokens'] / cpu / 1e6:.2f} M | {cpu / base_cpu:.2f}× |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=float, default=5e6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--formats", default="tar,parquet")
    parser.add_argument("--dir", default=None, help="keep the written corpus here")
    parser.add_argument("--out", default=None, help="also write the tables (markdown) here")
    parser.add_argument("--root", default=None, help="profile the streampack of this checkout instead")
    args = parser.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    out = [f"# Pipeline profile\n\nCommand: `python benchmarks/profile_pipeline.py {' '.join(sys.argv[1:] if argv is None else argv)}`\n"]
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Corpus(CorpusSpec(tokens=int(args.tokens)), args.dir or tmp)
        urls = {"tar": write_tar(corpus), "parquet": write_parquet(corpus)}
        stages: dict[str, list[dict[str, Any]]] = defaultdict(list)
        hand: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for _ in range(args.repeats):  # interleaved: a busy spell does not land on one case only
            for fmt in formats:
                stages[fmt].append(stage_profile(urls[fmt]))
                for workers, reducer in ((0, "streampack"), (2, "torch"), (2, "streampack"))[:3 if transfer else 2]:
                    hand[fmt].append(handover(urls[fmt], workers, reducer))
        out.append(f"streampack: {Path(streampack.__file__).parent}\n")
        out.append(f"Corpus: {corpus.describe()}; capacity {CAPACITY}, window {WINDOW}, {PACKS} packs per batch.\n")
        out.append("## Stages, in-process (own CPU time of each stage)\n")
        out += [stage_table(fmt, stages[fmt]) + "\n" for fmt in formats]
        out.append("## Resume: `torch.load` of a state 60% into the epoch to the first batch\n")
        out.append("before = torch's tensor reduction and a 1 MiB read-through between carried samples of a local "
                   "shard; after = streampack's reduction and 64 KiB; alternating, best of the repeats\n")
        out.append("| shards | workers | before | after |\n|---|---:|---:|---:|")
        for fmt in formats:
            for workers in (0, 2):
                t = resume_times(urls[fmt], workers, max(2, args.repeats))
                out.append(f"| {fmt} | {workers} | {t['before']:.2f} s | {t['after']:.2f} s |")
        out.append("")
        out.append("## Worker -> training process hand-over\n")
        out += [handover_table(fmt, hand[fmt]) + "\n" for fmt in formats]
    text = "\n".join(out)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
