"""User stages between tokenization and packing, given as recipes (the graph is built in every worker).

``PackedDataset(stages=[...])`` accepts a function ``Sample -> Sample | None`` (:class:`MapSamples`;
None drops the sample, counted), a ``BaseNode`` subclass (``cls(upstream)``) or ``NodeStage(factory)``.
A user node must keep exact state itself for resume to stay exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torchdata.nodes import BaseNode

from streampack.plan.state import record_of, record_text
from streampack.sample import Sample


@dataclass(frozen=True, slots=True)
class NodeStage:
    """A recipe ``upstream -> BaseNode[Sample]`` for :func:`build_stages`."""

    factory: Callable[[BaseNode[Sample]], BaseNode[Sample]]


class MapSamples(BaseNode[Sample]):
    """Apply ``fn`` to every sample; ``None`` drops it. State = upstream state + counters."""

    SOURCE_KEY = "source"
    COUNTERS_KEY = "counters"

    def __init__(self, source: BaseNode[Sample], fn: Callable[[Sample], Sample | None]) -> None:
        super().__init__()
        self.source = source
        self.fn = fn
        self.counters = {"mapped": 0, "dropped": 0}

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self.source.reset(None)
            self.counters = {"mapped": 0, "dropped": 0}
        else:
            self.source.reset(initial_state[self.SOURCE_KEY])
            self.counters = record_of(initial_state[self.COUNTERS_KEY])

    def next(self) -> Sample:
        while True:
            out = self.fn(next(self.source))
            if out is not None:
                if not isinstance(out, Sample):
                    raise TypeError(f"stage {self.fn!r} returned {type(out).__name__}, "
                                    f"want a Sample or None")
                self.counters["mapped"] += 1
                return out
            self.counters["dropped"] += 1

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict(), self.COUNTERS_KEY: record_text(self.counters)}


def build_stages(upstream: BaseNode[Sample], stages: Sequence[Any]) -> tuple[BaseNode[Sample], list[BaseNode]]:
    """Chain ``stages`` after ``upstream``; returns the last node and the nodes built."""
    built: list[BaseNode] = []
    node = upstream
    for i, stage in enumerate(stages):
        if isinstance(stage, NodeStage):
            node = stage.factory(node)
        elif isinstance(stage, type) and issubclass(stage, BaseNode):
            node = stage(node)
        elif isinstance(stage, BaseNode):
            raise TypeError(f"stages[{i}] is a node instance; pass its class or "
                            f"NodeStage(lambda upstream: ...) so every worker builds its own")
        elif callable(stage):
            node = MapSamples(node, stage)
        else:
            raise TypeError(f"stages[{i}]={stage!r} is not a function, BaseNode class or NodeStage")
        if not isinstance(node, BaseNode):
            raise TypeError(f"stage {stage!r} built {type(node).__name__}, not a BaseNode")
        built.append(node)
    return node, built
