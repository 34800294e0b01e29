"""Overlong stage: what to do with a document longer than the pack capacity — split,
truncate, drop or error — as a policy function and the node that applies it before packing.

The right default differs by use case (pretraining wants ``split`` so no token is lost; chat
SFT often wants ``drop`` or ``truncate`` because a split conversation is not a conversation),
so the policy is explicit and every token it touches is counted; the counters travel in the
node state so metrics stay exact across a resume. Node state = upstream state + the not yet
emitted chunks of the current sample (at most one sample's tokens) + counters.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import numpy as np
from torchdata.nodes import BaseNode

from streampack.sample import Sample
from streampack.state import samples_from_state, samples_to_state

OverlongPolicy = Literal["split", "truncate", "drop", "error"]
POLICIES: tuple[str, ...] = ("split", "truncate", "drop", "error")


@dataclass(slots=True)
class OverlongCounters:
    """Running counts of what the policy did (tokens = tokens of the affected samples that
    were split / removed by truncation / dropped)."""

    samples_split: int = 0
    tokens_split: int = 0
    chunks_created: int = 0
    samples_truncated: int = 0
    tokens_truncated: int = 0
    samples_dropped: int = 0
    tokens_dropped: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"overlong={policy!r} must be one of {POLICIES}")


def _slice(sample: Sample, start: int, stop: int, key: str) -> Sample:
    def cut(a):
        return None if a is None else a[start:stop]

    return replace(sample, key=key, tokens=sample.tokens[start:stop], labels=cut(sample.labels),
                   loss_mask=cut(sample.loss_mask),
                   extras={k: v[start:stop] for k, v in sample.extras.items()})


def apply_overlong(sample: Sample, max_len: int, policy: str,
                   counters: OverlongCounters | None = None) -> list[Sample]:
    """Return the documents that ``sample`` becomes under ``policy`` (``[sample]`` when it fits).

    ``split`` makes ``ceil(L / max_len)`` chunks with keys ``key/0``, ``key/1``, …; each chunk is
    its own document (its last token's label is ignored, like any document end).
    """
    check_policy(policy)
    if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < 1:
        # max_len=0 would make range(0, n, 0) raise a bare error, or truncate to nothing
        raise ValueError(f"{max_len=} must be a positive int")
    n = len(sample)
    if n <= max_len:
        return [sample]
    counters = counters if counters is not None else OverlongCounters()
    if policy == "error":
        raise ValueError(f"sample {sample.doc_key!r} has {n} tokens, more than the capacity "
                         f"{max_len} (overlong='error'; use 'split', 'truncate' or 'drop')")
    if policy == "drop":
        counters.samples_dropped += 1
        counters.tokens_dropped += n
        return []
    if policy == "truncate":
        counters.samples_truncated += 1
        counters.tokens_truncated += n - max_len
        return [_slice(sample, 0, max_len, sample.key)]
    chunks = [_slice(sample, s, min(s + max_len, n), f"{sample.key}/{i}")
              for i, s in enumerate(range(0, n, max_len))]
    counters.samples_split += 1
    counters.tokens_split += n
    counters.chunks_created += len(chunks)
    return chunks


class OverlongNode(BaseNode[Sample]):
    """Yields documents of at most ``max_len`` tokens according to ``policy``."""

    SOURCE_KEY = "source"
    PENDING_KEY = "pending"
    COUNTERS_KEY = "counters"

    def __init__(self, source: BaseNode[Sample], max_len: int, policy: str = "split") -> None:
        super().__init__()
        check_policy(policy)
        if max_len < 1:
            raise ValueError(f"{max_len=} must be >= 1")
        self.source = source
        self.max_len = max_len
        self.policy = policy
        self.counters = OverlongCounters()
        self._pending: deque[Sample] = deque()

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self.source.reset(None)
            self.counters = OverlongCounters()
            self._pending = deque()
            return
        self.source.reset(initial_state[self.SOURCE_KEY])
        self.counters = OverlongCounters(**initial_state[self.COUNTERS_KEY])
        self._pending = deque(samples_from_state(initial_state[self.PENDING_KEY]))

    def next(self) -> Sample:
        while not self._pending:
            sample = next(self.source)
            self._pending.extend(apply_overlong(sample, self.max_len, self.policy, self.counters))
        return self._pending.popleft()

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict(),
                self.PENDING_KEY: samples_to_state(list(self._pending)),
                self.COUNTERS_KEY: self.counters.as_dict()}
