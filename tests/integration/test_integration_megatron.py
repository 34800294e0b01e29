"""megatron-core's real ``PackedSeqParams`` and its ``thd`` RoPE on packed batches, on CPU.

Megatron runs ``thd`` attention only through Transformer Engine (its local
``DotProductAttention`` asserts ``packed_seq_params is None``), which needs a GPU; what runs on
CPU is the record and Megatron's own rotary embedding for packed sequences, which splits the
token axis by ``cu_seqlens_q_padded``.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from streampack import pack_batch
from streampack.attention import te_kwargs
from streampack.integrations.megatron import megatron_batch
from tests.integration.test_examples import EXAMPLES, run

megatron = pytest.importorskip("megatron.core")
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402


def batch(align: int):  # noqa: ANN201
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, 100, (n,), generator=g).tolist() for n in (5, 3, 8, 1, 6)]
    masked = {"input_ids": docs[2], "loss_mask": [0] * 4 + [1] * 4}
    return pack_batch([[docs[0], docs[1]], [masked, docs[3]], [docs[4]]], capacity=12, align=align)


@pytest.mark.parametrize("align", [1, 4])
def test_megatron_batch_uses_megatrons_own_packed_seq_params(align: int) -> None:
    b = batch(align)
    mb = megatron_batch(b)
    psp = mb.packed_seq_params
    assert type(psp) is PackedSeqParams and psp.qkv_format == "thd"
    te = te_kwargs(b)
    assert torch.equal(psp.cu_seqlens_q, te.cu_seqlens_q) and type(psp.max_seqlen_q) is int
    # TE decides "padding between sequences" by identity: same object exactly when unpadded
    assert (psp.cu_seqlens_q_padded is psp.cu_seqlens_q) == (not b.has_padding)
    assert mb.attention_mask is None and mb.tokens.shape == mb.labels.shape == (1, b.total_tokens)
    keep = b.labels != b.ignore_index
    assert torch.equal(mb.loss_mask[0].bool(), keep) and int(mb.loss_mask.sum()) == mb.num_targets == b.num_targets
    assert bool((mb.labels[0][~keep] == 0).all()) and torch.equal(mb.labels[0][keep], b.labels[keep])
    assert torch.equal(mb.position_ids[0], b.position_ids)


@pytest.fixture
def group_of_one(tmp_path):  # noqa: ANN001, ANN201
    """A real single-rank gloo group (Megatron's thd RoPE asks its CP group for size and rank)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("align", [1, 4])
def test_megatrons_thd_rope_restarts_at_every_document(align: int, group_of_one) -> None:  # noqa: ANN001
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        RotaryEmbedding,
    )
    from megatron.core.transformer import TransformerConfig

    b = batch(align)
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, apply_rope_fusion=False)
    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True, cp_group=group_of_one)
    # RotaryEmbedding.forward moves its inverse frequencies to CUDA; its frequency table is
    # what forward builds from them ([max_s, 1, 1, d], both halves)
    table = rope.get_freqs_non_repeated(b.capacity)
    freqs = torch.cat((table, table), dim=-1)[:, None, None, :]
    q = torch.randn(b.total_tokens, 4, 16, generator=torch.Generator().manual_seed(1))
    psp = megatron_batch(b).packed_seq_params
    packed = apply_rotary_pos_emb(q, freqs, config, cu_seqlens=psp.cu_seqlens_q_padded, cp_group=group_of_one)
    # every padded span rotated from position 0, as if its document ran alone (bshd, batch 1)
    cup = b.cu_seqlens_padded.tolist()
    for s, e in zip(cup[:-1], cup[1:]):
        alone = apply_rotary_pos_emb(q[s:e, None], freqs[:e - s], config, cp_group=group_of_one)[:, 0]
        torch.testing.assert_close(packed[s:e], alone)
    # ... which is exactly RoPE at the batch's own position_ids
    at_positions = apply_rotary_pos_emb(q[:, None], freqs[b.position_ids], config, cp_group=group_of_one)[:, 0]
    torch.testing.assert_close(packed, at_positions)


@pytest.mark.slow
def test_example_megatron_batches() -> None:
    out = run([sys.executable, str(EXAMPLES / "megatron_batches.py")])
    assert out.count("thd RoPE per document: True") == 3
