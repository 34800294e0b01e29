"""Which saved loader state a trainer integration loads: its own (same topology, exact) or
every old reader's (a changed ``dp_size`` or worker count, elastic).

On the topology that saved them a process loads its own loader state; after a change of world
size or ``num_workers`` :func:`plan_resume` gives back the PackedDataset state of every reader of
every old rank, for ``PackedDataset.load_state_dict([...])`` (:mod:`streampack.plan.elastic`).
Cost: one pass over the already-loaded states (a few dicts per old reader).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from streampack.plan.state import FINGERPRINT_KEY, WORKER_KEY, dataset_record, dataset_states, load_loader_state

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LoaderResume:
    """What one process loads before its first batch (at most one of the two is set)."""

    loader_state: Mapping[str, Any] | None = None
    """This process's own ``StatefulDataLoader`` state: the same topology, an exact resume."""
    dataset_states: list[dict[str, Any]] | None = None
    """Every old reader's PackedDataset state: a new topology, an elastic resume."""

    def apply(self, dataset: Any, loader: Any) -> None:
        """Load into ``dataset`` (elastic) or ``loader`` (exact), before the loader is iterated."""
        if self.loader_state is not None:
            load_loader_state(loader, self.loader_state)
        elif self.dataset_states is not None:
            dataset.load_state_dict(self.dataset_states)


def plan_resume(rank_states: Sequence[Mapping[str, Any] | None], *, rank: int, dataset: Any,
                num_workers: int) -> LoaderResume:
    """``rank_states[i]``: the loader state process ``i`` saved (None where none). Exact when this process
    has a state and the saved ``dp_size`` / ``num_workers`` are the current ones; elastic otherwise."""
    own = rank_states[rank] if rank < len(rank_states) else None
    readers = every_reader([s for s in rank_states if s is not None])
    if not readers:  # saved before the first batch: nothing has been read
        return LoaderResume(loader_state=own)
    saved = dataset_record(readers[0], FINGERPRINT_KEY)
    same = (saved.get("dp_size"), saved.get("num_workers")) == (getattr(dataset, "dp_size", None), num_workers)
    if same and own is not None:
        return LoaderResume(loader_state=own)
    _log.warning("elastic resume: the checkpoint was saved by dp_size=%s x num_workers=%s readers, this run has "
                 "dp_size=%s x num_workers=%s; loading the states of all %d old readers into the dataset",
                 saved.get("dp_size"), saved.get("num_workers"), getattr(dataset, "dp_size", None), num_workers,
                 len(readers))
    return LoaderResume(dataset_states=readers)


def every_reader(loader_states: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The PackedDataset state of every reader inside the loader states, each reader once:
    processes that share a data-parallel rank (tensor / pipeline parallel peers) saved the
    same reader's state, and an elastic load refuses duplicates."""
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for loader_state in loader_states:
        for state in dataset_states(loader_state):
            worker = state[WORKER_KEY]
            out.setdefault((worker["dp_rank"], worker["worker_id"]), state)
    return [out[k] for k in sorted(out)]
