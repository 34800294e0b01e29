"""Lightning's ``Trainer`` on a PackedDataset: train, get preempted, resume exactly.

    python examples/lightning_train.py                 # ~20 s on 2 CPU cores, nothing downloaded
    python examples/lightning_train.py --workers 2 --precision bf16-true

:class:`streampack.integrations.lightning.PackedDataModule` feeds ``training_step`` a
``PackedBatch`` already on the module's device (Lightning moves it with ``.to``; its precision
plugins convert it too), saves in every checkpoint the loader state of the batches actually
trained (Lightning fetches one ahead; a plain StatefulDataLoader's state would skip that batch on
resume) and logs ``streampack/*`` stream metrics to the trainer's loggers. The model is a tiny
HF ``LlamaForCausalLM`` called with ``batch.hf_inputs()``.

The script trains once without interruption, once for ``--preempt-at`` steps (checkpointing
there), then resumes from that checkpoint and checks the resumed run saw the same batches and
ended with bit-identical weights. Exit code 1 if not.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from example_data import write_shards  # noqa: E402

from streampack import PackedDataset  # noqa: E402
from streampack.integrations.lightning import PackedDataModule  # noqa: E402
from streampack.options import PackOptions, ReadOptions

VOCAB = 64


class PackedLlama(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            attn_implementation="sdpa"))
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        self.seen.append(batch.input_ids.detach().cpu().clone())
        loss = self.model(**batch.hf_inputs()).loss  # token mean over this batch's targets
        self.log("loss", loss, prog_bar=False, batch_size=batch.num_targets)
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def fit(shards: list[str], out: Path, steps: int, args: argparse.Namespace,
        ckpt: str | None = None) -> PackedLlama:
    model = PackedLlama()
    data = PackedDataModule(PackedDataset(shards, capacity=256, read=ReadOptions(tokens_key="npy"),
                                          packing=PackOptions(window=64)),
                            num_workers=args.workers)
    trainer = L.Trainer(
        max_steps=steps, accelerator="auto", devices=1, precision=args.precision,
        accumulate_grad_batches=2, log_every_n_steps=2, enable_progress_bar=False,
        enable_model_summary=False, logger=L.pytorch.loggers.CSVLogger(str(out / "logs")),
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=str(out / "ckpt"), save_top_k=-1, save_last=True,
                                                       every_n_train_steps=args.preempt_at)])
    trainer.fit(model, datamodule=data, ckpt_path=ckpt)
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--preempt-at", type=int, default=4)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--precision", default="32-true", help="e.g. bf16-true, bf16-mixed")
    args = p.parse_args(argv)
    if not 0 < args.preempt_at < args.steps:
        p.error(f"--preempt-at={args.preempt_at} must be between 1 and --steps - 1")
    with tempfile.TemporaryDirectory() as tmp:
        shards = write_shards(Path(tmp) / "data", vocab=VOCAB)
        full = fit(shards, Path(tmp) / "full", args.steps, args)
        fit(shards, Path(tmp) / "cut", args.preempt_at, args)
        # the same command again, as after a preemption: save_last=True is what makes "last" exist
        resumed = fit(shards, Path(tmp) / "cut", args.steps, args, ckpt="last")
        metrics = (Path(tmp) / "full" / "logs").rglob("metrics.csv")
        header, *rows = next(metrics).read_text().splitlines()
    print(f"logged columns: {header}")
    print(f"last row: {rows[-1]}")
    skipped = 2 * args.preempt_at
    same_data = len(resumed.seen) == len(full.seen) - skipped and all(
        torch.equal(a, b) for a, b in zip(full.seen[skipped:], resumed.seen))
    same_weights = all(torch.equal(a, b) for a, b in zip(full.parameters(), resumed.parameters()))
    print(f"resumed at step {args.preempt_at}: identical batches {same_data}; identical weights {same_weights}")
    return 0 if same_data and same_weights and "streampack/fill" in header else 1


if __name__ == "__main__":
    raise SystemExit(main())
