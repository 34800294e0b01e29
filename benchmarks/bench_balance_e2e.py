"""End to end: 16 ranks of real ``PackedDataset`` readers, straggler factor over steps 0–500.

    PYTHONPATH=. python benchmarks/bench_balance_e2e.py                  # ~5 min, writes 0.3 GB of shards
    PYTHONPATH=. python benchmarks/bench_balance_e2e.py --steps 100 --docs 20000   # a quick look
    PYTHONPATH=. python benchmarks/bench_balance_e2e.py --out /tmp/balance_e2e_results.md

Unlike ``bench_balance.py`` (a lengths-only simulator of 1,024 ranks), every rank here is a
``PackedDataset(dp_rank=r, dp_size=16, balance=...)`` reading tar shards of pre-tokenized
documents (npy, one byte per token) through the whole graph — reader, overlong, window packer,
reservoir, collate — from step 0 of a fresh run, the way a training job starts. Each mode runs
the 16 ranks one after another in this process (``num_workers=0``, an infinite stream), and
records the document lengths of every batch.

Lengths: generated, not real text (no corpus is downloaded here): ``bench_balance.doc_lengths``,
98% lognormal (median 1,000, sigma 1.2) and 2% Pareto (alpha 1.2 from 8,000), clipped to the
capacity — a long tail like web text's (mean ~2,500 tokens). Capacity 131,072, one pack per
batch, window 1,024, Llama-3-8B cost model (training FLOPs). A step's cost on a rank is its
batch's ``linear · tokens + attention · Σ L²``, evaluated twice: with the FLOP model the packer
balances by, and with attention 1.5× heavier (what an H100 measured: the balancer does not know).

Modes (``--modes`` picks some): token-only (``balance=None``), cost-balanced with a cold histogram
(``Balance(seeded=False)``: every reader counts from nothing) and cost-balanced as shipped (the
histogram seeded from the shard indexes, :mod:`streampack.plan.cost_seed`), without a manifest
and with one (``ReadOptions(manifest=...)``, built once here). Reported: the straggler factor (max
over ranks / mean, per step) averaged over steps ``[0, steps)`` and over the second half alone,
its 99th percentile, fill, and the wall and CPU seconds each mode took. With ``--data`` it also
reports what one reader's seed costs without a manifest, with an empty and a warm index cache.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_balance import LLAMA3_8B, doc_lengths  # noqa: E402
from helpers_data import split_docs, tar_members, write_tar  # noqa: E402
from report import emit  # noqa: E402

from streampack.dataset import PackedDataset  # noqa: E402
from streampack.io.decode import DecodeOptions
from streampack.io.index import index_decode  # noqa: E402
from streampack.io.limits import Limits  # noqa: E402
from streampack.io.manifest import build_manifest  # noqa: E402
from streampack.options import CostOptions, PackOptions, ReadOptions, TopologyOptions  # noqa: E402
from streampack.packing import CostModel  # noqa: E402
from streampack.packing.schedule import Balance  # noqa: E402

CAPACITY = 131072


@dataclass(frozen=True, slots=True, kw_only=True)
class Mode:
    balance: Balance | None
    """The packer's balance (None: token-only)."""
    manifest: bool = False
    """Whether the readers are given the data set's manifest (``ReadOptions(manifest=...)``)."""


MODES: dict[str, Mode] = {
    "token-only": Mode(balance=None),
    "cost-balanced, cold histogram": Mode(balance=Balance(seeded=False)),
    "cost-balanced, seeded, no manifest": Mode(balance=Balance()),
    "cost-balanced, seeded, manifest": Mode(balance=Balance(), manifest=True),
}


def write_data(directory: str, docs: int, shards: int, seed: int = 0) -> list[str]:
    """``docs`` uint8 token documents of the long-tail lengths in ``shards`` tar shards (kept
    between runs: the same arguments reuse them)."""
    rng = np.random.default_rng(seed)
    lengths = doc_lengths(rng, docs, CAPACITY)
    paths = [os.path.join(directory, f"shard-{s:06d}.tar") for s in range(shards)]
    if all(os.path.exists(p) for p in paths):
        return paths
    os.makedirs(directory, exist_ok=True)
    for path, docs_of in zip(paths, split_docs(docs, shards)):
        write_tar(path, [(f"{i:08d}", tar_members(np.full(lengths[i], i % 251), fmt="npy", dtype=np.uint8))
                         for i in docs_of])
    return paths


def run_ranks(urls: list[str], ranks: int, steps: int, balance: Balance | None,
              read: ReadOptions) -> tuple[np.ndarray, np.ndarray]:
    """float64 ``[steps, ranks]`` tokens and Σ L² of each rank's batch at each step."""
    tokens, squares = np.zeros((steps, ranks)), np.zeros((steps, ranks))
    for r in range(ranks):
        ds = PackedDataset(urls, capacity=CAPACITY, packing=PackOptions(window=1024), seed=0,
                           topology=TopologyOptions(dp_rank=r, dp_size=ranks),
                           cost=CostOptions(model=LLAMA3_8B, balance=balance), read=read)
        for step, batch in zip(range(steps), ds):
            real = [n for n, k in zip(batch.doc_lengths.tolist(), batch.doc_keys) if k != "<filler>"]
            lengths = np.asarray(real, dtype=np.float64)
            tokens[step, r], squares[step, r] = lengths.sum(), lengths @ lengths
    return tokens, squares


def straggler(cost: np.ndarray) -> np.ndarray:
    """Per step: max over ranks / mean over ranks."""
    return cost.max(1) / cost.mean(1)


def run(quick: bool = False, *, docs: int = 120_000, shards: int = 64, ranks: int = 16, steps: int = 500,
        data: str | None = None, modes: list[str] | None = None) -> list[dict[str, Any]]:
    """Rows for ``benchmarks/run_all.py``; ``quick``: 4 ranks, 40 steps, 8,000 documents."""
    if quick:
        docs, shards, ranks, steps = 8_000, 8, 4, 40
    model = CostModel.from_shape(**LLAMA3_8B)
    heavy = {"FLOP model": model.attention, "attention 1.5x": 1.5 * model.attention}
    with tempfile.TemporaryDirectory() as tmp:
        urls = write_data(data or os.path.join(tmp, "shards"), docs, shards)
        cache = os.path.join(tmp, "cache")
        rows = []
        for name in modes or list(MODES):
            mode = MODES[name]
            read = ReadOptions(cache_dir=cache)
            if mode.manifest:
                location = os.path.join(tmp, "manifest")
                if not os.path.exists(location):
                    build_manifest(urls, location, decode=index_decode(DecodeOptions(limits=Limits())))
                read = ReadOptions(cache_dir=cache, manifest=location)
            started, cpu = time.perf_counter(), time.process_time()
            tokens, squares = run_ranks(urls, ranks, steps, mode.balance, read)
            seconds = round(time.perf_counter() - started, 1)
            cpu_seconds = round(time.process_time() - cpu, 1)
            for truth, attention in heavy.items():
                sf = straggler(model.linear * tokens + attention * squares)
                rows.append({"mode": name, "true cost": truth, "ranks": ranks, "steps": f"0-{steps}",
                             "straggler": round(float(sf.mean()), 4),
                             "straggler 2nd half": round(float(sf[steps // 2:].mean()), 4),
                             "straggler_p99": round(float(np.quantile(sf, 0.99)), 4),
                             "fill_%": round(100 * float(tokens.sum()) / (tokens.size * CAPACITY), 3),
                             "seconds": seconds, "cpu_seconds": cpu_seconds})
            print(f"bench_balance_e2e: {name} done ({seconds} s)", file=sys.stderr, flush=True)
    return rows


def seed_cost(urls: list[str], ranks: int, repeats: int = 3) -> list[dict[str, Any]]:
    """CPU seconds of one reader's seed (``plan.cost_seed.seed_levels``) without a manifest: with an empty
    index cache (it builds the sampled shards' indexes) and a warm one (it loads them), least of ``repeats``."""
    from streampack.io import index
    from streampack.plan.cost_seed import SEED_SAMPLES, seed_levels
    from streampack.settings import Placement

    place = Placement(dp_rank=1, dp_size=ranks)
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for label in ("empty", "warm"):
            best = float("inf")
            for _ in range(1 if label == "empty" else repeats):
                index._memo.clear()  # a fresh reader's process
                ds = PackedDataset(urls, capacity=CAPACITY, packing=PackOptions(window=1024), seed=0,
                                   topology=TopologyOptions(dp_rank=1, dp_size=ranks),
                                   cost=CostOptions(model=LLAMA3_8B, balance=Balance()),
                                   read=ReadOptions(cache_dir=cache))
                cpu = time.process_time()
                counts = seed_levels(ds.config, ds.sources, place, planner=lambda: None)
                best = min(best, time.process_time() - cpu)
            assert counts is not None
            per_shard = len(index.load_or_build_index(urls[0], cache_dir=cache))
            rows.append({"index cache": label, "shards read": min(-(-SEED_SAMPLES // per_shard), len(urls)),
                         "samples a shard": per_shard, "seed CPU s": round(best, 3)})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=120_000, help="documents written (the stream repeats them)")
    p.add_argument("--shards", type=int, default=64)
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--data", help="keep the shards in this directory (reused when present)")
    p.add_argument("--out", help="also write the markdown table here")
    p.add_argument("--modes", nargs="+", choices=list(MODES), metavar="MODE",
                   help=f"run only these (default all): {', '.join(repr(m) for m in MODES)}")
    args = p.parse_args(argv)
    rows = run(docs=args.docs, shards=args.shards, ranks=args.ranks, steps=args.steps, data=args.data,
               modes=args.modes)
    head = (f"{args.ranks} ranks of PackedDataset, capacity {CAPACITY}, 1 pack per batch, {args.docs} generated "
            f"long-tail documents in {args.shards} tar shards, Llama-3-8B cost model; straggler over steps "
            f"0-{args.steps}")
    text = head + "\n\n" + markdown(rows)
    if args.data:  # the shards are kept: what one reader's seed costs without a manifest
        urls = write_data(args.data, args.docs, args.shards)
        text += "\n\nOne reader's seed without a manifest (its CPU, least of 3 when warm):\n\n" + markdown(
            seed_cost(urls, args.ranks))
    return emit(text, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
