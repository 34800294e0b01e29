"""``streampack inspect``: length statistics of a dataset and the fill each algorithm would reach.

Offline fill packs all lengths at once (what ``streampack pack`` gets). Windowed fill runs the real
:class:`~streampack.nodes.window_packer.WindowPacker` over zero-cost stand-in samples that carry only a length (a
read-only zero-stride array), so the projection is exactly what ``PackedDataset`` would reach with that window, without
reading tokens twice. Overlong documents are counted split into ``capacity``-token chunks (the ``split`` policy).

``--chat`` reads chat records through the chat stage (:mod:`streampack.chat`) with a HF tokenizer folder (or a
``tokenizer.json`` and ``--chat-template``) and first prints ``--show`` records rendered, the supervised tokens
between ``[[`` and ``]]`` (green on a terminal): masks are debugged by looking.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from streampack.cli._data import CliError, Documents, add_input_guards, describe, input_guards, no_bar, sample_lengths
from streampack.sample import Sample

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
    p.add_argument("--chat", action="store_true",
                   help="chat records (messages / conversations / prompt+completion): render them with the "
                        "tokenizer's chat template (--tokenizer: a HF tokenizer folder) and mark what is supervised")
    p.add_argument("--chat-template", default=None, metavar="FILE", help="with --chat: a jinja chat template file")
    p.add_argument("--train-on", default="assistant",
                   help="with --chat: 'assistant', 'last' or comma-separated roles (default %(default)s)")
    p.add_argument("--show", type=int, default=3, help="with --chat: records printed with their supervised tokens "
                   "marked (default %(default)s)")
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
    """Fill the streaming window packer reaches on ``lengths`` (each <= capacity), in order: its rounds counted on
    lengths alone (``count_packs``, the planner's count of the node's packs), every pack ``capacity`` tokens."""
    from streampack.graph import StreamConfig
    from streampack.options import PackOptions
    from streampack.packing.window_rounds import count_packs

    config = StreamConfig(capacity=capacity, packing=PackOptions(window=window, algorithm=algorithm))  # checks them
    packs = count_packs(config.packer_rules(seed), lengths)
    return float(lengths.sum()) / (packs * capacity) if packs else 0.0


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


def chat_options(args: argparse.Namespace) -> tuple[Any, Any]:
    """The HF tokenizer and ``TokenizeOptions`` of ``--chat``: a tokenizer folder (read offline) or a
    ``tokenizer.json`` with ``--chat-template``."""
    import os

    from streampack.chat.template import chat_tokenizer
    from streampack.options import TokenizeOptions
    from streampack.options.tokenize import ChatOptions

    if args.tokenizer is None or not os.path.exists(args.tokenizer):
        raise CliError(f"--chat needs --tokenizer: a HF tokenizer folder or a tokenizer.json (got {args.tokenizer!r})")
    template = None
    if args.chat_template is not None:
        if not os.path.isfile(args.chat_template):
            raise CliError(f"--chat-template {args.chat_template!r}: no such file")
        with open(args.chat_template, encoding="utf-8") as f:
            template = f.read()
    roles = _parse_list(args.train_on)
    train_on = args.train_on if args.train_on in ("assistant", "last") else tuple(roles)
    try:
        options = ChatOptions(template=template, train_on=train_on)
        if os.path.isdir(args.tokenizer):
            from transformers import AutoTokenizer

            tokenizer = chat_tokenizer(AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True), template)
        else:
            tokenizer = chat_tokenizer(args.tokenizer, template)
    except (OSError, TypeError, ValueError) as e:
        raise CliError(f"--chat: {e}") from None
    return tokenizer, TokenizeOptions(chat=options)


def marked_record(tokenizer: Any, sample: Sample, *, color: bool = False) -> str:
    """``sample`` decoded with each run of supervised tokens between ``[[`` and ``]]`` (green with ``color``), under
    a line naming it and counting its tokens."""
    assert sample.tokens is not None and sample.loss_mask is not None
    mask = sample.loss_mask.astype(bool)
    cuts = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    parts = []
    for ids, on in zip(np.split(sample.tokens, cuts), np.split(mask, cuts)):
        text = tokenizer.decode(ids.tolist())
        parts.append((f"\x1b[32m{text}\x1b[0m" if color else f"[[{text}]]") if on[0] else text)
    head = f"--- {sample.doc_key}: {len(mask)} tokens, {int(mask.sum())} supervised"
    return head + "\n" + "".join(parts)


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
    tokenizer, tokenize = chat_options(args) if args.chat else (args.tokenizer, None)
    samples = Documents(args.urls, read, capacity=args.capacity, tokenizer=tokenizer, tokenize=tokenize)
    stream = iter(samples)
    if args.chat:
        shown = [s for _, s in zip(range(max(0, args.show)), stream)]
        for s in shown:
            print(marked_record(tokenizer, s, color=sys.stdout.isatty()))
        stream = itertools.chain(shown, stream)
    with tqdm(desc="reading", unit="sample", disable=no_bar(args.no_progress), file=sys.stderr) as bar:
        lengths, unit = sample_lengths(stream, progress=bar.update)
    if args.chat:
        counters = samples.nodes["tokenize"].counters
        print(f"chat: {counters['tokenized']:,} conversations, {counters['truncated']:,} cut to whole turns and "
              f"{counters['dropped']:,} dropped (over --capacity {args.capacity})")
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
