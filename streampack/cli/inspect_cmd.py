"""``streampack inspect``: length statistics of a dataset and the fill each algorithm would reach.

Offline fill packs all lengths at once (what ``streampack pack`` gets). Windowed fill runs the real
:class:`~streampack.nodes.window_packer.WindowPacker` over zero-cost stand-in samples that carry only a length (a
read-only zero-stride array), so the projection is exactly what ``PackedDataset`` would reach with that window, without
reading tokens twice. Overlong documents are counted split into ``capacity``-token chunks (the ``split`` policy).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import numpy as np

from streampack.cli._data import CliError, Documents, add_input_guards, describe, input_guards, no_bar, sample_lengths

DEFAULT_WINDOWS = (64, 256, 1024, 4096)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments (``streampack.cli.main`` made ``p`` with its name and help)."""
    p.description = describe(__doc__)
    p.add_argument("urls", nargs="+", help="shards: paths, globs, brace patterns or a directory")
    p.add_argument("--capacity", type=int, required=True, help="tokens per pack")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json for text shards (without it, text is measured in whitespace words)")
    p.add_argument("--tokens-key", default="input_ids", help="field holding token ids")
    p.add_argument("--text-key", default="text", help="json field holding text")
    p.add_argument("--algorithms", default=None, help="comma-separated (default: all registered)")
    p.add_argument("--windows", default=",".join(map(str, DEFAULT_WINDOWS)),
                   help="comma-separated window sizes to simulate ('' = none; default %(default)s)")
    p.add_argument("--plot", default=None, metavar="FILE", help="write a length histogram PNG")
    add_input_guards(p)
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars (they are off when stderr is not a terminal)")
    p.set_defaults(run=run)


def split_lengths(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Lengths after the ``split`` policy, in stream order: each overlong length becomes its
    ``capacity``-sized chunks then the remainder, where the sample was (as ``OverlongNode``
    emits them), so the windowed simulation sees the order ``PackedDataset`` would."""
    lengths = np.asarray(lengths, dtype=np.int64)
    counts = -(-lengths // capacity)  # chunks per sample (1 when it fits)
    out = np.repeat(np.minimum(lengths, capacity), counts)
    last = np.cumsum(counts) - 1  # each sample's last chunk holds the remainder
    out[last] = lengths - (counts - 1) * capacity
    return out


def windowed_fill(lengths: np.ndarray, capacity: int, window: int, algorithm: str, seed: int = 0) -> float:
    """Fill the streaming window packer reaches on ``lengths`` (each <= capacity), in order."""
    from streampack.cli._data import length_source
    from streampack.graph import StreamConfig
    from streampack.nodes.window_packer import WindowPacker, fill
    from streampack.options import PackOptions

    config = StreamConfig(capacity=capacity, packing=PackOptions(window=window, algorithm=algorithm))  # checks them
    packer = WindowPacker(length_source(lengths), rules=config.packer_rules(seed))
    packer.reset(None)
    while True:
        try:
            packer.next()
        except StopIteration:
            return fill(packer.metrics)


def offline_fill(lengths: np.ndarray, capacity: int, algorithm: str) -> tuple[float, float, int]:
    """(fill, mean documents per pack, packs) of packing all ``lengths`` at once; the pack
    count is the steps-per-epoch estimate (divide by packs per batch and DP ranks)."""
    from streampack.packing import pack

    bins = pack(lengths, capacity, algorithm=algorithm, seed=0)
    return float(lengths.sum() / (len(bins) * capacity)), len(lengths) / max(1, len(bins)), len(bins)


def stats_lines(lengths: np.ndarray, capacity: int, unit: str) -> list[str]:
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    over = lengths > capacity
    return [
        f"samples: {len(lengths):,}   total: {int(lengths.sum()):,} {unit}",
        f"length ({unit}): mean {lengths.mean():.1f}  p50 {p50:.0f}  p90 {p90:.0f}  p99 {p99:.0f}  "
        f"min {lengths.min()}  max {lengths.max()}",
        f"over capacity {capacity}: {int(over.sum()):,} samples ({over.mean():.2%}), "
        f"{lengths[over].sum() / lengths.sum():.2%} of {unit} (split into chunks below)",
    ]


def fill_table(lengths: np.ndarray, capacity: int, algorithms: Sequence[str], windows: Sequence[int],
               progress: bool) -> list[str]:
    from tqdm import tqdm

    chunks = split_lengths(lengths, capacity)
    head = (f"  {'algorithm':<12} {'offline':>8} {'packs':>9} {'docs/pack':>9}"
            + "".join(f" {'W=' + str(w):>7}" for w in windows))
    lines = [f"projected fill at capacity {capacity} ({len(chunks):,} documents after split; "
             f"pad-to-max fill would be {chunks.sum() / (len(chunks) * capacity):.1%}):", head]
    with tqdm(total=len(algorithms) * (1 + len(windows)), desc="simulating packers", unit="run",
              disable=no_bar(not progress), file=sys.stderr) as bar:
        for name in algorithms:
            fill, per_pack, packs = offline_fill(chunks, capacity, name)
            bar.update(1)
            cells = []
            for w in windows:
                cells.append(f" {windowed_fill(chunks, capacity, w, name):>7.1%}")
                bar.update(1)
            lines.append(f"  {name:<12} {fill:>8.1%} {packs:>9,} {per_pack:>9.1f}" + "".join(cells))
    return lines


def plot_histogram(lengths: np.ndarray, capacity: int, unit: str, path: str) -> None:
    import matplotlib  # run() checked it is installed before reading the data

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    top = max(int(lengths.max()), capacity) + 1
    bins = np.unique(np.geomspace(max(1, int(lengths.min())), top, 80).astype(int))
    ax.hist(lengths, bins=bins, color="#3a7bd5", edgecolor="white", linewidth=0.3)
    ax.axvline(capacity, color="#d62728", linestyle="--", label=f"capacity {capacity}")
    ax.set_xscale("log")
    ax.set_xlabel(f"sample length ({unit}, log scale)")
    ax.set_ylabel("samples")
    ax.set_title(f"{len(lengths):,} samples, mean {lengths.mean():.0f}, "
                 f"{(lengths > capacity).mean():.1%} over capacity")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parse_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from streampack.packing import ALGORITHMS

    if args.capacity < 1:
        raise CliError(f"--capacity={args.capacity} must be >= 1")
    algorithms = _parse_list(args.algorithms) if args.algorithms else list(ALGORITHMS)
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown:
        raise CliError(f"unknown algorithm(s) {unknown}; choose from {sorted(ALGORITHMS)}")
    try:
        windows = [int(w) for w in _parse_list(args.windows)]
    except ValueError:
        raise CliError(f"--windows={args.windows!r} must be comma-separated integers") from None
    if any(w < 1 for w in windows):
        raise CliError(f"--windows={args.windows!r}: every window must be >= 1")
    if args.plot:  # fail before reading the data, not after
        import importlib.util
        import os

        if importlib.util.find_spec("matplotlib") is None:
            raise CliError("--plot needs matplotlib: pip install 'streampack[plot]'")
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder):
            raise CliError(f"--plot {args.plot!r}: no such directory {folder!r}")
    from streampack.options import ReadOptions

    read = ReadOptions(tokens_key=args.tokens_key, text_key=args.text_key, **input_guards(args))
    samples = Documents(args.urls, read, capacity=args.capacity, tokenizer=args.tokenizer)
    with tqdm(desc="reading", unit="sample", disable=no_bar(args.no_progress), file=sys.stderr) as bar:
        lengths, unit = sample_lengths(iter(samples), progress=bar.update)
    lengths = lengths[lengths > 0]
    if len(lengths) == 0:
        raise CliError(f"no non-empty samples in {args.urls}")
    if unit != "tokens":
        print(f"note: text samples and no --tokenizer: lengths are {unit}, an estimate of tokens")
    for line in stats_lines(lengths, args.capacity, unit):
        print(line)
    for line in fill_table(lengths, args.capacity, algorithms, windows, not args.no_progress):
        print(line)
    if args.plot:
        plot_histogram(lengths, args.capacity, unit, args.plot)
        print(f"histogram written to {args.plot}")
    return 0
