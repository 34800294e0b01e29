"""Packed attention through the SDPA reference equals per-document attention, exactly enough."""

from __future__ import annotations

import helpers_layouts as layouts
import pytest
import torch
import torch.nn.functional as F

from streampack import PackedBatch
from streampack.attention import (
    flash_attn_kwargs,
    flex_block_mask,
    packed_attention_mask,
    sdpa_packed,
    varlen_attention_reference,
)


def random_batch(seed: int, *, num_packs: int = 3, capacity: int = 32, align: int = 4) -> PackedBatch:
    return layouts.random_batch(seed, num_packs=num_packs, capacity=capacity, align=align)


def qkv(batch: PackedBatch, heads: int = 4, kv_heads: int = 4, dim: int = 8,
        dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    T = batch.total_tokens
    return tuple(torch.randn(T, h, dim, generator=g, dtype=dtype).requires_grad_()
                 for h in (heads, kv_heads, kv_heads))


def per_document(q, k, v, batch: PackedBatch, causal: bool = True) -> list[torch.Tensor]:
    """Each document alone, real tokens only (the ground truth)."""
    outs = []
    for s, n in zip(batch.cu_seqlens_padded[:-1].tolist(), batch.doc_lengths.tolist()):
        sl = slice(s, s + n)
        o = F.scaled_dot_product_attention(
            q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1),
            is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
        outs.append(o.transpose(0, 1))
    return outs


def real_rows(x: torch.Tensor, batch: PackedBatch) -> list[torch.Tensor]:
    return [x[s:s + n] for s, n in zip(batch.cu_seqlens_padded[:-1].tolist(),
                                       batch.doc_lengths.tolist())]


def test_mask_worked_example() -> None:
    # a (3 tokens) + pad, b (2 tokens) + pad pad: cu=[0,3,5], cu_padded=[0,4,8]
    mask = packed_attention_mask(torch.tensor([0, 3, 5], dtype=torch.int32),
                                 torch.tensor([0, 4, 8], dtype=torch.int32), 8)
    expected = torch.zeros(8, 8, dtype=torch.bool)
    for q in range(4):
        expected[q, :min(q, 2) + 1] = True
    for q in range(4, 8):
        expected[q, 4:min(q, 5) + 1] = True
    assert torch.equal(mask, expected)
    assert bool(mask.any(dim=1).all()), "a fully masked row"


def test_mask_rejects_inconsistent_total() -> None:
    with pytest.raises(ValueError, match="must equal"):
        packed_attention_mask(torch.tensor([0, 3], dtype=torch.int32),
                              torch.tensor([0, 4], dtype=torch.int32), 6)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_equals_per_document_forward_backward(seed: int, kv_heads: int) -> None:
    batch = random_batch(seed, align=[1, 2, 4, 8][seed % 4])
    q, k, v = qkv(batch, kv_heads=kv_heads, seed=seed)
    out = sdpa_packed(q, k, v, batch)
    ref = per_document(q, k, v, batch)
    for got, want in zip(real_rows(out, batch), ref):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert torch.isfinite(out).all()
    # backward: a loss on real rows only; padding rows must receive no gradient influence
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 100))
    grads = torch.autograd.grad(sum((o * wr).sum() for o, wr in zip(real_rows(out, batch),
                                                                   real_rows(w, batch))), (q, k, v))
    ref_grads = torch.autograd.grad(sum((o * wr).sum() for o, wr in zip(ref, real_rows(w, batch))),
                                    (q, k, v))
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, atol=1e-6, rtol=1e-5)


def test_bidirectional_packed_equals_per_document() -> None:
    batch = random_batch(11, align=4)
    q, k, v = qkv(batch, seed=3)
    out = sdpa_packed(q, k, v, batch, causal=False)
    for got, want in zip(real_rows(out, batch), per_document(q, k, v, batch, causal=False)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_perturbing_one_document_leaves_others_bit_identical(seed: int) -> None:
    batch = random_batch(seed, num_packs=2)
    assert batch.num_docs >= 2
    q, k, v = (t.detach() for t in qkv(batch, seed=seed))
    base = sdpa_packed(q, k, v, batch)
    victim = seed % batch.num_docs
    s, e = batch.cu_seqlens_padded[victim].item(), batch.cu_seqlens_padded[victim + 1].item()
    k2, v2, q2 = k.clone(), v.clone(), q.clone()
    for t in (q2, k2, v2):
        t[s:e] += 3.0
    out = sdpa_packed(q2, k2, v2, batch)
    for i, (a, b) in enumerate(zip(real_rows(base, batch), real_rows(out, batch))):
        if i == victim:
            assert not torch.equal(a, b), "the perturbation did not reach its own document"
        else:
            assert torch.equal(a, b), f"document {i} changed when document {victim} did"


def test_leak_probe_detects_plain_causal_attention() -> None:
    """Guard against a vacuous pass: one causal SDPA over the packed axis does leak."""
    batch = random_batch(5, num_packs=1, align=1)
    assert batch.num_docs >= 2
    q, k, v = (t.detach() for t in qkv(batch))
    leaky = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                           v.transpose(0, 1), is_causal=True).transpose(0, 1)
    ref = per_document(q, k, v, batch)
    assert not torch.allclose(real_rows(leaky, batch)[1], ref[1], atol=1e-4)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_kwargs_drive_a_varlen_kernel_exactly(seed: int, causal: bool) -> None:
    """flash-attn semantics (span i of q vs span i of k) on flash_attn_kwargs == SDPA reference."""
    batch = random_batch(seed, align=[2, 4, 8][seed % 3])
    q, k, v = (t.detach() for t in qkv(batch, seed=seed))
    kw = flash_attn_kwargs(batch, causal=causal)
    out = varlen_attention_reference(q, k, v, kw.cu_seqlens_q, kw.cu_seqlens_k, causal=causal)
    ref = sdpa_packed(q, k, v, batch, causal=causal)
    assert torch.isfinite(out).all(), "padding outputs must be finite"
    for got, want in zip(real_rows(out, batch), real_rows(ref, batch)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def _flex_vs_sdpa(compiled: bool) -> None:
    from torch.nn.attention.flex_attention import flex_attention

    batch = random_batch(2, num_packs=2, capacity=128, align=8)
    q, k, v = (t.detach() for t in qkv(batch, heads=2, kv_heads=2, dim=16))
    block_mask = flex_block_mask(batch, device="cpu")
    fn = torch.compile(flex_attention) if compiled else flex_attention
    out = fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
             block_mask=block_mask)[0].transpose(0, 1)
    ref = sdpa_packed(q, k, v, batch)
    for got, want in zip(real_rows(out, batch), real_rows(ref, batch)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_matches_sdpa() -> None:
    _flex_vs_sdpa(compiled=False)  # unfused path: ~2 s, same mask_mod


@pytest.mark.slow
def test_flex_block_mask_matches_sdpa_compiled() -> None:
    _flex_vs_sdpa(compiled=True)  # ~30 s of compilation on CPU


def test_sdpa_packed_rejects_wrong_shapes() -> None:
    batch = random_batch(0)
    q, k, v = (t.detach() for t in qkv(batch))
    with pytest.raises(ValueError, match="q_indices"):
        sdpa_packed(q[:-4], k, v, batch)
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        sdpa_packed(q[None], k, v, batch)
