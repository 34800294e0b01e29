"""A torchtitan-style training loop on packed batches, with torchtitan's own model, loss and
dataloader, checkpointed and resumed exactly.

    python examples/torchtitan_loop.py            # ~40 s on 2 CPU cores (needs torchtitan + triton)

The loop is torchtitan's ``train_step``: ``gradient_accumulation_steps`` micro-batches of
``(input_dict, labels)`` from torchtitan's ``ParallelAwareDataloader``, the step's valid tokens
counted first (``global_valid_tokens``; here ``batch.num_targets`` needs no device sync), each
micro-batch's ``cross_entropy_loss`` (sum) divided by it, then one optimizer step. The model is
torchtitan's Llama3 ``Transformer`` with per-document ``positions`` for RoPE.

Attention: on a GPU the model uses ``attn_type="varlen"`` (torch's FlashAttention-2 varlen
kernel) with masks from the batch's own spans via
``streampack.integrations.torchtitan.post_dataloading_process`` -- never from EOS tokens. On a
CPU torchtitan has no packed attention with a backward pass (varlen is CUDA-only, FlexAttention
has no CPU backward), so the script swaps each layer's SDPA for an exact packed SDPA with a
block-diagonal mask (``streampack.attention.sdpa_packed``'s mask): a stand-in, not a kernel.

At ``--preempt-at`` the job saves model, optimizer and dataloader state (torchtitan's per-DP-rank
format), "dies", restores and continues; the script checks the losses match an uninterrupted run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from example_data import write_shards  # noqa: E402

from streampack import PackedDataset  # noqa: E402
from streampack.attention import packed_attention_mask  # noqa: E402
from streampack.integrations import torchtitan as titan  # noqa: E402
from streampack.options import PackOptions, ReadOptions

VOCAB, CAPACITY, ACCUMULATE = 64, 256, 2


class PackedSDPA(torch.nn.Module):
    """CPU stand-in for torchtitan's inner attention: SDPA with the packed documents' mask."""

    mask: torch.Tensor | None = None  # [T, T], set from each micro-batch's layout

    def forward(self, q, k, v, *, scale=None, enable_gqa=False, is_causal=True):  # noqa: ANN001, ANN201
        return F.scaled_dot_product_attention(q, k, v, attn_mask=PackedSDPA.mask, scale=scale,
                                              enable_gqa=enable_gqa)


def build_model(device: torch.device) -> torch.nn.Module:
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    attn_type = "varlen" if device.type == "cuda" else "sdpa"
    # torchtitan's varlen wrapper passes no enable_gqa (torch 2.11's kernel has none): equal heads
    args = TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=4 if attn_type == "varlen" else 2,
                                vocab_size=VOCAB,
                                multiple_of=32, max_seq_len=CAPACITY, attn_type=attn_type,
                                attn_mask_type="block_causal")
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    if attn_type == "sdpa":
        for layer in model.layers.values():
            layer.attention.inner_attention = PackedSDPA()
    return model.to(device)


def forward_inputs(model: torch.nn.Module, input_dict: dict[str, Any], labels: torch.Tensor,
                   ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """torchtitan's post-dataloading step: (inputs, labels, forward kwargs)."""
    if model.model_args.attn_type == "varlen":  # what a torchtitan Trainer subclass would run
        trainer = SimpleNamespace(model_args=model.model_args)
        inputs, labels, extra_inputs, extra_kwargs = titan.post_dataloading_process(trainer, input_dict, labels)
        return inputs, labels, {**extra_inputs, **extra_kwargs}
    extra = dict(input_dict)
    layout = extra.pop(titan.LAYOUT_KEY)
    del extra[titan.SPANS_KEY], extra[titan.MAX_KEY]
    PackedSDPA.mask = packed_attention_mask(layout[0], layout[1], extra["input"].shape[1])
    return extra.pop("input"), labels, extra


def train_step(model, optim, data_iter, device, log: list[float]) -> None:  # noqa: ANN001
    from torchtitan.components.loss import IGNORE_INDEX, cross_entropy_loss

    microbatches = [next(data_iter) for _ in range(ACCUMULATE)]
    global_valid_tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in microbatches)
    optim.zero_grad()
    total = 0.0
    for input_dict, labels in microbatches:
        input_dict = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in input_dict.items()}
        inputs, labels, kwargs = forward_inputs(model, input_dict, labels.to(device))
        loss = cross_entropy_loss(model(inputs, **kwargs), labels) / global_valid_tokens
        loss.backward()
        total += float(loss.detach())
    optim.step()
    log.append(total)


def job(shards: list[str], device: torch.device) -> tuple[Any, Any, Any]:
    model = build_model(device)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = titan.titan_dataloader(PackedDataset(shards, capacity=CAPACITY, read=ReadOptions(tokens_key="npy"),
                                                  packing=PackOptions(window=64)),
                                    dp_rank=0, dp_world_size=1)
    return model, optim, loader


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--preempt-at", type=int, default=4)
    args = p.parse_args(argv)
    if not 0 < args.preempt_at < args.steps:
        p.error(f"--preempt-at={args.preempt_at} must be between 1 and --steps - 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        shards = write_shards(Path(tmp) / "data", vocab=VOCAB)
        reference: list[float] = []
        model, optim, loader = job(shards, device)
        it = iter(loader)
        for _ in range(args.steps):
            train_step(model, optim, it, device, reference)

        resumed: list[float] = []
        model, optim, loader = job(shards, device)
        it = iter(loader)
        for _ in range(args.preempt_at):
            train_step(model, optim, it, device, resumed)
        ckpt = Path(tmp) / "step.pt"
        torch.save({"model": model.state_dict(), "optim": optim.state_dict(),
                    "dataloader": loader.state_dict()}, ckpt)
        del model, optim, loader, it
        state = torch.load(ckpt, weights_only=True)
        model, optim, loader = job(shards, device)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        loader.load_state_dict(state["dataloader"])
        it = iter(loader)
        for _ in range(args.steps - args.preempt_at):
            train_step(model, optim, it, device, resumed)
    for step, (a, b) in enumerate(zip(reference, resumed)):
        mark = "  <- resumed here" if step == args.preempt_at else ""
        print(f"step {step:2d}  loss {a:.4f}  resumed {b:.4f}{mark}")
    same = all(abs(a - b) <= 1e-6 * max(1.0, abs(a)) for a, b in zip(reference, resumed))
    attention = ("varlen, masks from the batch's spans" if model.model_args.attn_type == "varlen"
                 else "packed SDPA stand-in (CPU)")
    print(f"attention: {attention}; identical losses after resume: {same}; "
          f"loss {reference[0]:.3f} -> {reference[-1]:.3f}")
    return 0 if same and reference[-1] < reference[0] else 1


if __name__ == "__main__":
    raise SystemExit(main())
