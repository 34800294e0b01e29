"""On a GPU: torch's FlashAttention-2 varlen kernel driven by ``flash_attn_kwargs()`` (and by the
per-rank CP inputs) equals the SDPA reference in bf16 tolerance, at real tokens."""

from __future__ import annotations

import helpers_layouts as layouts
import pytest
import torch

from streampack import PackedBatch, alignment
from streampack.attention import cp_rank_inputs, sdpa_packed
from streampack.layout.cp import cp_unshard

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
H, HKV, D = 4, 2, 64


def random_batch(seed: int, capacity: int = 256, align: int = 8, num_packs: int = 3) -> PackedBatch:
    return layouts.random_batch(seed, capacity=capacity, align=align, num_packs=num_packs,
                                vocab=1000).to("cuda")


def real_mask(batch: PackedBatch) -> torch.Tensor:
    real = torch.zeros(batch.total_tokens, dtype=torch.bool, device="cuda")
    for s, n in zip(batch.cu_seqlens_padded[:-1].tolist(), batch.doc_lengths.tolist()):
        real[s:s + n] = True
    return real


def qkv(T: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(T, h, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for h in (H, HKV, HKV)]


def varlen(q, k, v, cu_q, cu_k, max_q, max_k):  # noqa: ANN001, ANN201
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, 0), enable_gqa=True)


@pytest.mark.parametrize("seed", range(4))
def test_varlen_attn_with_flash_attn_kwargs_equals_reference(seed: int) -> None:
    batch = random_batch(seed, align=[1, 8, 16, 64][seed])
    kw = batch.flash_attn_kwargs()
    assert kw.cu_seqlens_q.is_cuda and kw.cu_seqlens_q.dtype == torch.int32
    q, k, v = qkv(batch.total_tokens, seed)
    out = varlen(q, k, v, kw.cu_seqlens_q, kw.cu_seqlens_k, kw.max_seqlen_q, kw.max_seqlen_k)
    ref = sdpa_packed(q.float(), k.float(), v.float(), batch)
    real = real_mask(batch)
    assert torch.isfinite(out).all(), "padding outputs must be finite"
    torch.testing.assert_close(out[real].float(), ref[real], atol=2e-2, rtol=2e-2)
    w = torch.randn_like(ref) * real[:, None, None]
    grads = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for g, rg in zip(grads, ref_grads):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g.float(), rg.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_varlen_attn_per_cp_rank_equals_cp1(cp_size: int) -> None:
    batch = random_batch(cp_size, align=alignment(cp_size) * 4)
    q, k, v = (t.detach() for t in qkv(batch.total_tokens, 10 + cp_size))
    ref = sdpa_packed(q.float(), k.float(), v.float(), batch)
    outs = []
    for rank in range(cp_size):
        r = cp_rank_inputs(batch, cp_size, rank)
        kw, k_idx = r.flash.kwargs, r.flash.k_indices
        outs.append(varlen(q[r.shard.indices], k[k_idx], v[k_idx], kw.cu_seqlens_q,
                           kw.cu_seqlens_k, kw.max_seqlen_q, kw.max_seqlen_k))
    out = cp_unshard(outs, batch.cu_seqlens_padded)
    real = real_mask(batch)
    torch.testing.assert_close(out[real].float(), ref[real], atol=2e-2, rtol=2e-2)
