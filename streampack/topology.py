"""Where this process sits: its data-parallel rank and size, and its DataLoader worker.

One helper for each question, used by every stage, so "which worker am I" has one answer
(DataLoader terms: ``num_workers == 0`` in the main process) and the sharding arithmetic
uses ``max(num_workers, 1)`` readers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True, kw_only=True)
class Worker:
    """The DataLoader worker this code runs in."""

    id: int
    """``0..num_workers-1``; 0 in the main process."""
    num_workers: int
    """The DataLoader's ``num_workers``: 0 when iterating in the main process."""

    @property
    def readers(self) -> int:
        """How many readers this rank runs (the main process is one reader)."""
        return max(self.num_workers, 1)


def current_worker() -> Worker:
    """The DataLoader worker of the calling process (``Worker(id=0, num_workers=0)`` outside one)."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return Worker(id=0, num_workers=0) if info is None else Worker(id=info.id, num_workers=info.num_workers)


def validate_topology(dp_rank: int, dp_size: int, worker_id: int, num_workers: int) -> None:
    for name, value in (("dp_rank", dp_rank), ("dp_size", dp_size), ("worker_id", worker_id), ("num_workers", num_workers)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise TypeError(f"{name}={value!r} must be an int")
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"need 0 <= dp_rank < dp_size, got {dp_rank=} {dp_size=}")
    if num_workers < 1 or not 0 <= worker_id < num_workers:
        raise ValueError(f"need 0 <= worker_id < num_workers, got {worker_id=} {num_workers=}")


def resolve_topology(dp_rank: int | None = None, dp_size: int | None = None, process_group: Any = None) -> tuple[int, int]:
    """``(dp_rank, dp_size)``: explicit args, else ``torch.distributed`` (rank and size *within
    ``process_group``* — pass the data-parallel group when TP/CP/PP exist), else the
    ``RANK``/``WORLD_SIZE`` environment (the global rank: only right without model parallelism),
    else ``(0, 1)``."""
    if dp_rank is None or dp_size is None:
        auto_rank, auto_size = _auto_topology(process_group)
        dp_rank = auto_rank if dp_rank is None else dp_rank
        dp_size = auto_size if dp_size is None else dp_size
    validate_topology(dp_rank, dp_size, 0, 1)
    return int(dp_rank), int(dp_size)


def _auto_topology(process_group: Any) -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group=process_group), dist.get_world_size(group=process_group)
    if process_group is not None:
        raise ValueError("process_group given but torch.distributed is not initialized")
    rank, size = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None and size is None:
        return 0, 1
    try:
        return int(rank if rank is not None else 0), int(size if size is not None else 1)
    except ValueError:
        raise ValueError(f"bad RANK/WORLD_SIZE environment: RANK={rank!r} WORLD_SIZE={size!r}") from None
