"""Run by tests/integration/test_agree.py under ``torchrun --nproc-per-node 2``.

Each rank builds an :class:`Agreement` from torch.distributed (torchrun's agent store), agrees
once in the main process, then reads two epochs through a DataLoader of 2 worker processes
whose workers agree on their counts; rank 0 writes every rank's rows to ``argv[1]`` as json.
A torchrun restart (``--max-restarts``) is not exercised: in this sandbox gloo's re-rendezvous
of the second attempt fails or hangs on its own (``connectFullMesh``), before any agreement.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from streampack.plan.agree import Agreement, agree_counts


class Rounds(IterableDataset):
    """Each DataLoader worker reports ``rank * 3 + worker + 1`` and yields what was agreed."""

    def __init__(self, agreement: Agreement, rank: int, epoch: int) -> None:
        self.agreement, self.rank, self.epoch = agreement, rank, epoch

    def __iter__(self):
        info = get_worker_info()
        got = agree_counts(self.agreement, key=f"epoch{self.epoch}", dp_rank=self.rank, worker_id=info.id,
                           num_workers=info.num_workers, count=self.rank * 3 + info.id + 1)
        yield {"rank": self.rank, "worker": info.id, "pid": os.getpid(), "target": got.target,
               "workers": list(got.workers)}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    a = Agreement.from_dist(None, rank, dist.get_world_size(), timeout_s=60)
    # the main process connects first, so the forked workers inherit a client they must not reuse
    warm = agree_counts(a, key="warm", dp_rank=rank, worker_id=0, num_workers=1, count=rank)
    rows = [row for epoch in range(2)
            for row in DataLoader(Rounds(a, rank, epoch), batch_size=None, num_workers=2)]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": rank, "prefix": a.prefix, "warm": warm.target, "rows": rows})
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
