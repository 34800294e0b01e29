"""Lightning's ``Trainer`` on a PackedDataset: the recipe that resumes after a preemption.

    python examples/lightning_train.py --out runs/llama        # kill it at any moment, run it again
    python examples/lightning_train.py --out runs/llama --workers 2 --precision bf16-true

Run the same command again after the process was killed (SIGKILL, a preempted job): it continues
from the last checkpoint in ``OUT/checkpoints`` with the next untrained batch, and ends with the
weights an uninterrupted run ends with, bit for bit. What makes that work is ``recipe`` below:

* ``ModelCheckpoint(dirpath=...)``: without a ``dirpath`` Lightning saves under the logger's
  ``lightning_logs/version_N/``, a rerun writes to ``version_N+1/`` and finds no checkpoint there;
* ``save_last=True``: ``last.ckpt``, the checkpoint the rerun loads;
* :class:`streampack.integrations.lightning.PackedDataModule`: saves in every checkpoint the loader
  state of the batches actually trained (Lightning fetches one ahead) and restores it.

The model is a tiny HF ``LlamaForCausalLM`` called with ``batch.hf_inputs()``. Each trained batch
is appended to ``OUT/trained.txt`` (``<batch number> <sha256 of its tokens>``) and the final
weights' hash is written to ``OUT/weights.txt``: that is how the tests compare a killed and rerun
run with an uninterrupted one.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

import lightning as L
import torch
import transformers
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).resolve().parent))
from example_data import write_shards  # noqa: E402

from streampack import PackedDataset  # noqa: E402
from streampack.integrations.lightning import PackedDataModule  # noqa: E402
from streampack.options import PackOptions, ReadOptions  # noqa: E402

VOCAB = 64


class PackedLlama(L.LightningModule):
    def __init__(self, trace: Path) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            attn_implementation="sdpa"))
        self.trace = trace
        self.trained = 0  # batches trained, saved in the checkpoint: the trace's batch numbers
        self.resumed_at: int | None = None

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        digest = hashlib.sha256(batch.input_ids.detach().cpu().numpy().tobytes()).hexdigest()[:16]
        with open(self.trace, "a") as f:
            f.write(f"{self.trained} {digest}\n")
        self.trained += 1
        loss = self.model(**batch.hf_inputs()).loss  # token mean over this batch's targets
        self.log("loss", loss, prog_bar=False, batch_size=batch.num_targets)
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["trained_batches"] = self.trained

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.trained = checkpoint["trained_batches"]
        self.resumed_at = checkpoint["global_step"]


def recipe(shards: list[str], out: Path, *, steps: int, every: int, workers: int, precision: str) -> PackedLlama:
    """Train to ``steps``, continuing from ``out/checkpoints/last.ckpt`` when a killed run left one."""
    model = PackedLlama(out / "trained.txt")
    data = PackedDataModule(PackedDataset(shards, capacity=256, read=ReadOptions(tokens_key="npy"),
                                          packing=PackOptions(window=64)),
                            num_workers=workers)
    checkpoints = out / "checkpoints"  # fixed: a rerun must find what the killed run saved
    trainer = L.Trainer(
        max_steps=steps, precision=precision, accumulate_grad_batches=2, log_every_n_steps=2,
        logger=CSVLogger(out), enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=checkpoints, save_last=True, every_n_train_steps=every)])
    last = checkpoints / "last.ckpt"
    trainer.fit(model, datamodule=data, ckpt_path=last if last.exists() else None)
    return model


def example_shards(directory: Path) -> list[str]:
    """The example's token shards, written once (a rerun reads the same files)."""
    if not directory.is_dir():
        partial = directory.with_name(f"{directory.name}.partial-{os.getpid()}")
        write_shards(partial, vocab=VOCAB)
        partial.rename(directory)  # a run killed while writing leaves no half-written folder behind
    return sorted(str(p) for p in directory.glob("*.tar"))


def weights_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("lightning_run"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=2, help="checkpoint every this many optimizer steps")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--precision", default="32-true", help="e.g. bf16-true, bf16-mixed")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    shards = example_shards(args.out / "data")
    with open(args.out / "trained.txt", "a") as f:
        f.write(f"# run {os.getpid()}\n")
    model = recipe(shards, args.out, steps=args.steps, every=args.every, workers=args.workers,
                   precision=args.precision)
    digest = weights_hash(model)
    (args.out / "weights.txt").write_text(digest + "\n")
    start = "the start" if model.resumed_at is None else f"the step-{model.resumed_at} checkpoint"
    print(f"trained to step {args.steps} from {start}; {model.trained} batches in all; weights {digest[:16]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
