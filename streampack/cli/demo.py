"""``streampack demo``: the whole pipeline on a synthetic long-tail corpus, nothing downloaded.

The first run writes the corpus (:mod:`streampack.cli.corpus`, ~50 MB) and trains a byte-level BPE on its first 4 MB
into the cache directory; later runs reuse both. It streams the shards through ``PackedDataset`` and reports fill
against padding on the same documents, throughput, documents per pack, and one pack's layout with its ``cu_seqlens``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from streampack.cli._data import CliError, no_bar
from streampack.cli.render import fill_bar, glyphs, layout_block

_CHUNK = re.compile(r"/\d+$")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.add_argument("--cache-dir", default=None,
                   help="where the corpus and tokenizer live "
                        "(default $STREAMPACK_CACHE/demo or ~/.cache/streampack/demo)")
    p.add_argument("--capacity", type=int, default=4096, help="tokens per pack")
    p.add_argument("--window", type=int, default=1024, help="samples in the packer's rolling window")
    p.add_argument("--algorithm", default="bfd", help="packing algorithm (see streampack.packing.ALGORITHMS)")
    p.add_argument("--packs-per-batch", type=int, default=1, help="packs per THD micro-batch")
    p.add_argument("--cp-size", type=int, default=1, help="context parallel size (documents aligned to 2*cp*tp)")
    p.add_argument("--tp-size", type=int, default=1, help="tensor parallel size")
    p.add_argument("--batches", type=int, default=300, help="stop after this many batches")
    p.add_argument("--max-seconds", type=float, default=20.0, help="stop after this much streaming time")
    p.add_argument("--num-shards", type=int, default=8, help="corpus shards (first run)")
    p.add_argument("--docs-per-shard", type=int, default=1500, help="documents per shard (first run)")
    p.add_argument("--seed", type=int, default=0, help="corpus and shuffle seed")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars (they are off when stderr is not a terminal)")
    p.set_defaults(run=run)


def prepare_corpus(root: Path, *, num_shards: int, docs_per_shard: int, seed: int,
                   progress: bool) -> tuple[list[str], str, bool]:
    """Corpus shards and tokenizer path under ``root`` (made once per setting); the flag says
    whether they were reused."""
    from tqdm import tqdm

    from streampack.cli.corpus import train_demo_tokenizer, write_demo_corpus

    folder = root / f"corpus-{num_shards}x{docs_per_shard}-seed{seed}"
    marker = folder / "corpus.json"
    tok_path = folder / "tokenizer.json"
    if marker.is_file() and tok_path.is_file():
        shards = json.loads(marker.read_text())["shards"]
        if all((folder / s).is_file() for s in shards):
            return [str(folder / s) for s in shards], str(tok_path), True
    with tqdm(total=num_shards * docs_per_shard, unit="doc", desc="writing demo corpus",
              disable=no_bar(not progress), file=sys.stderr) as bar:
        paths = write_demo_corpus(folder, num_shards=num_shards, docs_per_shard=docs_per_shard,
                                  seed=seed, progress=bar.update)
    train_demo_tokenizer(paths, tok_path)
    marker.write_text(json.dumps({"shards": [Path(p).name for p in paths], "seed": seed}))
    return paths, str(tok_path), False


@dataclass(slots=True)
class Tally:
    """What the demo accumulates over the batches it streams."""

    doc_lengths: list[np.ndarray] = field(default_factory=list)
    docs_per_pack: list[int] = field(default_factory=list)
    layouts: list[tuple[list[int], list[int]]] = field(default_factory=list)
    tokens: int = 0
    slots: int = 0
    batches: int = 0
    chunks: int = 0

    def add(self, batch: Any) -> None:
        cu = batch.cu_seqlens.tolist()
        cup = batch.cu_seqlens_padded.tolist()
        self.doc_lengths.append(np.diff(np.asarray(cu)))
        self.tokens += batch.num_tokens
        self.slots += batch.total_tokens
        self.batches += 1
        self.chunks += sum(1 for k in batch.doc_keys if _CHUNK.search(k.rsplit("#", 1)[-1]))
        for p in range(batch.num_packs):
            lo, hi = p * batch.capacity, (p + 1) * batch.capacity
            docs = [i for i in range(len(cu) - 1) if lo <= cup[i] < hi]
            self.docs_per_pack.append(len(docs))
            if len(self.layouts) < 64 and docs:
                real = np.concatenate([[0], np.cumsum([cu[i + 1] - cu[i] for i in docs])]).tolist()
                padded = [cup[i] - lo for i in docs] + [cup[docs[-1] + 1] - lo]
                self.layouts.append((real, padded))


def padded_fills(lengths: np.ndarray, capacity: int, docs_per_batch: int, seed: int) -> tuple[float, float]:
    """Fill of pad-to-max (every document padded to ``capacity``) and pad-per-batch (documents
    in shuffled order, ``docs_per_batch`` at a time, padded to the longest of their batch)."""
    if len(lengths) == 0:
        return 0.0, 0.0
    to_max = lengths.sum() / (len(lengths) * capacity)
    shuffled = np.random.default_rng(seed).permutation(lengths)
    b = max(1, docs_per_batch)
    computed = sum(len(chunk) * int(chunk.max()) for chunk in np.array_split(shuffled, -(-len(shuffled) // b)))
    return float(to_max), float(lengths.sum() / computed)


def stream(urls: list[str], tokenizer: str, args: argparse.Namespace) -> tuple[Tally, float]:
    from tqdm import tqdm

    from streampack import PackedDataset
    from streampack.options import PackOptions, TopologyOptions

    ds = PackedDataset(urls, capacity=args.capacity, packs_per_batch=args.packs_per_batch, tokenizer=tokenizer,
                       seed=args.seed, shuffle=True, epochs=1,
                       packing=PackOptions(window=args.window, algorithm=args.algorithm),
                       topology=TopologyOptions(cp_size=args.cp_size, tp_size=args.tp_size))
    tally = Tally()
    start = time.perf_counter()
    with tqdm(total=args.batches, unit="batch", desc="packing", disable=no_bar(args.no_progress),
              file=sys.stderr) as bar:
        for batch in ds:
            tally.add(batch)
            bar.update(1)
            bar.set_postfix(fill=f"{tally.tokens / tally.slots:.1%}", refresh=False)
            if tally.batches >= args.batches or time.perf_counter() - start > args.max_seconds:
                break
    return tally, time.perf_counter() - start


def pick_layout(tally: Tally) -> int:
    """Index of a typical pack worth a picture: among packs whose document count is within
    2 of the mean, the one with the most varied document lengths."""
    counts = np.asarray([len(r) - 1 for r, _ in tally.layouts])
    near = np.abs(counts - np.mean(tally.docs_per_pack)) <= 2
    spread = [np.std(np.diff(r)) / max(1.0, np.mean(np.diff(r))) for r, _ in tally.layouts]
    score = np.where(near, spread, -1.0)
    return int(np.argmax(score))


def report(tally: Tally, seconds: float, args: argparse.Namespace, out: Any = None) -> None:
    out = sys.stdout if out is None else out
    lengths = np.concatenate(tally.doc_lengths) if tally.doc_lengths else np.zeros(0, np.int64)
    per_pack = np.asarray(tally.docs_per_pack)
    fill = tally.tokens / tally.slots if tally.slots else 0.0
    b = round(per_pack.mean() * args.packs_per_batch)
    to_max, per_batch = padded_fills(lengths, args.capacity, b, args.seed)
    g = glyphs(out)
    w = 34
    print(f"\nStreamed {tally.batches} batches ({len(per_pack)} packs of {args.capacity} tokens) "
          f"in {seconds:.1f} s: {tally.tokens:,} real tokens, {len(lengths):,} documents", file=out)
    print(f"Throughput: {tally.tokens / seconds:,.0f} tokens/s, {len(per_pack) / seconds:,.1f} packs/s "
          f"(read + tokenize + pack + collate, 1 process)", file=out)
    print(f"\nFill = real tokens / tokens computed, same {len(lengths):,} documents:", file=out)
    rows = [(f"streampack ({args.algorithm}, window {args.window})", fill),
            (f"pad per batch ({b} docs/batch)", per_batch), (f"pad to max ({args.capacity})", to_max)]
    for label, value in rows:
        print(f"  {label:<{w}} {fill_bar(value, glyph=g)} {value:7.2%}", file=out)
    print("  (streaming steady state: the packer emits near-full packs and carries the rest; "
          "the end-of-epoch flush is less full)", file=out)
    if to_max > 0:
        print(f"  -> {fill / to_max:.1f}x fewer tokens computed than pad-to-max, "
              f"{fill / per_batch:.1f}x fewer than pad-per-batch", file=out)
    print(f"\nDocuments per pack: mean {per_pack.mean():.1f}, min {per_pack.min()}, max {per_pack.max()}; "
          f"document length mean {lengths.mean():.0f}, max {lengths.max()} tokens; "
          f"{tally.chunks} chunks of split overlong documents", file=out)
    k = pick_layout(tally)
    real, padded = tally.layouts[k]
    print("\n" + layout_block(real, padded, capacity=args.capacity, stream=out,
                              title=f"Layout of pack #{k} ({len(real) - 1} documents, "
                                    f"{real[-1] / args.capacity:.1%} full):"), file=out)


def run(args: argparse.Namespace) -> int:
    for name in ("capacity", "window", "batches", "num_shards", "docs_per_shard", "packs_per_batch",
                 "cp_size", "tp_size"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.max_seconds <= 0:
        raise CliError(f"--max-seconds={args.max_seconds} must be > 0")
    from streampack.graph import StreamConfig
    from streampack.io.index_cache import default_cache_dir
    from streampack.options import PackOptions, TopologyOptions
    from streampack.packing import ALGORITHMS

    if args.algorithm not in ALGORITHMS:  # checked before the corpus is written
        raise CliError(f"--algorithm={args.algorithm!r} is not one of {sorted(ALGORITHMS)}")
    try:  # every setting, by the records the pipeline takes, before the corpus is written
        StreamConfig(capacity=args.capacity, packs_per_batch=args.packs_per_batch,
                     packing=PackOptions(window=args.window, algorithm=args.algorithm),
                     topology=TopologyOptions(cp_size=args.cp_size, tp_size=args.tp_size))
    except ValueError as e:
        raise CliError(str(e)) from None
    root = Path(args.cache_dir).expanduser() if args.cache_dir else Path(default_cache_dir()) / "demo"
    urls, tokenizer, reused = prepare_corpus(root, num_shards=args.num_shards, docs_per_shard=args.docs_per_shard,
                                             seed=args.seed, progress=not args.no_progress)
    size = sum(os.path.getsize(u) for u in urls) / 1e6
    print(f"corpus: {len(urls)} tar shards, {args.num_shards * args.docs_per_shard:,} text documents, "
          f"{size:.1f} MB in {Path(urls[0]).parent} ({'reused' if reused else 'written now'})")
    print(f"tokenizer: byte-level BPE {tokenizer}")
    print(f"pipeline: PackedDataset(capacity={args.capacity}, packs_per_batch={args.packs_per_batch}, "
          f"packing=PackOptions(window={args.window}, algorithm={args.algorithm!r}, overlong='split'), "
          f"topology=TopologyOptions(cp_size={args.cp_size}, tp_size={args.tp_size}))")
    tally, seconds = stream(urls, tokenizer, args)
    if tally.batches == 0:
        raise ValueError("the pipeline produced no batches")
    report(tally, seconds, args)
    return 0
