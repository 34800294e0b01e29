"""What DataLoader workers add to an epoch, per process and per phase, and to a resume.

Every case runs in a fresh child process (this file with ``--child``) that imports streampack
from this tree or from ``--baseline DIR`` (another checkout, e.g. the main branch), so a
before/after is one interleaved run; cases take turns round by round and each number is the
best of its rounds (a busy spell on a shared machine only ever slows a run down).

``epoch``: ``PackedDataset`` (4096 x 8 packs, window 1024, ``epochs=1``) under
``StatefulDataLoader(ds, batch_size=None, num_workers=W, prefetch_factor=8)``, as the README
and ``bench_loaders.py`` use it. Total CPU = ``RUSAGE_SELF`` + ``RUSAGE_CHILDREN`` once the
workers are joined. The training process's CPU is split into construction, ``iter()`` (forking the
workers and waiting for their start-up acks), the batches, and teardown. Each worker writes at
exit: its CPU at ``worker_init_fn`` (fork and torch's worker bootstrap), at its first batch (graph
built, initial state sent, window filled) and its last, and at exit; the CPU of its main thread
(the pipeline) and of its other threads (the queue feeder thread: pickling and the hand-over);
its minor page faults.

``resume``: a state saved 80% into the epoch (a separate child) is ``torch.load``-ed in a
fresh child; seconds from there to the first batch, and whether it is the batch the
uninterrupted run delivered.

Variants of this tree (``--variants``) switch one change off, to show what each is worth:
``torch-handover`` (no shared-memory ring: every batch in a new torch segment), ``state-by-torch``
(the state deltas' tensors by torch's reduction); ``no-snapshot`` is the loader setting
``snapshot_every_n_steps=10**9`` (the workers send no state with each batch), to show what
StatefulDataLoader's per-step snapshots cost.

    PYTHONPATH=. python benchmarks/profile_workers.py --tokens 4e6,32e6 --rounds 2 \\
        --baseline /work/main --out benchmarks/PROFILE_WORKERS.md
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from profile_workers_tables import epoch_table, phase_table, resume_table  # noqa: E402

CAPACITY, WINDOW, PACKS = 4096, 1024, 8
VARIANTS = ("baseline", "this", "torch-handover", "state-by-torch", "no-snapshot")
SNAPSHOT_EVERY = {"no-snapshot": 10**9}  # StatefulDataLoader's snapshot_every_n_steps (default 1)


def _cpu() -> tuple[float, float]:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def _threads() -> dict[str, float]:
    """CPU seconds of this process's main thread and of its other threads together (in a worker:
    the queue feeder thread, which pickles; ``/proc``, 10 ms ticks)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {"main": 0.0, "other": 0.0}
    for task in glob.glob("/proc/self/task/*"):
        try:
            fields = open(f"{task}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out["main" if int(task.rsplit("/", 1)[1]) == os.getpid() else "other"] += (int(fields[11]) + int(fields[12])) / tick
    return out


def _apply_variant(variant: str) -> None:
    if variant == "torch-handover":
        from streampack.layout import shm_ring
        shm_ring.available = lambda: False
    elif variant == "state-by-torch":
        from streampack.layout import transfer
        transfer.settle_worker = lambda: None


def _instrument(record: dict[str, Any], out_dir: str) -> Any:
    """Hooks that note a worker's phases; returns its ``worker_init_fn``."""
    import multiprocessing.util as mp_util

    import streampack.dataset as dsmod

    cpu = time.process_time
    run = dsmod.PackedDataset._run

    def timed_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        for i, batch in enumerate(run(self, *args, **kwargs)):
            if i == 0:
                record["first_batch"] = cpu()
            yield batch
        record["last_batch"] = cpu()
    dsmod.PackedDataset._run = timed_run

    def init(worker_id: int) -> None:
        record["init"] = cpu()

        def dump() -> None:
            r = resource.getrusage(resource.RUSAGE_SELF)
            record.update(exit=r.ru_utime + r.ru_stime, minflt=r.ru_minflt, threads=_threads())
            Path(out_dir, f"w{worker_id}.json").write_text(json.dumps(record))
        mp_util.Finalize(None, dump, exitpriority=100)  # runs before the worker's os._exit
    return init


def _dataset(urls: list[str]) -> Any:
    from streampack import PackedDataset
    from streampack.options import PackOptions
    return PackedDataset(urls, capacity=CAPACITY, packing=PackOptions(window=WINDOW), epochs=1, seed=0,
                         packs_per_batch=PACKS)


def _loader(urls: list[str], workers: int, init: Any = None, variant: str = "this") -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader
    return StatefulDataLoader(_dataset(urls), batch_size=None, num_workers=workers,
                              prefetch_factor=8 if workers else None, worker_init_fn=init,
                              snapshot_every_n_steps=SNAPSHOT_EVERY.get(variant, 1))


def child_epoch(urls: list[str], workers: int, variant: str) -> dict[str, Any]:
    out_dir = tempfile.mkdtemp()
    init = _instrument({}, out_dir) if workers else None
    gc.collect()
    c0, t0 = _cpu(), time.perf_counter()
    loader = _loader(urls, workers, init, variant)
    c1 = _cpu()
    it = iter(loader)
    c2 = _cpu()
    batches = tokens = 0
    first = 0.0
    for batch in it:
        if not batches:
            first = time.perf_counter() - t0
        batches += 1
        tokens += batch.num_tokens
    wall = time.perf_counter() - t0
    c3 = _cpu()
    del it, loader, batch
    gc.collect()  # the workers are joined: their CPU is in RUSAGE_CHILDREN
    c4 = _cpu()
    return {"batches": batches, "tokens": tokens, "wall": wall, "first": first,
            "main": c4[0] - c0[0], "kids": c4[1] - c0[1], "construct": c1[0] - c0[0], "iter": c2[0] - c1[0],
            "loop": c3[0] - c2[0], "teardown": c4[0] - c3[0],
            "workers": [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("w*.json"))]}


def child_save(urls: list[str], workers: int, path: str) -> dict[str, Any]:
    import torch

    total = sum(b.num_tokens for b in _loader(urls, 0))
    loader = _loader(urls, workers)
    it, seen = iter(loader), 0
    for batch in it:
        seen += batch.num_tokens
        if seen >= 0.8 * total:
            break
    state = loader.state_dict()
    torch.save({"state": state, "next": next(it).input_ids.clone()}, path)
    return {"saved": path}


def child_resume(urls: list[str], workers: int, path: str) -> dict[str, Any]:
    import torch

    from streampack.state import load_loader_state

    start = time.perf_counter()
    saved = torch.load(path, weights_only=True)
    loader = _loader(urls, workers)
    load_loader_state(loader, saved["state"])
    it = iter(loader)
    acked = time.perf_counter() - start
    got = next(it)
    seconds = time.perf_counter() - start
    return {"resume": seconds, "acked": acked, "exact": bool(torch.equal(got.input_ids, saved["next"]))}


def _spawn(args: argparse.Namespace, what: str, variant: str, fmt: str, tokens: float, workers: int,
           extra: list[str] | None = None) -> dict[str, Any]:
    root = args.baseline if variant == "baseline" else str(HERE.parent)
    cmd = [sys.executable, __file__, "--child", what, "--variant", variant, "--fmt", fmt, "--tokens", str(tokens),
           "--workers", str(workers), "--dir", args.dir, *(extra or [])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(lines[-1])


def _urls(directory: str, tokens: float, fmt: str) -> list[str]:
    from peers.corpus import Corpus, CorpusSpec, write_parquet, write_tar
    corpus = Corpus(CorpusSpec(tokens=int(tokens)), directory)
    return write_tar(corpus) if fmt == "tar" else write_parquet(corpus)


def child_main(args: argparse.Namespace) -> int:
    import warnings
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    _apply_variant(args.variant)
    urls = _urls(args.dir, args.tokens, args.fmt)
    if args.child == "epoch":
        result = child_epoch(urls, args.workers, args.variant)
    elif args.child == "save":
        result = child_save(urls, args.workers, args.state)
    else:
        result = child_resume(urls, args.workers, args.state)
    print(json.dumps(result), flush=True)
    os._exit(0)  # a native thread pool aborting at teardown must not fail a finished measurement


def collect(args: argparse.Namespace) -> dict[str, Any]:
    fmts, sizes, variants = args.formats.split(","), [float(t) for t in args.tokens.split(",")], args.variants.split(",")
    got: dict[str, dict[tuple, list[dict[str, Any]]]] = {"epochs": {}, "resumes": {}}
    for fmt in fmts:
        for tokens in sizes:
            _urls(args.dir, tokens, fmt)  # written once, before any timing
            for variant in {v if v == "baseline" else "this" for v in variants}:
                _spawn(args, "epoch", variant, fmt, tokens, 0)  # builds the shard indexes and manifest once
    for _ in range(args.rounds):
        for fmt in fmts:
            for tokens in sizes:
                for variant in variants:
                    for workers in (0, 2):
                        _note(args, got, "epochs", (fmt, tokens, variant, workers),
                              _spawn(args, "epoch", variant, fmt, tokens, workers))
    if args.resume:
        cases = [(fmt, variant, workers) for fmt in fmts for workers in (0, 2) for variant in variants]
        state = {c: os.path.join(args.dir, "state-{}-{}-w{}.pt".format(*c)) for c in cases}
        for fmt, variant, workers in cases:
            _spawn(args, "save", variant, fmt, sizes[0], workers, ["--state", state[(fmt, variant, workers)]])
        for _ in range(args.rounds):
            for fmt, variant, workers in cases:
                _note(args, got, "resumes", (fmt, variant, workers), _spawn(
                    args, "resume", variant, fmt, sizes[0], workers, ["--state", state[(fmt, variant, workers)]]))
    return got


def _note(args: argparse.Namespace, got: dict[str, Any], kind: str, key: tuple, result: dict[str, Any]) -> None:
    got[kind].setdefault(key, []).append(result)
    print(f"{kind} {key}: " + (result.get("error") or " ".join(
        f"{k}={v:.3f}" for k, v in result.items() if isinstance(v, float))), file=sys.stderr)
    if args.raw:  # every result as it comes: tables can be made again from it (--from-raw)
        with open(args.raw, "a") as f:
            f.write(json.dumps({"kind": kind, "key": key, "result": result}) + "\n")


def _from_raw(path: str) -> dict[str, Any]:
    got: dict[str, dict[tuple, list[dict[str, Any]]]] = {"epochs": {}, "resumes": {}}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        got[row["kind"]].setdefault(tuple(row["key"]), []).append(row["result"])
    return got


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="4e6,32e6", help="corpus sizes (comma-separated)")
    parser.add_argument("--formats", default="tar,parquet")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default="this", help=f"comma-separated, of {VARIANTS}")
    parser.add_argument("--baseline", default=None, help="a checkout whose streampack is the 'baseline' variant")
    parser.add_argument("--resume", action="store_true", help="also time resumes (smallest corpus)")
    parser.add_argument("--dir", default=None, help="keep the written corpora here")
    parser.add_argument("--out", default=None)
    parser.add_argument("--raw", default=None, help="append every result here (JSON lines) as it comes")
    parser.add_argument("--from-raw", default=None, help="only make the tables, from a --raw file")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--child", choices=("epoch", "save", "resume"), help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="this", help=argparse.SUPPRESS)
    parser.add_argument("--fmt", default="tar", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--state", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.tokens = float(args.tokens)
        return child_main(args)
    variants = args.variants.split(",")
    if "baseline" in variants and not args.baseline and not args.from_raw:
        parser.error("the baseline variant needs --baseline DIR")
    if args.from_raw:
        got = _from_raw(args.from_raw)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            args.dir = args.dir or tmp
            got = collect(args)
    fmts, sizes = args.formats.split(","), [float(t) for t in args.tokens.split(",")]
    text = "\n".join([
        "# DataLoader workers: where a 2-worker epoch's CPU goes\n",
        f"Command: `python benchmarks/profile_workers.py {' '.join(sys.argv[1:] if argv is None else argv)}`\n",
        f"{os.cpu_count()} CPUs; capacity {CAPACITY}, window {WINDOW}, {PACKS} packs per batch, best of "
        f"{args.rounds} interleaved rounds, every run in a fresh process.\n",
        "## Epoch CPU and throughput\n", epoch_table(got["epochs"], fmts, sizes, variants), "",
        "## Per process and phase (2 workers; worker columns are both workers summed)\n",
        phase_table(got["epochs"], fmts, sizes, variants), "",
        *(["## Resume: `torch.load` of a state 80% into the epoch to the first batch\n",
           resume_table(got["resumes"], fmts, variants), ""] if args.resume else []),
    ])
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
