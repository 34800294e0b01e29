"""streampack side by side with the loaders people use today, on one pre-tokenized corpus.

Every loader reads the same documents (see ``peers/corpus.py``; default 30M tokens,
lognormal lengths with mean 600, capacity 4096) from its own format and delivers batches of
8 packs of 4096 slots: streampack (``PackedDataset`` + ``StatefulDataLoader``, tar shards, and
parquet once streampack reads it), Mosaic ``streaming`` (MDS) with llm-foundry's bin packing,
``litdata`` (optimized chunks + ``TokensLoader``), webdataset with greedy packing, and HF
``datasets`` streaming parquet with TRL's BFD. Per loader: real tokens/s per DataLoader worker
with 1 and 2 workers, fill, share of the corpus's tokens delivered in one epoch, time to resume
80% into the epoch, whether the resumed stream is exact, and the state's ``torch.save`` size
(``peers/measure.py`` says exactly how). Prints the markdown report; ``--out FILE`` writes it
there instead (the table is still printed).

The peers are not streampack dependencies: they live in their own virtual environment that
sees the system packages (``benchmarks/requirements-peers.txt`` says how to make it). A peer
that is not installed gets a "not installed" row; the rest still run.

    PYTHONPATH=. /work/venv-peers/bin/python benchmarks/bench_peers.py            # full run
    PYTHONPATH=. python benchmarks/bench_peers.py --quick --peers streampack,webdataset
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the peers package, also when run_all loads this file by path
if (HERE.parent / "streampack").is_dir():
    sys.path.insert(0, str(HERE.parent))  # measure this checkout's streampack

from peers import DISTRIBUTIONS, PEERS  # noqa: E402
from peers.corpus import Corpus, CorpusSpec  # noqa: E402
from peers.measure import Result, best_of, measure  # noqa: E402
from peers.report import document, table  # noqa: E402

FULL_TOKENS = 30_000_000
QUICK_TOKENS = 1_000_000


def compare(names: Sequence[str], corpus: Corpus, *, capacity: int, workers: tuple[int, ...],
            resume_at: float, repeats: int = 1, echo: bool = True) -> list[Result]:
    """One result per loader; with ``repeats > 1`` the loaders take turns (round robin), so a
    busy spell on a shared machine does not land on one loader's runs only."""
    peers = {name: PEERS[name](capacity) for name in names}
    runs: dict[str, list[Result]] = {}
    failed: dict[str, Result] = {}
    for name, peer in peers.items():
        why = peer.missing()
        if why is not None:
            failed[name] = Result(peer=peer.name, fmt=peer.fmt, packing=peer.packing, error=f"not run: {why}")
    for repeat in range(repeats):
        for name, peer in peers.items():
            if name in failed:
                continue
            if echo:
                print(f"measuring {peer.name} ({repeat + 1}/{repeats}) ...", file=sys.stderr, flush=True)
            try:
                runs.setdefault(name, []).append(measure(peer, corpus, workers=workers, resume_at=resume_at))
            except Exception as e:  # one broken peer must not hide the others' numbers
                if echo:
                    traceback.print_exc()
                failed[name] = Result(peer=peer.name, fmt=peer.fmt, packing=peer.packing,
                                      error=f"failed: {type(e).__name__}: {e}")
    return [failed[name] if name in failed else best_of(runs[name]) for name in names]


def run(quick: bool = False, peers: Sequence[str] | None = None, directory: str | None = None) -> list[dict[str, Any]]:
    """Rows for ``benchmarks/run_all.py`` (the peers installed in this interpreter)."""
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Corpus(CorpusSpec(tokens=QUICK_TOKENS if quick else FULL_TOKENS), directory or tmp)
        results = compare(list(peers or PEERS), corpus, capacity=4096, workers=(1, 2), resume_at=0.8, echo=False)
    rows = []
    for r in results:
        row: dict[str, Any] = {"loader": r.peer}
        row.update({f"tokens_per_s_per_worker_{n}w": v for n, v in r.tokens_per_s_per_worker.items()})
        row.update(fill=r.fill, delivered=r.delivered, resume_s=r.resume_s, resume=r.resume_kind,
                   exact=r.resume_exact, state_bytes=r.state_bytes, notes="; ".join(r.notes) or r.error)
        rows.append(row)
    return rows


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=float, default=None,
                        help=f"corpus size in tokens (default {FULL_TOKENS:.0e}; {QUICK_TOKENS:.0e} with --quick)")
    parser.add_argument("--quick", action="store_true", help="a small corpus (smoke run)")
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, from {','.join(PEERS)}")
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--workers", default="1,2", help="DataLoader worker counts (the first also resumes)")
    parser.add_argument("--resume-at", type=float, default=0.8, help="share of the epoch's tokens before the checkpoint")
    parser.add_argument("--repeats", type=int, default=1,
                        help="report the best of this many runs of each timing (on a shared machine)")
    parser.add_argument("--dir", default=None, help="keep the written corpus here and reuse it on reruns")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None,
                        help="write the markdown report here (default: print it)")
    args = parser.parse_args(argv)
    args.peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = [p for p in args.peers if p not in PEERS]
    if unknown:
        parser.error(f"unknown peers {unknown}; known: {list(PEERS)}")
    args.workers = tuple(int(w) for w in args.workers.split(","))
    if any(w < 1 for w in args.workers) or not 0 < args.resume_at < 1 or args.repeats < 1:
        parser.error("--workers and --repeats must be >= 1 and --resume-at in (0, 1)")
    if args.tokens is None:
        args.tokens = QUICK_TOKENS if args.quick else FULL_TOKENS
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    spec = CorpusSpec(tokens=int(args.tokens), capacity=args.capacity, seed=args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Corpus(spec, args.dir or tmp)
        results = compare(args.peers, corpus, capacity=args.capacity, workers=args.workers,
                          resume_at=args.resume_at, repeats=args.repeats)
        described = corpus.describe()
    command = shlex.join([os.path.basename(sys.executable), "benchmarks/bench_peers.py",
                          *(sys.argv[1:] if argv is None else argv)])
    settings = (f"capacity {args.capacity}, 8 packs per batch, DataLoader workers {list(args.workers)}, "
                f"checkpoint after {args.resume_at:.0%} of the corpus's tokens (resumed with "
                f"{args.workers[0]} worker{'s' if args.workers[0] > 1 else ''}), best of {args.repeats} "
                f"run{'s' if args.repeats > 1 else ''} per timing")
    report = document(results=results, workers=args.workers, corpus=described, command=command,
                      distributions=DISTRIBUTIONS, settings=settings, resume_at=args.resume_at)
    if args.out:
        print(table(results, args.workers, args.resume_at))
        Path(args.out).write_text(report)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        print(report)
    return 1 if any(r.error.startswith("failed") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
