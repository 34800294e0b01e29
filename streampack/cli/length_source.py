"""Zero-cost stand-in samples for ``streampack inspect``'s windowed simulation.

Its own module because it subclasses ``torchdata.nodes.BaseNode`` (torch is imported with it,
about 3 s cold here): the command's parser and ``--help`` load without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from streampack.sample import Sample


class LengthSource(BaseNode[Sample]):
    """Stand-in samples of the given lengths (tokens = zero-stride views: no memory)."""

    INDEX_KEY = "index"

    def __init__(self, lengths: np.ndarray) -> None:
        super().__init__()
        self.lengths = lengths
        self._zero = np.zeros(1, dtype=np.int64)
        self._index = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._index = 0 if initial_state is None else int(initial_state[self.INDEX_KEY])

    def next(self) -> Sample:
        if self._index >= len(self.lengths):
            raise StopIteration
        n = int(self.lengths[self._index])
        self._index += 1
        return Sample(key=str(self._index - 1), tokens=np.broadcast_to(self._zero, (n,)))

    def get_state(self) -> dict[str, Any]:
        return {self.INDEX_KEY: self._index}


__all__ = ["LengthSource"]
