"""What the subcommands share: reading every sample of a dataset once, and tokenizers."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from streampack.sample import Sample

if TYPE_CHECKING:
    from streampack.io.limits import Limits
    from streampack.options import ReadOptions, TokenizeOptions


class CliError(ValueError):
    """A user error the CLI reports as one line (exit code 2)."""


def describe(doc: str | None) -> str:
    """A subcommand's ``--help`` description: the module docstring's first paragraph, without
    its reST markup (``streampack demo``: ... -> streampack demo: ...)."""
    return (doc or "").split("\n\n")[0].replace("``", "").replace(":func:", "").replace(":class:", "")


def no_bar(no_progress: bool) -> bool | None:
    """tqdm's ``disable``: off with ``--no-progress``; ``None`` = off when stderr is not a
    terminal, so logs, pipes and error output carry no progress-bar debris."""
    return True if no_progress else None


def check_tokenizer(path: Any) -> None:
    """Fail with one line before any data is read (the Tokenize node loads it again)."""
    if not isinstance(path, str):  # None, or a tokenizer object (the chat stage's HF tokenizer)
        return
    if not os.path.isfile(path):
        raise CliError(f"--tokenizer {path!r}: no such file (want a tokenizer.json)")
    from streampack.nodes.tokenize import make_encoder

    try:
        make_encoder(path)
    except ValueError as e:
        raise CliError(f"--tokenizer {path!r}: {e}") from None


LIMIT_FLAGS = ("max_line_bytes", "max_member_bytes", "max_sample_bytes", "max_json_depth")
"""The ``Limits`` fields a subcommand takes as ``--max-*`` flags."""


def add_limit_arguments(p: Any, note: str = "") -> None:
    """One ``--max-*`` flag per :data:`LIMIT_FLAGS` field, defaulting to ``Limits()``'s."""
    from streampack.io.limits import Limits

    for name in LIMIT_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(Limits(), name),
                       help=f"reader limit, as Limits.{name}{note} (default %(default)s)")


def parsed_limits(args: Any) -> Limits:
    """The ``Limits`` of the flags :func:`add_limit_arguments` added; a bad value names its flag."""
    from streampack.io.limits import Limits

    try:
        return Limits(**{name: getattr(args, name) for name in LIMIT_FLAGS})
    except ValueError as e:
        raise CliError(str(e).replace("_", "-").replace("max-", "--max-", 1)) from None


def add_input_guards(p: Any) -> None:
    """The options ``pack`` and ``inspect`` share with ``PackedDataset`` for remote and hostile
    input: retries, the vocabulary bound and the reader limits."""
    p.add_argument("--retries", type=int, default=None,
                   help="retries per read of a remote shard (default: as many as --retry-budget allows)")
    p.add_argument("--retry-budget", type=float, default=120.0,
                   help="seconds of backoff a remote read may spend retrying (default %(default)s)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="token ids and labels must be below it (default: below 2**31)")
    add_limit_arguments(p)


def input_guards(args: Any) -> dict[str, Any]:
    """``ReadOptions`` keywords from the options :func:`add_input_guards` added."""
    if args.retries is not None and args.retries < 0:
        raise CliError(f"--retries={args.retries} must be >= 0")
    if not args.retry_budget >= 0:
        raise CliError(f"--retry-budget={args.retry_budget} must be >= 0")
    if args.vocab_size is not None and not 1 <= args.vocab_size <= 2**31:
        raise CliError(f"--vocab-size={args.vocab_size} must be in [1, 2**31]")
    return {"retries": args.retries, "retry_budget": args.retry_budget, "vocab_size": args.vocab_size,
            "limits": parsed_limits(args)}


class Documents:
    """Every sample of ``urls`` once, in shard order, through the pipeline's own graph
    (:func:`streampack.graph.build.build_samples`), so offline packs carry the same targets as a stream."""

    def __init__(self, urls: Sequence[str], read: ReadOptions, *, capacity: int, tokenizer: Any = None,
                 tokenize: TokenizeOptions | None = None) -> None:
        from streampack.graph.build import Placement, Sources, StreamConfig, build_samples
        from streampack.graph.preflight import preflight
        from streampack.io.packed_format import is_packed_dataset
        from streampack.io.urls import ShardList
        from streampack.options import TokenizeOptions

        if is_packed_dataset(list(urls) if len(urls) > 1 else urls[0]):
            raise CliError(f"{' '.join(map(str, urls))} is the output of `streampack pack` (packs, not "
                           "documents; its manifest.json holds the pack lengths and metrics): give the original shards")
        check_tokenizer(tokenizer)
        config = StreamConfig(capacity=capacity, shuffle=False, epochs=1, read=read,
                              tokenize=tokenize if tokenize is not None else TokenizeOptions())
        sources = Sources(shards=ShardList.of(list(urls)))
        preflight(sources.lists, read)  # a missing shard or a wrong column type: now, not at the end
        node, self.nodes = build_samples(config, sources, Placement(), tokenizer=tokenizer)
        node.reset(None)
        self.root = node

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.root)  # a BaseNode is its own iterator, reset above


def sample_lengths(samples: Iterator[Sample], progress: Callable[[int], Any] | None = None) -> tuple[np.ndarray, str]:
    """Token length of every sample, and the unit: ``tokens``, or ``whitespace words`` for
    text samples read without a tokenizer (an estimate; BPE gives ~1.2-1.5 tokens per word)."""
    lengths: list[int] = []
    unit = "tokens"
    for s in samples:
        if s.tokens is not None:
            lengths.append(len(s.tokens))
        else:
            unit = "whitespace words"
            lengths.append(len((s.text or "").split()))
        if progress is not None:
            progress(1)
    return np.asarray(lengths, dtype=np.int64), unit


__all__ = ["LIMIT_FLAGS", "CliError", "Documents", "add_limit_arguments", "check_tokenizer",
           "describe", "no_bar", "parsed_limits", "sample_lengths"]
