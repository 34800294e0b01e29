"""Time to the first batch, by window and document length, with and without the packer's warm-up.

Without the warm-up a fresh packer reads and tokenizes a whole window (``window`` samples per DataLoader
worker) before it emitted a pack; with the warm-up (:mod:`streampack.packing.window_rounds`) its
first round holds ``warmup`` = 64 samples and each later round doubles, up to ``window``.

Rows:

- ``first_batch``: text shards (the demo's synthetic corpus, tar) of documents averaging
  ``doc_tokens`` tokens, the demo BPE tokenizer, capacity 4096, ``PackedDataset`` under a torch
  ``DataLoader`` with 2 workers: seconds from ``iter(loader)`` (workers start) to the first batch,
  best of ``runs``, warm-up on (the default) and off (``warmup >= window``).
- ``fill``: the whole-epoch fill the warm-up costs, from the packer's own round logic
  (``window_rounds.count_packs``) on lognormal lengths (sigma 1), capacity 4096.

    python benchmarks/bench_first_batch.py [--runs 3] [--quick] [--windows 256,1024] [--doc-tokens 1900] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from report import emit  # benchmarks/report.py (this folder is on sys.path)

CAP = 4096
WORKERS = 2
TOKENS_PER_WORD = 624 / 430  # the demo corpus: 430 mean words -> 624 mean tokens with its BPE


def corpus(root: Path, doc_tokens: int, docs: int) -> tuple[list[str], str]:
    from streampack.cli.corpus import train_demo_tokenizer, write_demo_corpus

    urls = write_demo_corpus(root / f"corpus-{doc_tokens}", num_shards=4, docs_per_shard=-(-docs // 4),
                             mean_words=doc_tokens / TOKENS_PER_WORD)
    return urls, str(train_demo_tokenizer(urls[:1], root / f"tokenizer-{doc_tokens}.json", sample_bytes=2_000_000))


def set_warmup(value: int) -> None:
    """The default warm-up of every packer built from now on (and in forked workers): the off
    arm sets it past the window, which is the packer as it was before the warm-up."""
    from streampack.packing.window_rounds import PackerRules

    PackerRules.__init__.__kwdefaults__["warmup"] = value


def first_batch_seconds(urls: list[str], tokenizer: str, window: int, runs: int) -> float:
    from torch.utils.data import DataLoader

    from streampack import PackedDataset
    from streampack.options import PackOptions, TokenizeOptions

    ds = PackedDataset(urls, capacity=CAP, tokenizer=tokenizer, seed=1, tokenize=TokenizeOptions(eos_id=0),
                       packing=PackOptions(window=window))
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        it = iter(DataLoader(ds, batch_size=None, num_workers=WORKERS))
        next(it)
        best = min(best, time.perf_counter() - start)
        del it  # shuts the workers down
    return best


def fill_rows(windows: list[int], sizes: list[int]) -> list[dict[str, Any]]:
    from streampack.packing.window_rounds import WARMUP, PackerRules, count_packs

    rows = []
    for mean in (600, 1900):
        for n in sizes:
            rng = np.random.default_rng(0)
            lengths = rng.lognormal(np.log(mean) - 0.5, 1.0, n).astype(np.int64).clip(1, CAP)
            for window in windows:
                fills = {wu: lengths.sum() / (count_packs(PackerRules(capacity=CAP, window=window, warmup=wu),
                                                          lengths) * CAP) for wu in (window, WARMUP)}
                rows.append({"case": "fill", "doc_tokens": mean, "samples": n, "window": window,
                             "fill_off": round(float(fills[window]), 5), "fill_on": round(float(fills[WARMUP]), 5),
                             "cost_pp": round(float(fills[window] - fills[WARMUP]) * 100, 4)})
    return rows


def run(runs: int = 3, quick: bool = False, windows: list[int] | None = None,
        doc_sizes: list[int] | None = None) -> list[dict[str, Any]]:
    from streampack.packing.window_rounds import WARMUP

    windows = windows or ([256, 1024] if quick else [256, 1024, 4096])
    doc_sizes = doc_sizes or ([1900] if quick else [600, 1900])
    runs = 1 if quick else runs
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for doc_tokens in doc_sizes:
            # enough documents that every worker fills its largest window (shards split by sample)
            urls, tokenizer = corpus(Path(tmp), doc_tokens, WORKERS * max(windows) + 256)
            for window in windows:
                row: dict[str, Any] = {"case": "first_batch", "doc_tokens": doc_tokens, "window": window,
                                       "workers": WORKERS, "runs": runs}
                for arm, warmup in (("on", WARMUP), ("off", window)):
                    set_warmup(warmup)
                    try:
                        row[f"seconds_{arm}"] = round(first_batch_seconds(urls, tokenizer, window, runs), 2)
                    finally:
                        set_warmup(WARMUP)
                rows.append(row)
    rows += fill_rows([256, 1024, 4096], [20_000] if quick else [20_000, 200_000])
    return rows


def to_markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| doc tokens (mean) | window | first batch, warm-up on | off (before) |", "|---|---|---|---|"]
    out += [f"| {r['doc_tokens']} | {r['window']} | {r['seconds_on']:.2f} s | {r['seconds_off']:.2f} s |"
            for r in rows if r["case"] == "first_batch"]
    out += ["", "| doc tokens (mean) | samples | window | fill off | fill on | cost (pp) |",
            "|---|---|---|---|---|---|"]
    out += [f"| {r['doc_tokens']} | {r['samples']:,} | {r['window']} | {r['fill_off']:.5f} | {r['fill_on']:.5f} | "
            f"{r['cost_pp']:.4f} |" for r in rows if r["case"] == "fill"]
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--windows", default=None, help="comma-separated (default 256,1024,4096)")
    parser.add_argument("--doc-tokens", default=None, help="comma-separated mean document tokens (default 600,1900)")
    parser.add_argument("--out", default=None, help="also write the markdown tables here")
    args = parser.parse_args()
    ints = lambda text: [int(x) for x in text.split(",")] if text else None  # noqa: E731
    rows = run(args.runs, args.quick, ints(args.windows), ints(args.doc_tokens))
    head = (f"Time to first batch (best of {1 if args.quick else args.runs}; Python {sys.version.split()[0]}, "
            f"{WORKERS} DataLoader workers, capacity {CAP}, text shards + BPE tokenizer):\n\n")
    return emit(head + to_markdown(rows), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
