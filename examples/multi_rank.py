"""Data-parallel training on packed batches: every rank finds its share from torch.distributed.

    torchrun --nproc_per_node 2 examples/multi_rank.py        # gloo on CPU, ~30 s

- ``PackedDataset`` takes its data-parallel rank and size from the initialised process group
  (no arguments; with TP/CP/PP groups pass ``dp_group=``), so each rank reads a disjoint share.
- One finite epoch with no batch count to guess: every reader of every rank plans the epoch
  from the shard index (balanced by tokens) and counts every rank's batches, so every rank
  yields the same number (the ranks with less data end with zero-target filler batches, as
  few as the data allows) and the gradient all-reduce never hangs.
- The loss is a *global* token mean: each rank's summed loss is divided by the number of
  targets summed over all ranks (``global_num_targets``) and the ranks' gradients are summed —
  the only normalisation that makes packed training equal to unpacked training. (With DDP,
  which averages gradients, multiply the loss by the world size.)
- At the end the ranks gather their document keys and check that they are disjoint and cover
  the whole dataset.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pretrain import VOCAB, write_shards  # noqa: E402
from tiny_gpt import TinyGPT, packed_forward  # noqa: E402

from streampack import PackedDataset  # noqa: E402
from streampack.attention.loss import global_num_targets, packed_cross_entropy  # noqa: E402
from streampack.options import PackOptions, ReadOptions


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data_dir = Path(os.environ.get("STREAMPACK_EXAMPLE_DATA", tempfile.gettempdir())) / "multi_rank_shards"
    if rank == 0:
        data_dir.mkdir(parents=True, exist_ok=True)
        write_shards(data_dir, num_shards=4, docs_per_shard=60)
    dist.barrier()
    shards = sorted(str(p) for p in data_dir.glob("train-*.tar"))
    ds = PackedDataset(shards, capacity=256, packs_per_batch=2, epochs=1, read=ReadOptions(tokens_key="npy"),
                       packing=PackOptions(window=32))
    assert (ds.dp_rank, ds.dp_size) == (rank, world), "rank must come from torch.distributed"
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, dim=32, layers=1, heads=2, max_len=256)  # same init on every rank
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    keys: list[str] = []
    steps = 0
    for batch in ds:
        n_targets = global_num_targets([batch])  # summed over every rank
        result = packed_cross_entropy(packed_forward(model, batch), batch, num_targets=n_targets)
        optim.zero_grad()
        # this rank's summed loss / the step's global target count (a step where every rank
        # holds a filler batch has no targets: result.loss is None and the gradient is zero)
        (result.loss_sum / max(n_targets, 1)).backward()
        for param in model.parameters():  # summing the ranks' gradients = the global token mean
            dist.all_reduce(param.grad)
        optim.step()
        keys.extend(k for k in batch.doc_keys if k != "<filler>")
        steps += 1
    everyone: list[list[str]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(everyone, keys)
    steps_all: list[int] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(steps_all, steps)
    if rank == 0:
        docs = [set(k.split("#")[-1].split("/")[0] for k in ks) for ks in everyone]
        disjoint = all(not (docs[i] & docs[j]) for i in range(world) for j in range(i + 1, world))
        total = len(set().union(*docs))
        print(f"ranks={world} steps per rank={steps_all} documents per rank={[len(d) for d in docs]} "
              f"disjoint={disjoint} covered={total}/240 fillers={ds.metrics()['batches']['fillers']}")
        ok = disjoint and total == 240 and len(set(steps_all)) == 1
    else:
        ok = True
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    # Skip interpreter teardown: with gloo on CPU, torch 2.13 sometimes aborts at exit
    # ("terminate called without an active exception") after a clean destroy_process_group.
    os._exit(code)
