"""``streampack pack``: offline packing into packed tar shards + ``manifest.json``.

For a dataset reused across many runs, where the best fill matters more than streaming: every
sequence is read and all aligned lengths packed at once. All ids are held in memory (int64,
~1.2 GB per 150M tokens): beyond a few hundred million tokens, pack per subset, or run it as the ranks of a
torchrun / SLURM job, each of which packs and holds only its share (:mod:`streampack.cli.pack_parts`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from streampack.cli._data import CliError, Documents, add_input_guards, input_guards, no_bar
from streampack.cli.ranks import add_rank_arguments
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
    add_rank_arguments(p)
    p.set_defaults(run=run)


def _overlong_summary(c: OverlongCounters) -> str:
    return (f"{c.samples_split} split into {c.chunks_created} chunks, {c.samples_truncated} truncated "
            f"({c.tokens_truncated} tokens cut), {c.samples_dropped} dropped ({c.tokens_dropped} tokens)")


@dataclass(frozen=True, slots=True, kw_only=True)
class Packed:
    """One process's packing of its shards, before anything is written."""

    docs: list[Any]
    """The documents after the overlong policy (Samples)."""
    bins: list[np.ndarray]
    lengths: np.ndarray
    """int64 ``[D]``: each document's tokens."""
    metrics: dict[str, Any]
    fields: list[str]
    """The tar fields of every pack: labels and loss masks where asked for (``--labels-key``, ``--loss-mask-key``)
    or carried by any document."""
    counters: OverlongCounters
    errors: dict[str, Any]


def run(args: argparse.Namespace) -> int:
    from streampack.cli.ranks import job_of
    from streampack.io.packed_writer import write_packed_dataset
    from streampack.packing import ALGORITHMS

    if args.algorithm not in ALGORITHMS:
        raise CliError(f"--algorithm={args.algorithm!r} is not one of {sorted(ALGORITHMS)}")
    for name in ("cp_size", "tp_size", "align_multiple", "packs_per_shard"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    align = _align(args)
    job = job_of(args)
    if job.world_size > 1:
        from streampack.cli.pack_parts import run_rank

        return run_rank(args, job, align=align, pack_share=_pack)
    start = time.perf_counter()
    packed = _pack(args, args.urls, align)
    with tqdm_bar(args, total=len(packed.bins), desc="writing", unit="pack") as bar:
        manifest = write_packed_dataset(
            packed.docs, packed.bins, args.out, capacity=args.capacity, align=align, cp_size=args.cp_size,
            tp_size=args.tp_size, algorithm=args.algorithm, seed=args.seed, fields=packed.fields,
            packs_per_shard=args.packs_per_shard, metrics=packed.metrics, progress=bar.update,
            extra={"sources": [str(u) for u in args.urls], "overlong": args.overlong,
                   "overlong_counters": packed.counters.as_dict(), "errors": packed.errors},
        )
    print(f"packed {len(packed.docs):,} documents ({int(packed.lengths.sum()):,} tokens) into {manifest.num_packs:,} "
          f"packs of {args.capacity} in {len(manifest.shards)} shards under {args.out} "
          f"({time.perf_counter() - start:.1f} s)")
    print(f"algorithm {args.algorithm}, align {align} (cp_size={args.cp_size}, tp_size={args.tp_size}): "
          f"fill {packed.metrics['fill']:.2%}, {len(packed.docs) / manifest.num_packs:.1f} documents per pack; "
          f"overlong={args.overlong!r}: {_overlong_summary(packed.counters)}")
    return 0


def tqdm_bar(args: argparse.Namespace, **kw: Any) -> Any:
    from tqdm import tqdm

    return tqdm(disable=no_bar(args.no_progress), file=sys.stderr, **kw)


def _align(args: argparse.Namespace) -> int:
    """The per-document alignment, the capacity checked against it where every stream's config is made."""
    from streampack.graph import StreamConfig
    from streampack.options import TopologyOptions

    try:
        topology = TopologyOptions(cp_size=args.cp_size, tp_size=args.tp_size, align_multiple=args.align_multiple)
        return StreamConfig(capacity=args.capacity, topology=topology).topology.align
    except ValueError as e:
        raise CliError(f"--capacity: {e}") from None


def _pack(args: argparse.Namespace, urls: Sequence[str], align: int) -> Packed:
    """Read every document of ``urls`` (all held in memory), apply the overlong policy and pack them all at once."""
    from streampack.io.packed_writer import packed_fields
    from streampack.nodes.overlong import OverlongCounters, apply_overlong
    from streampack.options import ReadOptions, TokenizeOptions
    from streampack.packing import pack, packing_metrics

    read = ReadOptions(tokens_key=args.tokens_key, text_key=args.text_key, labels_key=args.labels_key,
                       loss_mask_key=args.loss_mask_key, on_error=args.on_error, **input_guards(args))
    samples = Documents(urls, read, capacity=args.capacity, tokenizer=args.tokenizer,
                        tokenize=TokenizeOptions(bos_id=args.bos_id, eos_id=args.eos_id))
    counters = OverlongCounters()
    docs = []
    with tqdm_bar(args, desc="reading", unit="sample") as bar:
        for s in samples:
            if s.tokens is None:
                raise CliError(f"sample {s.doc_key!r} is text: pass --tokenizer PATH/tokenizer.json")
            docs.extend(apply_overlong(s, args.capacity, args.overlong, counters))
            bar.update(1)
    if not docs:
        raise CliError(f"no non-empty samples in {list(urls)}")
    lengths = np.asarray([len(d) for d in docs], dtype=np.int64)
    aligned = -(-lengths // align) * align
    bins = pack(aligned, args.capacity, algorithm=args.algorithm, seed=args.seed)
    metrics = dataclasses.asdict(packing_metrics(aligned, bins, args.capacity))  # ints and floats: JSON as they are
    metrics["fill"] = float(lengths.sum() / (len(bins) * args.capacity))
    fields = packed_fields(with_labels=args.labels_key is not None or any(d.labels is not None for d in docs),
                           with_mask=args.loss_mask_key is not None or any(d.loss_mask is not None for d in docs))
    return Packed(docs=docs, bins=bins, lengths=lengths, metrics=metrics, fields=fields, counters=counters,
                  errors=samples.nodes["errors"].as_dict())
