"""Equal step counts agreed at run time, for finite data whose batch counts cannot be planned (text shards, stages
that change lengths): ``TopologyOptions(equal_batches="sync")`` and ``streampack.sync_batches(loader, ds, group=)``,
one all-reduce per step and the training loop's cooperation, which is why planning is the default
(``docs/dataset.md``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from streampack.layout.batch import PackedBatch
from streampack.logs import get_logger, warn_every

_log = get_logger(__name__)


def sync_batches(batches: Iterable[PackedBatch], dataset: Any, *, group: Any = None) -> Iterator[PackedBatch]:
    """``batches`` (this rank's loader), stepped in lock-step with every rank of ``group``:
    fillers from ``dataset.filler()`` once this rank has run out, until every rank has."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        yield from batches  # one process: nothing to agree with
        return
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    flag = torch.zeros(1, dtype=torch.int64, device=device)
    it = iter(batches)
    filler: PackedBatch | None = None
    while True:
        batch = next(it, None)
        flag.fill_(0 if batch is None else 1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if not int(flag.item()):
            return
        if batch is None:
            filler = filler if filler is not None else dataset.filler()
            warn_every(_log, "sync-filler", "this rank ran out of data: stepping on filler batches until every "
                       "rank has (zero targets)")
            batch = filler
        yield batch
