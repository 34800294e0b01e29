"""Overlong stage: apply the split / truncate / drop / error policy before packing.

Every sample longer than ``max_len`` becomes zero, one or several documents (see
:func:`streampack.overlong.apply_overlong`); the counters travel in the state so metrics stay
exact across a resume. State = upstream state + the not yet emitted chunks of the current
sample (at most one sample's tokens) + counters.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from torchdata.nodes import BaseNode

from streampack.overlong import OverlongCounters, apply_overlong, check_policy
from streampack.sample import Sample
from streampack.state import samples_from_state, samples_to_state


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
