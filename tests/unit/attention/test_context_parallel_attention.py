"""Simulated context parallelism (CP = 2, 4) in one process: each rank's queries attend to their
document's full (gathered) keys, and the gathered outputs equal CP = 1, forward and backward."""

from __future__ import annotations

import helpers_layouts as layouts
import pytest
import torch

from streampack import PackedBatch, alignment, cp_unshard, pack_batch
from streampack.attention import (
    cp_flash_attn_inputs,
    cp_rank_inputs,
    sdpa_packed,
    te_kwargs,
    varlen_attention_reference,
)

H, D = 2, 8


def cp_batch(seed: int, cp_size: int, num_packs: int = 2) -> PackedBatch:
    align = alignment(cp_size)
    return layouts.random_batch(seed, capacity=align * 6, align=align, num_packs=num_packs,
                                p_more=0.7, vocab=50)


class Proj(torch.nn.Module):
    """Per-token q/k/v projections: what a rank computes from its local hidden states."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(D, H * D) for _ in range(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(p(x).unflatten(-1, (H, D)) for p in (self.q, self.k, self.v))


def real_mask(batch: PackedBatch) -> torch.Tensor:
    real = torch.zeros(batch.total_tokens, dtype=torch.bool)
    for s, n in zip(batch.cu_seqlens_padded[:-1].tolist(), batch.doc_lengths.tolist()):
        real[s:s + n] = True
    return real


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("path", ["sdpa", "varlen"])
def test_cp_outputs_and_grads_equal_cp1(cp_size: int, seed: int, path: str) -> None:
    torch.manual_seed(seed)
    batch = cp_batch(seed, cp_size)
    proj = Proj()
    x = torch.randn(batch.total_tokens, D, requires_grad=True)
    real = real_mask(batch)
    weight = torch.randn(batch.total_tokens, H, D)

    ref = sdpa_packed(*proj(x), batch)
    ref_loss = (ref[real] * weight[real]).sum()
    ref_grads = torch.autograd.grad(ref_loss, (x, *proj.parameters()))

    ranks = [cp_rank_inputs(batch, cp_size, r) for r in range(cp_size)]
    local = [proj(x[r.shard.indices]) for r in ranks]  # each rank: its own tokens only
    k_full = cp_unshard([loc[1] for loc in local], batch.cu_seqlens_padded)  # all-gather K and V
    v_full = cp_unshard([loc[2] for loc in local], batch.cu_seqlens_padded)
    outs = []
    for r, (q_local, _, _) in zip(ranks, local):
        if path == "sdpa":
            outs.append(sdpa_packed(q_local, k_full, v_full, r.shard))
        else:
            kw, k_idx = r.flash.kwargs, r.flash.k_indices
            outs.append(varlen_attention_reference(q_local, k_full[k_idx], v_full[k_idx],
                                                   kw.cu_seqlens_q, kw.cu_seqlens_k))
    out = cp_unshard(outs, batch.cu_seqlens_padded)
    torch.testing.assert_close(out[real], ref[real], atol=1e-6, rtol=1e-5)
    assert torch.isfinite(out).all()
    loss = (out[real] * weight[real]).sum()
    grads = torch.autograd.grad(loss, (x, *proj.parameters()))
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_rank_queries_see_their_documents_full_prefix(cp_size: int) -> None:
    batch = cp_batch(7, cp_size)
    cup = batch.cu_seqlens_padded.tolist()
    seen = torch.zeros(batch.total_tokens, dtype=torch.bool)
    for rank in range(cp_size):
        inputs = cp_flash_attn_inputs(batch, cp_size, rank)
        kw, k_idx = inputs.kwargs, inputs.k_indices
        cq, ck = kw.cu_seqlens_q.tolist(), kw.cu_seqlens_k.tolist()
        assert kw.cu_seqlens_q.dtype == kw.cu_seqlens_k.dtype == torch.int32
        assert type(kw.max_seqlen_q) is int and type(kw.max_seqlen_k) is int
        assert cq[-1] == batch.total_tokens // cp_size and ck[-1] == len(k_idx)
        shard_idx = cp_rank_inputs(batch, cp_size, rank).shard.indices
        for span in range(len(cq) - 1):
            doc = span // 2
            keys = k_idx[ck[span]:ck[span + 1]].tolist()
            queries = shard_idx[cq[span]:cq[span + 1]].tolist()
            # keys: the document's own prefix, from its first token up to the chunk's last query
            assert keys == list(range(cup[doc], queries[-1] + 1))
            seen[queries] = True
    assert bool(seen.all()), "some token is nobody's query"


def test_te_kwargs_under_cp_are_global_and_shared() -> None:
    batch = cp_batch(3, 2)
    inputs = [cp_rank_inputs(batch, 2, r) for r in range(2)]
    te = te_kwargs(batch)
    for r in inputs:
        assert torch.equal(r.te.cu_seqlens_q, batch.cu_seqlens)
        assert torch.equal(r.te.cu_seqlens_q_padded, batch.cu_seqlens_padded)
        assert r.te.max_seqlen_q == te.max_seqlen_q == batch.max_seqlen
        assert torch.equal(r.packed_seq_params.cu_seqlens_kv_padded, batch.cu_seqlens_padded)
        assert r.shard.input_ids.shape[0] == batch.total_tokens // 2


def test_misaligned_batch_is_refused() -> None:
    batch = pack_batch([[[1, 2, 3, 4, 5], [6]]], capacity=8, align=2)  # spans 6, 2
    with pytest.raises(ValueError, match="2\\*cp_size=4"):
        cp_flash_attn_inputs(batch, 2, 0)
    with pytest.raises(ValueError, match="cp_rank"):
        cp_flash_attn_inputs(batch, 2, 2)
