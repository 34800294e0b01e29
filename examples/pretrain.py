"""Pretraining loop on packed batches, with a checkpoint mid-epoch, a preemption and an exact resume.

    python examples/pretrain.py                      # ~1 min on 2 CPU cores
    python examples/pretrain.py --steps 40 --workers 2 --preempt-at 15

What it shows:

1. ``PackedDataset`` over webdataset tar shards of pre-tokenized documents (written here, with a
   long-tail length distribution) feeding ``PackedLoader(ds)``.
2. A tiny GPT (``examples/tiny_gpt.py``) trained on ``PackedBatch``es with packed attention
   (documents never see each other) and a token-mean loss.
3. At step ``--preempt-at`` the job saves model, optimizer and loader state with ``torch.save``,
   then "dies". A fresh process-like restart builds everything anew, loads the checkpoint with
   ``torch.load(weights_only=True)`` and continues. The resumed run sees exactly the batches and
   reaches exactly the losses of an uninterrupted run — the script checks it and exits 1 if not.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from example_data import write_shards  # noqa: E402
from tiny_gpt import TinyGPT, packed_forward  # noqa: E402

from streampack import PackedDataset, PackedLoader  # noqa: E402
from streampack.attention.loss import packed_cross_entropy  # noqa: E402
from streampack.options import PackOptions, ReadOptions
from streampack.plan.state import load_loader_state  # noqa: E402

VOCAB = 64


def make_job(shards: list[str], workers: int, seed: int):
    torch.manual_seed(seed)
    model = TinyGPT(vocab=VOCAB, dim=64, layers=2, heads=4, max_len=256)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ds = PackedDataset(shards, capacity=256, packs_per_batch=2, seed=seed, read=ReadOptions(tokens_key="npy"),
                       packing=PackOptions(window=64))
    loader = PackedLoader(ds, num_workers=workers)
    return model, optim, loader


def train(model, optim, loader, steps: int, log: list[tuple[str, float]]) -> None:
    """Run ``steps`` optimizer steps from wherever ``loader`` stands; append (batch digest, loss)."""
    it = iter(loader)
    for _ in range(steps):
        batch = next(it)
        loss = packed_cross_entropy(packed_forward(model, batch), batch).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
        digest = hashlib.sha1(batch.input_ids.numpy().tobytes()).hexdigest()[:12]
        log.append((digest, float(loss)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--preempt-at", type=int, default=12)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 0 < args.preempt_at < args.steps:
        p.error(f"--preempt-at={args.preempt_at} must be between 1 and --steps - 1 ({args.steps - 1})")
    if args.workers < 0:
        p.error(f"--workers={args.workers} must be >= 0")
    with tempfile.TemporaryDirectory() as tmp:
        shards = write_shards(Path(tmp), vocab=VOCAB)
        ckpt = Path(tmp) / "ckpt.pt"

        reference: list[tuple[str, float]] = []
        train(*make_job(shards, args.workers, args.seed), args.steps, reference)

        resumed: list[tuple[str, float]] = []
        model, optim, loader = make_job(shards, args.workers, args.seed)
        train(model, optim, loader, args.preempt_at, resumed)
        torch.save({"model": model.state_dict(), "optim": optim.state_dict(),
                    "loader": loader.state_dict()}, ckpt)
        del model, optim, loader  # preemption: everything in memory is gone

        state = torch.load(ckpt, weights_only=True)
        model, optim, loader = make_job(shards, args.workers, args.seed)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        load_loader_state(loader, state["loader"])
        train(model, optim, loader, args.steps - args.preempt_at, resumed)

    for step, ((d0, l0), (d1, l1)) in enumerate(zip(reference, resumed)):
        mark = "  <- resumed here" if step == args.preempt_at else ""
        print(f"step {step:3d}  batch {d0}  loss {l0:.4f}  resumed {d1} {l1:.4f}{mark}")
    same_data = [d for d, _ in reference] == [d for d, _ in resumed]
    same_loss = all(abs(a - b) <= 1e-5 * max(1.0, abs(a)) for (_, a), (_, b) in zip(reference, resumed))
    print(f"identical batch stream after resume: {same_data}; identical losses: {same_loss}; "
          f"loss {reference[0][1]:.3f} -> {reference[-1][1]:.3f}")
    return 0 if same_data and same_loss else 1


if __name__ == "__main__":
    raise SystemExit(main())
