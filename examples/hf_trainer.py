"""HF transformers' own ``Trainer`` on a PackedDataset: train, get preempted, resume exactly.

    python examples/hf_trainer.py                 # ~20 s on 2 CPU cores, nothing downloaded
    python examples/hf_trainer.py --workers 2 --steps 12 --preempt-at 6

:class:`streampack.integrations.hf.PackedTrainer` is ``transformers.Trainer`` with its own
``StatefulDataLoader`` (accelerate would re-shard or dispatch a stream that is already sharded
per rank), the loader position saved in every checkpoint folder and loaded on
``train(resume_from_checkpoint=...)``, and ``streampack/*`` stream metrics in its logs (so in
TensorBoard / W&B with ``report_to``). A tiny ``LlamaForCausalLM`` (sdpa attention) is built
from a config and trained with ``hf_inputs()`` batches; the loss is HF's own, normalised over
the gradient-accumulation step by the targets HF counts.

The script trains once without interruption, once stopped at ``--preempt-at`` (a checkpoint is
saved there), then resumes from that checkpoint in a fresh Trainer, and checks that the resumed
run saw the same batches and ended with bit-identical weights. Exit code 1 if not.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from example_data import write_shards  # noqa: E402

from streampack import PackedDataset  # noqa: E402
from streampack.integrations.hf import PackedTrainer  # noqa: E402
from streampack.options import PackOptions, ReadOptions

VOCAB = 64


class StopAt(transformers.TrainerCallback):
    """A preemption after ``step`` optimizer steps (the schedule still targets max_steps)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        if state.global_step >= self.step:
            control.should_training_stop = True


def run(shards: list[str], out: Path, args: argparse.Namespace, *, stop_at: int | None = None,
        resume: str | None = None) -> tuple[PackedTrainer, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        attn_implementation="sdpa"))
    seen: list[torch.Tensor] = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].clone()), with_kwargs=True)
    training = transformers.TrainingArguments(
        output_dir=str(out), max_steps=args.steps, gradient_accumulation_steps=2,
        learning_rate=3e-3, lr_scheduler_type="cosine", save_steps=args.preempt_at,
        logging_steps=2, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
        dataloader_num_workers=args.workers)
    trainer = PackedTrainer(
        model=model, args=training, callbacks=[StopAt(stop_at)] if stop_at else None,
        train_dataset=PackedDataset(shards, capacity=256, read=ReadOptions(tokens_key="npy"),
                                    packing=PackOptions(window=64)))
    trainer.train(resume_from_checkpoint=resume)
    return trainer, seen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--preempt-at", type=int, default=4)
    p.add_argument("--workers", type=int, default=0)
    args = p.parse_args(argv)
    if not 0 < args.preempt_at < args.steps:
        p.error(f"--preempt-at={args.preempt_at} must be between 1 and --steps - 1")
    with tempfile.TemporaryDirectory() as tmp:
        shards = write_shards(Path(tmp) / "data", vocab=VOCAB)
        full, full_seen = run(shards, Path(tmp) / "full", args)
        run(shards, Path(tmp) / "cut", args, stop_at=args.preempt_at)
        checkpoint = Path(tmp) / "cut" / f"checkpoint-{args.preempt_at}"
        resumed, resumed_seen = run(shards, Path(tmp) / "cut", args, resume=str(checkpoint))
    for entry in full.state.log_history:
        if "loss" in entry:
            print(f"step {entry['step']:3d}  loss {entry['loss']:.4f}  "
                  f"tokens {entry['streampack/tokens']:.0f}  fill {entry['streampack/fill']:.1%}  "
                  f"docs/pack {entry['streampack/docs_per_pack']:.2f}")
    skipped = 2 * args.preempt_at  # batches of the steps before the checkpoint
    same_data = len(resumed_seen) == len(full_seen) - skipped and all(
        torch.equal(a, b) for a, b in zip(full_seen[skipped:], resumed_seen))
    same_weights = all(torch.equal(a, b) for a, b in zip(full.model.parameters(), resumed.model.parameters()))
    print(f"resumed from checkpoint-{args.preempt_at}: identical batches {same_data}; "
          f"identical weights {same_weights}")
    return 0 if same_data and same_weights else 1


if __name__ == "__main__":
    raise SystemExit(main())
