"""EpochLoop: a finite stream as one self-contained chain per epoch.

Each epoch runs its own chain built by ``make(epoch)``, so the packer flushes and the collate fills
the quota at the epoch's end: every rank yields the same batches per epoch, no pack mixes two epochs,
and a resume point lies inside one epoch. State = the epoch, the chain's state and the finished
epochs' metrics; ``nodes`` is updated in place with the live chain's nodes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from torchdata.nodes import BaseNode

T = TypeVar("T")
Chain = tuple[BaseNode[Any], dict[str, Any]]


def add_metrics(total: Mapping[str, Any], more: Mapping[str, Any]) -> dict[str, Any]:
    """Nested counters added key by key (``max_*`` keys keep the larger value)."""
    out = dict(total)
    for key, value in more.items():
        if isinstance(value, Mapping):
            out[key] = add_metrics(total.get(key, {}), value)
        elif isinstance(value, list):  # one entry per stage: add them pairwise
            before = list(total.get(key, []))
            out[key] = [add_metrics(before[i] if i < len(before) else {}, v) for i, v in enumerate(value)]
            out[key] += before[len(value):]
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            out[key] = value
        elif key.startswith("max_"):
            out[key] = max(total.get(key, value), value)
        else:
            out[key] = total.get(key, 0) + value
    return out


class EpochLoop(BaseNode[T]):
    """Epochs ``[first, last)``, one chain each (``make(epoch) -> (root, named nodes)``);
    ``metrics(nodes)`` reads a chain's counters when its epoch ends."""

    EPOCH_KEY = "epoch"
    CHAIN_KEY = "chain"
    TOTALS_KEY = "finished_epochs"

    def __init__(self, make: Callable[[int], Chain], *, first: int, last: int, nodes: dict[str, Any],
                 metrics: Callable[[Mapping[str, Any]], dict[str, Any]]) -> None:
        super().__init__()
        if not 0 <= first < last:
            raise ValueError(f"need 0 <= {first=} < {last=}")
        self.make, self.first, self.last, self.nodes, self.metrics = make, first, last, nodes, metrics
        self.epoch = first
        self.totals: dict[str, Any] = {}
        self._chain: BaseNode[T] | None = None

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.epoch = self.first if initial_state is None else int(initial_state[self.EPOCH_KEY])
        self.totals = {} if initial_state is None else dict(initial_state[self.TOTALS_KEY])
        self._chain = None
        if self.epoch < self.last:
            self._start(None if initial_state is None else initial_state[self.CHAIN_KEY])

    def next(self) -> T:
        while self._chain is not None:
            try:
                return next(self._chain)
            except StopIteration:
                self.totals = add_metrics(self.totals, self.metrics(self.nodes))
                self.epoch += 1
                self._chain = None
                plan = self.nodes.get("plan")
                self.nodes.clear()  # counted in the totals now
                if plan is not None:
                    self.nodes["plan"] = plan
                if self.epoch < self.last:
                    self._start(None)
        raise StopIteration

    def get_state(self) -> dict[str, Any]:
        return {self.EPOCH_KEY: self.epoch, self.TOTALS_KEY: dict(self.totals),
                self.CHAIN_KEY: None if self._chain is None else self._chain.state_dict()}

    def _start(self, state: dict[str, Any] | None) -> None:
        root, named = self.make(self.epoch)
        self.nodes.clear()
        self.nodes.update(named)
        root.reset(state)
        self._chain = root
