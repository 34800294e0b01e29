"""Finite multi-rank training, a checkpoint, and an elastic restart on more ranks (gloo, CPU).

    torchrun --nproc_per_node 2 examples/elastic_restart.py --ckpt /tmp/ckpt.pt --stop-after 6
    torchrun --nproc_per_node 3 examples/elastic_restart.py --ckpt /tmp/ckpt.pt

The first run trains a tiny GPT on one finite epoch over 2 ranks, each reading through a
``PackedLoader`` with 2 workers, and stops after ``--stop-after`` steps as if preempted.
Its checkpoint holds the model, the optimizer, and the data state of *every reader of every
rank*: each rank takes its workers' states out of its loader state
(``streampack.plan.state.dataset_states``), the ranks ``all_gather_object`` them, and rank 0 saves
the list. (With ``torch.distributed.checkpoint`` each rank would instead save its own list
under its own key, and every rank would load all of them.)

The second run has 3 ranks of 1 worker each. Every rank loads the whole list
(``ds.load_state_dict(all_states)``): each new reader takes its share of what the old readers
had not yet trained on — the rest of their shards, the samples waiting in their packer
windows, the chunks of a split document — and the ranks finish the epoch with equal step
counts. At the end rank 0 checks, over both runs, that every document was trained exactly
once (none lost, none repeated) and prints the verdict; the script exits 1 if it is false.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pretrain import VOCAB, write_shards  # noqa: E402
from tiny_gpt import TinyGPT, packed_forward  # noqa: E402

from streampack import PackedDataset, PackedLoader  # noqa: E402
from streampack.attention.loss import global_num_targets, packed_cross_entropy  # noqa: E402
from streampack.options import PackOptions, ReadOptions
from streampack.plan.state import dataset_states  # noqa: E402

DOCS = 4 * 60


def gather(obj: object) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def step(model: TinyGPT, optim: torch.optim.Optimizer, batch) -> None:
    n_targets = global_num_targets([batch])  # summed over every rank: the global token mean
    result = packed_cross_entropy(packed_forward(model, batch), batch, num_targets=n_targets)
    optim.zero_grad()
    (result.loss_sum / max(n_targets, 1)).backward()
    for param in model.parameters():
        dist.all_reduce(param.grad)
    optim.step()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--stop-after", type=int, default=None, help="steps before the simulated preemption")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = Path(os.environ.get("STREAMPACK_EXAMPLE_DATA", tempfile.gettempdir())) / "elastic_shards"
    if rank == 0 and not data.exists():
        data.mkdir(parents=True)
        write_shards(data, num_shards=4, docs_per_shard=DOCS // 4)
    dist.barrier()
    shards = sorted(str(p) for p in data.glob("train-*.tar"))
    ds = PackedDataset(shards, capacity=256, packs_per_batch=2, epochs=1, seed=1, read=ReadOptions(tokens_key="npy"),
                       packing=PackOptions(window=32))
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, dim=32, layers=1, heads=2, max_len=256)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    trained: list[str] = []
    restart = args.stop_after is None
    if restart:  # the elastic restart: every old reader's state, whatever the old topology was
        ckpt = torch.load(args.ckpt, weights_only=True)
        model.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optim"])
        ds.load_state_dict(ckpt["data"])
        trained = list(ckpt["trained"])
    workers = 1 if restart else 2
    loader = PackedLoader(ds, num_workers=workers)
    steps, mine = 0, []
    for batch in loader:
        step(model, optim, batch)
        mine += [k for k in batch.doc_keys if k != "<filler>"]
        steps += 1
        if steps == args.stop_after:
            break
    everyone = gather({"keys": mine, "steps": steps, "data": dataset_states(loader.state_dict())})
    ok = True
    if not restart and rank == 0:
        torch.save({"model": model.state_dict(), "optim": optim.state_dict(),
                    "data": [s for r in everyone for s in r["data"]],  # every reader of every rank
                    "trained": [k for r in everyone for k in r["keys"]]}, args.ckpt)
        print(f"ranks={world} x {workers} workers: checkpoint after {steps} steps per rank "
              f"({len(everyone) * workers} reader states) -> {args.ckpt}")
    elif restart and rank == 0:
        keys = trained + [k for r in everyone for k in r["keys"]]
        docs = [k.split("#")[-1].split("/")[0] for k in keys]
        chunks_once = len(keys) == len(set(keys))
        every_doc = len(set(docs)) == DOCS
        equal = len({r["steps"] for r in everyone}) == 1
        print(f"restarted on ranks={world} x {workers} worker(s): steps per rank {[r['steps'] for r in everyone]}; "
              f"every document exactly once: {chunks_once and every_doc}; steps per rank equal: {equal}")
        ok = chunks_once and every_doc and equal
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    # Skip interpreter teardown: with gloo on CPU, torch 2.13 sometimes aborts at exit
    # ("terminate called without an active exception") after a clean destroy_process_group.
    os._exit(code)
