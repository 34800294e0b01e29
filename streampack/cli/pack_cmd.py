"""``streampack pack``: offline packing into packed tar shards + ``manifest.json``.

For a dataset reused across many runs, where the best fill matters more than streaming: every
sequence is read and all aligned lengths packed at once. All ids are held in memory (int64,
~1.2 GB per 150M tokens): beyond a few hundred million tokens, pack per subset.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import TYPE_CHECKING

import numpy as np

from streampack.cli._data import CliError, Documents, add_input_guards, input_guards, no_bar
from streampack.errors import ON_ERROR_CHOICES

if TYPE_CHECKING:
    from streampack.nodes.overlong import OverlongCounters

# streampack.options.packing's OVERLONG_POLICIES, written out: importing it loads torch (~3 s), and the
# parser (``--help``, a usage error) must not wait for that; tests/unit/cli/test_cli.py pins them equal.
OVERLONG_POLICIES: tuple[str, ...] = ("split", "truncate", "drop", "error")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("urls", nargs="+", help="input shards: paths, globs, brace patterns or a directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--capacity", type=int, required=True, help="tokens per pack")
    p.add_argument("--algorithm", default="bfd", help="packing algorithm (default bfd)")
    p.add_argument("--cp-size", type=int, default=1,
                   help="context-parallel size: documents aligned to 2*cp*tp (default 1)")
    p.add_argument("--tp-size", type=int, default=1,
                   help="tensor-parallel size: alignment tp without CP (sequence parallelism; default 1)")
    p.add_argument("--align-multiple", type=int, default=1,
                   help="extra per-document multiple, e.g. 16 for FP8 (PackedDataset's align_multiple)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json for text shards")
    p.add_argument("--tokens-key", default="input_ids", help="field holding token ids (default %(default)s)")
    p.add_argument("--text-key", default="text", help="json field holding text (default %(default)s)")
    p.add_argument("--labels-key", default=None, help="json field with each sample's own unshifted labels")
    p.add_argument("--loss-mask-key", default=None, help="json field with a per-token 0/1 loss mask")
    p.add_argument("--bos-id", type=int, default=None, help="id added before each tokenized text")
    p.add_argument("--eos-id", type=int, default=None, help="id added after each tokenized text")
    p.add_argument("--on-error", default="raise", choices=ON_ERROR_CHOICES,
                   help="bad samples: raise (default) or skip and count them")
    p.add_argument("--overlong", default="split", choices=OVERLONG_POLICIES,
                   help="documents longer than capacity (default split)")
    p.add_argument("--packs-per-shard", type=int, default=1000, help="packs per output tar shard (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="seed of randomized algorithms")
    add_input_guards(p)
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars (they are off when stderr is not a terminal)")
    p.set_defaults(run=run)


def _overlong_summary(c: OverlongCounters) -> str:
    return (f"{c.samples_split} split into {c.chunks_created} chunks, {c.samples_truncated} truncated "
            f"({c.tokens_truncated} tokens cut), {c.samples_dropped} dropped ({c.tokens_dropped} tokens)")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from streampack.graph import StreamConfig
    from streampack.io.packed_writer import write_packed_dataset
    from streampack.nodes.overlong import OverlongCounters, apply_overlong
    from streampack.options import ReadOptions, TokenizeOptions, TopologyOptions
    from streampack.packing import ALGORITHMS, pack, packing_metrics

    if args.algorithm not in ALGORITHMS:
        raise CliError(f"--algorithm={args.algorithm!r} is not one of {sorted(ALGORITHMS)}")
    for name in ("cp_size", "tp_size", "align_multiple", "packs_per_shard"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    try:  # the capacity against the alignment, checked where every stream's config is made
        topology = TopologyOptions(cp_size=args.cp_size, tp_size=args.tp_size, align_multiple=args.align_multiple)
        align = StreamConfig(capacity=args.capacity, topology=topology).topology.align
    except ValueError as e:
        raise CliError(f"--capacity: {e}") from None
    read = ReadOptions(tokens_key=args.tokens_key, text_key=args.text_key, labels_key=args.labels_key,
                       loss_mask_key=args.loss_mask_key, on_error=args.on_error, **input_guards(args))
    samples = Documents(args.urls, read, capacity=args.capacity, tokenizer=args.tokenizer,
                        tokenize=TokenizeOptions(bos_id=args.bos_id, eos_id=args.eos_id))
    counters = OverlongCounters()
    docs = []
    start = time.perf_counter()
    with tqdm(desc="reading", unit="sample", disable=no_bar(args.no_progress), file=sys.stderr) as bar:
        for s in samples:
            if s.tokens is None:
                raise CliError(f"sample {s.doc_key!r} is text: pass --tokenizer PATH/tokenizer.json")
            docs.extend(apply_overlong(s, args.capacity, args.overlong, counters))
            bar.update(1)
    if not docs:
        raise CliError(f"no non-empty samples in {args.urls}")
    lengths = np.asarray([len(d) for d in docs], dtype=np.int64)
    aligned = -(-lengths // align) * align
    bins = pack(aligned, args.capacity, algorithm=args.algorithm, seed=args.seed)
    metrics = dataclasses.asdict(packing_metrics(aligned, bins, args.capacity))  # ints and floats: JSON as they are
    metrics["fill"] = float(lengths.sum() / (len(bins) * args.capacity))
    with tqdm(total=len(bins), desc="writing", unit="pack", disable=no_bar(args.no_progress), file=sys.stderr) as bar:
        manifest = write_packed_dataset(
            docs, bins, args.out, capacity=args.capacity, align=align, cp_size=args.cp_size,
            tp_size=args.tp_size, algorithm=args.algorithm, seed=args.seed,
            packs_per_shard=args.packs_per_shard, metrics=metrics, progress=bar.update,
            extra={"sources": [str(u) for u in args.urls], "overlong": args.overlong,
                   "overlong_counters": counters.as_dict(), "errors": samples.nodes["errors"].as_dict()},
        )
    seconds = time.perf_counter() - start
    print(f"packed {len(docs):,} documents ({int(lengths.sum()):,} tokens) into {manifest.num_packs:,} "
          f"packs of {args.capacity} in {len(manifest.shards)} shards under {args.out} ({seconds:.1f} s)")
    print(f"algorithm {args.algorithm}, align {align} (cp_size={args.cp_size}, tp_size={args.tp_size}): "
          f"fill {metrics['fill']:.2%}, {len(docs) / manifest.num_packs:.1f} documents per pack; "
          f"overlong={args.overlong!r}: {_overlong_summary(counters)}")
    return 0
