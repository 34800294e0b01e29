"""What the subcommands share: reading every sample of a dataset once, and tokenizers."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from streampack.sample import Sample


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


def load_encoder(path: str | None) -> Callable[[list[str]], list[list[int]]] | None:
    if path is None:
        return None
    if not os.path.isfile(path):
        raise CliError(f"--tokenizer {path!r}: no such file (want a tokenizer.json)")
    from streampack.pipeline.tokenize import make_encoder

    try:
        return make_encoder(path)
    except Exception as e:  # tokenizers raises its own exception type for a bad file
        raise CliError(f"--tokenizer {path!r}: cannot load it: {e}") from None


def read_samples(urls: Sequence[str], *, tokens_key: str = "input_ids", text_key: str = "text",
                 on_error: str = "raise", retries: int = 3) -> Iterator[Sample]:
    """Every sample of ``urls`` once, in shard order (no shuffle, one epoch, one worker)."""
    from streampack.pipeline.packed_source import is_packed_dataset
    from streampack.pipeline.source import ShardReader

    if is_packed_dataset(list(urls) if len(urls) > 1 else urls[0]):
        raise CliError(f"{' '.join(map(str, urls))} is the output of `streampack pack` (packs, not "
                       "documents; its manifest.json holds the pack lengths and metrics): give the "
                       "original shards")

    reader = ShardReader(list(urls), seed=0, shuffle=False, epochs=1, dp_rank=0, dp_size=1,
                         worker_id=0, num_workers=1, tokens_key=tokens_key, text_key=text_key,
                         on_error=on_error, retries=retries)
    reader.reset(None)
    while True:
        try:
            yield reader.next()
        except StopIteration:
            return


def tokenized(samples: Iterator[Sample], encode: Callable[[list[str]], list[list[int]]] | None,
              block: int = 256) -> Iterator[Sample]:
    """Samples with tokens: text samples are encoded in blocks with ``encode``; without an
    encoder a text sample is an error (``pack`` needs real token ids)."""
    pending: list[Sample] = []

    def flush() -> Iterator[Sample]:
        ids = encode([s.text for s in pending])  # type: ignore[misc]
        for s, t in zip(pending, ids):
            if len(t):
                yield replace(s, text=None, tokens=np.asarray(t, dtype=np.int64))
        pending.clear()

    for s in samples:
        if s.tokens is not None:
            yield s
            continue
        if encode is None:
            raise CliError(f"sample {s.doc_key!r} is text: pass --tokenizer PATH/tokenizer.json")
        pending.append(s)
        if len(pending) >= block:
            yield from flush()
    if pending:
        yield from flush()


def sample_lengths(samples: Iterator[Sample], encode: Callable[[list[str]], list[list[int]]] | None,
                   progress: Callable[[int], Any] | None = None) -> tuple[np.ndarray, str]:
    """Token length of every sample, and the unit: ``tokens``, or ``whitespace words`` for
    text samples read without a tokenizer (an estimate; BPE gives ~1.2-1.5 tokens per word)."""
    lengths: list[int] = []
    unit = "tokens"
    pending: list[tuple[int, str]] = []  # (position in lengths, text): encoded in blocks

    def flush() -> None:
        for (i, _), ids in zip(pending, encode([t for _, t in pending])):  # type: ignore[misc]
            lengths[i] = len(ids)
        pending.clear()

    for s in samples:
        if s.tokens is not None:
            lengths.append(len(s.tokens))
        elif encode is not None:
            pending.append((len(lengths), s.text or ""))
            lengths.append(0)  # filled by flush(), so lengths keep the stream's order
            if len(pending) >= 256:
                flush()
        else:
            unit = "whitespace words"
            lengths.append(len((s.text or "").split()))
        if progress is not None:
            progress(1)
    if pending:
        flush()
    return np.asarray(lengths, dtype=np.int64), unit


__all__ = ["CliError", "describe", "load_encoder", "no_bar", "read_samples", "sample_lengths", "tokenized"]
