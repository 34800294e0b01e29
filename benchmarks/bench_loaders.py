"""streampack next to litdata, Mosaic streaming, webdataset and HF datasets + TRL: the cost of
a token, in one interleaved run on one pre-tokenized corpus.

Every loader reads the same generated long-tail documents (``peers/corpus.py``: lognormal
lengths with mean 600 clipped to [16, capacity], int32 ids; no downloads) from its own native
format and hands the loop batches of 8 x 4096 token slots; the adapters in ``benchmarks/peers/``
say how each is built (as its docs show). Every measurement runs in a fresh child process, so
CPU time (the process and its DataLoader workers, ``RUSAGE_SELF`` + ``RUSAGE_CHILDREN`` after
they are joined), peak RSS and resume are the loader's own; the loaders take turns round by round
(``--rounds``) and each number is the best of its rounds (a busy spell on a shared machine only
ever slows a run down).

Per loader and worker count (w0 = no DataLoader workers, w2 = 2):

- tokens/s: real tokens handed to the loop over one epoch, from ``iter()`` to the last batch
  (worker start-up included), wall clock;
- tokens per CPU-second: the same tokens over the CPU time of the process and its workers,
  from building the loader to after the epoch's teardown (``del loader; gc.collect()``, which
  joins the workers); "no teardown": without this process's CPU in that teardown, whose full
  ``gc.collect()`` walks every object of the process (torch's too: 0.11-0.16 s here for any
  loader, more than litdata's whole epoch), the workers' CPU kept;
- fill: real tokens / slots, with no workers (each worker completes its own last batch with
  filler packs, which count as slots: the step computes over them; the notes give the fill
  without them); document boundaries: whether the loop gets every document whole with its
  boundaries (``cu_seqlens``), or documents cut at block edges;
- first batch: ``iter()`` to the first batch;
- resume: a fresh process loads the state saved after 80% of the corpus's tokens
  (``torch.load``) and builds the loader; seconds to its first batch, and whether that batch is
  the one the uninterrupted run delivered (a loader with no state replays the epoch instead);
- state bytes: ``torch.save`` size of the loader state; RSS: peak of the training process and of
  its largest worker.

    PYTHONPATH=. python benchmarks/bench_loaders.py --tokens 20e6 --rounds 2 --out /tmp/LOADERS.md
    PYTHONPATH=. python benchmarks/bench_loaders.py --quick --loaders streampack,webdataset
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# a child measuring the --baseline tree imports streampack from there (its rows say "baseline")
ROOT = sys.argv[sys.argv.index("--root") + 1] if "--root" in sys.argv else str(HERE.parent)
if (Path(ROOT) / "streampack").is_dir():
    sys.path.insert(0, ROOT)

from peers import PEERS  # noqa: E402
from peers.corpus import Corpus, CorpusSpec  # noqa: E402
from peers.measure import EpochRun, load_state, time_resume  # noqa: E402
from peers.report import machine, versions  # noqa: E402

LOADERS = ("streampack", "streampack-parquet", "streampack-tokens", "litdata", "mosaic-concat", "mosaic", "webdataset", "hf-trl")
BOUNDARIES = {"streampack": "kept, cu_seqlens", "streampack-parquet": "kept, cu_seqlens",
              "streampack-tokens": "kept, cu_seqlens", "litdata": "cut at block edges",
              "mosaic-concat": "cut at block edges", "mosaic": "kept", "webdataset": "kept", "hf-trl": "kept"}
BASELINE = " (baseline)"
"""Suffix of a streampack row measured on ``--baseline``'s tree (the same adapter, older code)."""
RESUME_AT = 0.8
CAPACITY = 4096


def _cpu() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _cpu_self() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


def _peak_rss_mib() -> float:
    """This process's peak RSS since it started (``VmHWM``; ``ru_maxrss`` would carry the parent's
    peak across ``exec``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def _peer(name: str, corpus: Corpus) -> Any:
    peer = PEERS[name.removesuffix(BASELINE)](CAPACITY)
    peer.prepare(corpus)
    return peer


def child_epoch(name: str, corpus: Corpus, workers: int, scratch: str) -> dict[str, Any]:
    """One epoch in this (fresh) process; saves the state at ``RESUME_AT`` and the batch after it."""
    peer = _peer(name, corpus)
    checkpoint_at = int(RESUME_AT * corpus.num_tokens)
    gc.collect()
    cpu0, self0 = _cpu(), _cpu_self()
    start = time.perf_counter()
    loader = peer.loader(workers)
    run = EpochRun(seconds=0.0, tokens=0, slots=0, batches=0)
    first = paused = 0.0
    filler_slots = 0
    want_reference = False
    for batch in loader:
        if not run.batches:
            first = time.perf_counter() - start
        c = peer.count(batch)
        run.tokens += c.tokens
        run.slots += c.slots
        filler_slots += c.filler_slots
        run.batches += 1
        if want_reference:
            run.reference, want_reference = c.ids.clone(), False
        if run.saved_after == 0 and run.tokens >= checkpoint_at:
            t = time.perf_counter()
            state = peer.save(loader, run.batches)
            if state is not None:
                buf = io.BytesIO()
                import torch

                torch.save(state, buf)
                run.state = buf.getvalue()
            run.saved_after, want_reference = run.batches, True
            paused += time.perf_counter() - t
    wall = time.perf_counter() - start - paused
    self1 = _cpu_self()
    del loader
    gc.collect()  # join the workers: their CPU lands in RUSAGE_CHILDREN
    cpu = _cpu() - cpu0
    # the same without this process's teardown: the full gc.collect above walks every object of
    # the process (torch's included), 0.11-0.16 s here whatever the loader, more than litdata's
    # whole epoch; the workers' CPU (children, joined by then) stays in
    cpu_loader = (self1 - self0) + (_cpu() - _cpu_self()) - (cpu0 - self0)
    import torch

    torch.save({"state": run.state, "saved_after": run.saved_after, "reference": run.reference},
               os.path.join(scratch, f"{name}-w{workers}.pt"))
    return {"tokens": run.tokens, "slots": run.slots, "batches": run.batches, "wall": wall, "cpu": cpu,
            "cpu_loader": cpu_loader, "filler_slots": filler_slots,
            "first_batch": first, "state_bytes": len(run.state) if run.state is not None else None,
            "rss_main_mib": _peak_rss_mib(),
            "rss_worker_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024 if workers else 0.0}


def child_resume(name: str, corpus: Corpus, workers: int, scratch: str) -> dict[str, Any]:
    import torch

    saved = torch.load(os.path.join(scratch, f"{name}-w{workers}.pt"), weights_only=False)
    peer = _peer(name, corpus)
    run = EpochRun(seconds=0.0, tokens=0, slots=0, batches=0, state=saved["state"],
                   saved_after=saved["saved_after"], reference=saved["reference"])
    weights_only = True
    if run.state is not None:
        _, weights_only = load_state(run.state)
    r = time_resume(peer, run, workers)
    return {"resume_s": r.seconds, "exact": r.exact, "kind": "state" if run.state is not None else "replay",
            "weights_only": weights_only}


def _spawn(what: str, name: str, workers: int, args: argparse.Namespace, scratch: str) -> dict[str, Any]:
    root = args.baseline if name.endswith(BASELINE) else str(HERE.parent)
    cmd = [sys.executable, __file__, "--child", what, "--loaders", name, "--workers", str(workers),
           "--tokens", str(args.tokens), "--dir", args.dir, "--scratch", scratch, "--root", root]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(lines[-1])


def _best(runs: list[dict[str, Any]], key: str, *, high: bool = False) -> Any:
    values = [r[key] for r in runs if r.get(key) is not None]
    if not values:
        return None
    return max(values) if high else min(values)


def collect(args: argparse.Namespace, scratch: str, echo: bool = True) -> dict[str, Any]:
    corpus = Corpus(CorpusSpec(tokens=int(args.tokens), capacity=CAPACITY), args.dir)
    results: dict[str, Any] = {}
    for name in args.loaders:
        why = PEERS[name.removesuffix(BASELINE)](CAPACITY).missing()
        if why is None:
            try:
                _peer(name, corpus)  # write its format once, outside every timing
            except Exception as e:  # noqa: BLE001 - report this loader as failed, measure the rest
                why = f"failed to write its format: {type(e).__name__}: {e}"
        results[name] = {"missing": why, "epoch": {w: [] for w in args.workers}, "resume": {w: [] for w in args.workers}}
    for round_ in range(args.rounds):
        # every other round in reverse order: no loader always runs in the same place of a round
        # (with a fixed order, rows of the same code came out 20-30% apart on the 2-core box)
        for name in (args.loaders if round_ % 2 == 0 else args.loaders[::-1]):
            if results[name]["missing"]:
                continue
            for w in args.workers:
                if echo:
                    print(f"round {round_ + 1}/{args.rounds}: {name} w{w}", file=sys.stderr, flush=True)
                results[name]["epoch"][w].append(_spawn("epoch", name, w, args, scratch))
                results[name]["resume"][w].append(_spawn("resume", name, w, args, scratch))
    results["_corpus"] = corpus.describe()
    results["_num_tokens"] = corpus.num_tokens
    return results


def summarize(results: dict[str, Any], loaders: Sequence[str], workers: Sequence[int]) -> list[dict[str, Any]]:
    rows = []
    for name in loaders:
        r = results[name]
        row: dict[str, Any] = {"loader": name, "boundaries": BOUNDARIES[name.removesuffix(BASELINE)]}
        if r["missing"]:
            row["error"] = f"not run: {r['missing']}"
            rows.append(row)
            continue
        errors = [e["error"] for w in workers for e in r["epoch"][w] + r["resume"][w] if "error" in e]
        for w in workers:
            ok = [e for e in r["epoch"][w] if "error" not in e]
            res = [e for e in r["resume"][w] if "error" not in e]
            if not ok:
                continue
            row[f"tokens_per_s_w{w}"] = max(e["tokens"] / e["wall"] for e in ok)
            row[f"tokens_per_cpu_s_w{w}"] = max(e["tokens"] / e["cpu"] for e in ok)
            loader_only = [e["tokens"] / e["cpu_loader"] for e in ok if e.get("cpu_loader")]
            row[f"tokens_per_loader_cpu_s_w{w}"] = max(loader_only) if loader_only else None
            row[f"cpu_s_w{w}"] = _best(ok, "cpu")
            row[f"first_batch_w{w}"] = _best(ok, "first_batch")
            row[f"resume_w{w}"] = _best(res, "resume_s")
            row[f"exact_w{w}"] = all(e["exact"] for e in res) if res and all(e["exact"] is not None for e in res) else None
            row[f"rss_w{w}"] = (_best(ok, "rss_main_mib"), _best(ok, "rss_worker_mib"))
            if "fill" not in row:  # the first worker count's (w0): each worker completes its own last batch
                row["fill"] = ok[0]["tokens"] / ok[0]["slots"]
                fillers = ok[0].get("filler_slots") or 0
                if fillers:
                    row["pack_fill"] = ok[0]["tokens"] / (ok[0]["slots"] - fillers)
            row["delivered"] = ok[0]["tokens"] / results["_num_tokens"]
            row["state_bytes"] = ok[0]["state_bytes"]
            row["resume_kind"] = res[0]["kind"] if res else ""
        if errors:
            row["error"] = "; ".join(sorted(set(errors)))[:300]
        rows.append(row)
    return rows


def _m(v: float | None) -> str:
    return "–" if v is None else f"{v / 1e6:.2f} M"


def _s(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f} s"


def table(rows: Sequence[dict[str, Any]], workers: Sequence[int]) -> str:
    head = ["loader", "boundaries"]
    for w in workers:
        head += [f"tok/s w{w}", f"tok/CPU-s w{w}", f"tok/CPU-s w{w}, no teardown"]
    head += ["w2 CPU / w0 CPU", "fill", "first batch w0", "resume " + " / ".join(f"w{w}" for w in workers),
             "exact", "state bytes", "RSS MiB (main + worker) " + " / ".join(f"w{w}" for w in workers), "notes"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 3) + "---|"]
    for r in rows:
        if "tokens_per_s_w" + str(workers[0]) not in r:
            lines.append("| " + " | ".join([r["loader"], r["boundaries"]] + ["–"] * (len(head) - 3) + [r.get("error", "")]) + " |")
            continue
        cells = [r["loader"], r["boundaries"]]
        for w in workers:
            cells += [_m(r.get(f"tokens_per_s_w{w}")), _m(r.get(f"tokens_per_cpu_s_w{w}")),
                      _m(r.get(f"tokens_per_loader_cpu_s_w{w}"))]
        c0, c2 = r.get(f"cpu_s_w{workers[0]}"), r.get(f"cpu_s_w{workers[-1]}")
        cells.append(f"{c2 / c0:.2f}×" if c0 and c2 else "–")
        cells.append(f"{100 * r['fill']:.2f}%")
        cells.append(_s(r.get(f"first_batch_w{workers[0]}")))
        resume = " / ".join(_s(r.get(f"resume_w{w}")) for w in workers)
        cells.append(resume + (" (replay)" if r.get("resume_kind") == "replay" else ""))
        exact = [r.get(f"exact_w{w}") for w in workers]
        cells.append("yes" if all(e is True for e in exact) else "–" if all(e is None for e in exact) else "**no**")
        cells.append("none" if r.get("state_bytes") is None else f"{r['state_bytes']:,}")
        cells.append(" / ".join(f"{m:.0f} + {k:.0f}" if m else "–" for m, k in (r.get(f"rss_w{w}", (None, None)) for w in workers)))
        notes = [f"{100 * r['pack_fill']:.2f}% without the filler packs completing the last batch"] if r.get(
            "pack_fill") else []
        cells.append("; ".join(notes + ([r["error"]] if r.get("error") else [])))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run(quick: bool = False, loaders: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Rows for ``benchmarks/run_all.py``."""
    with tempfile.TemporaryDirectory() as tmp:
        args = parse(["--quick", "--dir", tmp] if quick else ["--dir", tmp])
        args.loaders = list(loaders or args.loaders)
        results = collect(args, tmp, echo=False)
    return summarize(results, args.loaders, args.workers)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=float, default=None, help="corpus tokens (default 20e6; 1e6 with --quick)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--loaders", default=",".join(LOADERS))
    parser.add_argument("--workers", default="0,2")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 2; 1 with --quick)")
    parser.add_argument("--dir", default=None, help="keep the written corpus here and reuse it")
    parser.add_argument("--out", default=None, help="write the markdown report here")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--baseline", default=None,
                        help="another streampack checkout (e.g. the main branch): its streampack rows are "
                             "measured too, interleaved, as 'streampack (baseline)'")
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=("epoch", "resume"), help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.loaders = [x for x in args.loaders.split(",") if x]
    unknown = [x for x in args.loaders if x.removesuffix(BASELINE) not in BOUNDARIES]
    if unknown:
        parser.error(f"unknown loaders {unknown}; known: {list(BOUNDARIES)}")
    if args.baseline and not args.child:
        # each baseline row right after its own: the two run side by side in every round
        args.loaders = [y for x in args.loaders for y in ([x, x + BASELINE] if x.startswith("streampack") else [x])]
    args.workers = tuple(int(w) for w in args.workers.split(","))
    args.tokens = args.tokens or (1e6 if args.quick else 20e6)
    args.rounds = args.rounds or (1 if args.quick else 2)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        corpus = Corpus(CorpusSpec(tokens=int(args.tokens), capacity=CAPACITY), args.dir)
        fn = child_epoch if args.child == "epoch" else child_resume
        print(json.dumps(fn(args.loaders[0], corpus, args.workers[0], args.scratch)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        args.dir = args.dir or tmp
        os.makedirs(args.dir, exist_ok=True)
        scratch = tempfile.mkdtemp(dir=args.dir)
        results = collect(args, scratch)
    rows = summarize(results, args.loaders, args.workers)
    text = table(rows, args.workers)
    print(text)
    if args.out:
        command = " ".join(["python benchmarks/bench_loaders.py", *(sys.argv[1:] if argv is None else argv)])
        Path(args.out).write_text(
            f"# Loaders compared: the cost of a token\n\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · "
            f"{machine()}\n\nCommand: `{command}`\n\nVersions: "
            f"{versions(('streampack', 'torch', 'torchdata', 'numpy', 'pyarrow', 'webdataset', 'datasets', 'trl', 'mosaicml-streaming', 'litdata'))}\n\n"
            f"Corpus: {results['_corpus']}; capacity {CAPACITY}, 8 packs per batch, best of {args.rounds} interleaved "
            f"round(s) (every other one in reverse order), every run in a fresh process.\n\n{text}\n{__doc__.split(chr(10) + chr(10), 2)[2].split('    PYTHONPATH')[0]}")
    return 1 if any("error" in r and not r["error"].startswith("not run") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
