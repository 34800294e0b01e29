"""Megatron-core inputs from a PackedDataset: ``get_batch`` for a GPT ``forward_step``.

    python examples/megatron_batches.py          # ~15 s on 2 CPU cores (needs megatron-core)

Each ``PackedBatch`` becomes a :class:`streampack.integrations.megatron.MegatronBatch`:
``tokens, labels, loss_mask, position_ids`` ``[1, T]``, ``attention_mask=None`` and
megatron-core's own ``PackedSeqParams`` (``qkv_format="thd"``, real and padded ``cu_seqlens``,
Python-int ``max_seqlen``). In a Megatron job (``pretrain(..., forward_step_func)``)::

    def forward_step(data_iterator, model):
        mb = megatron_batch(next(data_iterator).to("cuda", non_blocking=True))
        output = model(mb.tokens, mb.position_ids, mb.attention_mask, labels=mb.labels,
                       packed_seq_params=mb.packed_seq_params)
        return output, partial(loss_func, mb.loss_mask)

Megatron runs ``thd`` attention through Transformer Engine on a GPU only. This script runs the
CPU-checkable parts: the batches (with context-parallel alignment ``cp_size=2``), Megatron's own
``thd`` rotary embedding (which splits the token axis by ``cu_seqlens_q_padded``) against each
document rotated alone, and the loss-mask token mean against ``packed_cross_entropy``.
Exit code 1 if a check fails.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from example_data import write_shards  # noqa: E402

from streampack import PackedDataset  # noqa: E402
from streampack.attention import packed_cross_entropy  # noqa: E402
from streampack.integrations.megatron import megatron_batch  # noqa: E402
from streampack.options import PackOptions, ReadOptions, TopologyOptions

VOCAB = 64


def rope_is_per_document(mb, batch, group) -> bool:  # noqa: ANN001
    """Megatron's thd RoPE over the packed tokens == RoPE of each document from position 0."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        RotaryEmbedding,
    )
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, apply_rope_fusion=False)
    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True, cp_group=group)
    table = rope.get_freqs_non_repeated(batch.capacity)  # RotaryEmbedding.forward moves to CUDA
    freqs = torch.cat((table, table), dim=-1)[:, None, None, :]
    q = torch.randn(batch.total_tokens, 4, 16)
    packed = apply_rotary_pos_emb(q, freqs, config, cu_seqlens=mb.packed_seq_params.cu_seqlens_q_padded,
                                  cp_group=group)
    cup = batch.cu_seqlens_padded.tolist()
    return all(torch.allclose(packed[s:e], apply_rotary_pos_emb(q[s:e, None], freqs[:e - s], config,
                                                                 cp_group=group)[:, 0])
               for s, e in zip(cup[:-1], cup[1:]))


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        shards = write_shards(Path(tmp) / "data", vocab=VOCAB)
        ds = PackedDataset(shards, capacity=256, packs_per_batch=2, read=ReadOptions(tokens_key="npy"),
                           packing=PackOptions(window=64), topology=TopologyOptions(cp_size=2))
        dist.init_process_group("gloo", init_method=f"file://{Path(tmp) / 'pg'}", rank=0, world_size=1)
        try:
            torch.manual_seed(0)
            emb = torch.nn.Embedding(VOCAB, VOCAB)  # stands in for a model's logits
            ok = True
            for step, batch in zip(range(3), ds):
                mb = megatron_batch(batch)
                psp = mb.packed_seq_params
                logits = emb(mb.tokens[0])
                # Megatron's loss: per-token losses (its labels are valid ids everywhere) x loss_mask
                losses = torch.nn.functional.cross_entropy(logits, mb.labels[0], reduction="none")
                megatron_loss = (losses * mb.loss_mask[0]).sum() / mb.num_targets
                ours = packed_cross_entropy(logits, batch).loss
                rope_ok = rope_is_per_document(mb, batch, dist.group.WORLD)
                ok &= rope_ok and torch.allclose(megatron_loss, ours)
                print(f"batch {step}: {type(psp).__module__}.{type(psp).__name__}(qkv_format={psp.qkv_format!r}, "
                      f"documents={len(batch.doc_keys)}, max_seqlen={psp.max_seqlen_q}, padded spans "
                      f"{'shared' if psp.cu_seqlens_q_padded is psp.cu_seqlens_q else 'separate'}); "
                      f"loss {float(megatron_loss.detach()):.4f} (packed_cross_entropy {float(ours.detach()):.4f}); "
                      f"thd RoPE per document: {rope_ok}")
        finally:
            dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
