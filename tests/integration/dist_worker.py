"""Run by tests/integration/test_distributed.py under ``torchrun --nproc_per_node 2``.

Each rank finds its rank from ``torch.distributed`` (gloo), reads one finite epoch (no batch
count given: the plan makes every rank's count equal), joins every batch with an all_reduce (a
rank with fewer batches would hang it), and rank 0 writes every rank's document keys and batch
count to ``argv[2]`` as json.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from streampack.dataset import PackedDataset
from streampack.options import PackOptions


def main() -> None:
    urls, out = json.loads(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    ds = PackedDataset(urls, capacity=512, epochs=1, packing=PackOptions(window=32))
    keys, batches = [], 0
    for batch in DataLoader(ds, batch_size=None, num_workers=2):
        total = torch.tensor([batch.num_tokens])
        dist.all_reduce(total)
        keys += [k.rsplit("#", 1)[-1] for k in batch.doc_keys if k != "<filler>"]
        batches += 1
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": ds.dp_rank, "size": ds.dp_size, "keys": keys, "batches": batches})
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
