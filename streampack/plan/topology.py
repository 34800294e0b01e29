"""Where this process sits: its data-parallel rank and size, and its DataLoader worker.
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
    """``(dp_rank, dp_size)`` of this process from ``process_group``, else the explicit values, else
    ``torch.distributed`` (refused once other groups exist: the global rank is not the data-parallel
    rank), else ``RANK`` / ``WORLD_SIZE``, else ``(0, 1)``."""
    if process_group is not None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("dp_group given but torch.distributed is not initialized")
        group_rank, group_size = dist.get_rank(group=process_group), dist.get_world_size(group=process_group)
        if group_rank < 0:
            raise ValueError("this process is not a member of the dp_group it was given")
        for name, given, actual in (("dp_rank", dp_rank, group_rank), ("dp_size", dp_size, group_size)):
            if given is not None and given != actual:
                raise ValueError(f"{name}={given} contradicts dp_group ({name} {actual} there); pass one or the other")
        dp_rank, dp_size = group_rank, group_size
    elif dp_rank is None or dp_size is None:
        auto_rank, auto_size = _auto_topology()
        dp_rank = auto_rank if dp_rank is None else dp_rank
        dp_size = auto_size if dp_size is None else dp_size
    validate_topology(dp_rank, dp_size, 0, 1)
    return int(dp_rank), int(dp_size)


def process_groups() -> int:
    """How many process groups ``torch.distributed`` knows (the world group included); 0
    when it cannot tell (the registry is private to torch, checked against torch 2.13)."""
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)
    names = getattr(world, "pg_names", None)
    return len(names) if isinstance(names, dict) else 0


def _auto_topology() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if process_groups() > 1:
            raise ValueError(
                f"torch.distributed has {process_groups() - 1} process group(s) besides the world group "
                f"(tensor / context / pipeline parallelism or a DeviceMesh), so the global rank "
                f"{dist.get_rank()} is not the data-parallel rank: pass dp_group= the data-parallel group "
                f"(Megatron: parallel_state.get_data_parallel_group(); a DeviceMesh: mesh['dp'].get_group()), "
                f"or dp_rank= and dp_size=, or dp_group=torch.distributed.group.WORLD if every rank is a "
                f"data-parallel rank")
        return dist.get_rank(), dist.get_world_size()
    rank, size = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None and size is None:
        return 0, 1
    try:
        return int(rank if rank is not None else 0), int(size if size is not None else 1)
    except ValueError:
        raise ValueError(f"bad RANK/WORLD_SIZE environment: RANK={rank!r} WORLD_SIZE={size!r}") from None
