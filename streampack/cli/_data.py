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
                 on_error: str = "raise") -> Iterator[Sample]:
    """Every sample of ``urls`` once, in shard order (no shuffle, one epoch, one worker)."""
    from streampack.pipeline.source import ShardReader

    reader = ShardReader(list(urls), seed=0, shuffle=False, epochs=1, dp_rank=0, dp_size=1,
                         worker_id=0, num_workers=1, tokens_key=tokens_key, text_key=text_key,
                         on_error=on_error)
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
    pending: list[str] = []
    for s in samples:
        if s.tokens is not None:
            lengths.append(len(s.tokens))
        elif encode is not None:
            pending.append(s.text or "")
            if len(pending) >= 256:
                lengths.extend(len(t) for t in encode(pending))
                pending.clear()
        else:
            unit = "whitespace words"
            lengths.append(len((s.text or "").split()))
        if progress is not None:
            progress(1)
    if pending:
        lengths.extend(len(t) for t in encode(pending))  # type: ignore[misc]
    return np.asarray(lengths, dtype=np.int64), unit


__all__ = ["CliError", "load_encoder", "read_samples", "sample_lengths", "tokenized"]
