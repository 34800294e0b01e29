"""torch's FlashAttention-2 varlen kernel driven by ``flash_attn_kwargs()`` (and by the per-rank
CP inputs) equals the SDPA reference in bf16 tolerance, at real tokens -- on a GPU. On CPU,
the portable front (:func:`streampack.attention.varlen.varlen_attention`) is checked against
stand-ins with each released ``varlen_attn`` signature."""

from __future__ import annotations

import helpers_layouts as layouts
import pytest
import torch

from streampack import PackedBatch, alignment
from streampack.attention import cp_rank_inputs, sdpa_packed, varlen_attention_reference
from streampack.attention.varlen import varlen_attention
from streampack.layout.cp import cp_unshard

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
H, HKV, D = 4, 2, 64


def random_batch(seed: int, capacity: int = 256, align: int = 8, num_packs: int = 3,
                 device: str = "cuda") -> PackedBatch:
    return layouts.random_batch(seed, capacity=capacity, align=align, num_packs=num_packs,
                                vocab=1000).to(device)


def real_mask(batch: PackedBatch) -> torch.Tensor:
    real = torch.zeros(batch.total_tokens, dtype=torch.bool, device=batch.input_ids.device)
    for s, n in zip(batch.cu_seqlens_padded[:-1].tolist(), batch.doc_lengths.tolist()):
        real[s:s + n] = True
    return real


def qkv(T: int, seed: int, device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(T, h, D, device=device, dtype=dtype, generator=g).requires_grad_()
            for h in (H, HKV, HKV)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("seed", range(4))
def test_varlen_attn_with_flash_attn_kwargs_equals_reference(seed: int) -> None:
    batch = random_batch(seed, align=[1, 8, 16, 64][seed])
    kw = batch.flash_attn_kwargs()
    assert kw.cu_seqlens_q.is_cuda and kw.cu_seqlens_q.dtype == torch.int32
    q, k, v = qkv(batch.total_tokens, seed)
    out = varlen_attention(q, k, v, kw)
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


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("cp_size", [2, 4])
def test_varlen_attn_per_cp_rank_equals_cp1(cp_size: int) -> None:
    batch = random_batch(cp_size, align=alignment(cp_size) * 4)
    q, k, v = (t.detach() for t in qkv(batch.total_tokens, 10 + cp_size))
    ref = sdpa_packed(q.float(), k.float(), v.float(), batch)
    outs = []
    for rank in range(cp_size):
        r = cp_rank_inputs(batch, cp_size, rank)
        k_idx = r.flash.k_indices
        outs.append(varlen_attention(q[r.shard.indices], k[k_idx], v[k_idx], r.flash.kwargs))
    out = cp_unshard(outs, batch.cu_seqlens_padded)
    real = real_mask(batch)
    torch.testing.assert_close(out[real].float(), ref[real], atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------- CPU: signature portability
def _reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size):  # noqa: ANN001, ANN202
    if query.shape[1] != key.shape[1]:
        raise RuntimeError("this kernel needs as many key/value heads as query heads")
    assert window_size in ((-1, 0), (-1, -1)) and max_q >= 1 and max_k >= 1
    return varlen_attention_reference(query, key, value, cu_seq_q, cu_seq_k,
                                      causal=window_size == (-1, 0), scale=scale)


def varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,  # noqa: ANN001, ANN201
                     scale=None, window_size=(-1, -1)):
    """torch 2.11's signature: no ``enable_gqa``."""
    return _reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                             window_size=window_size)


def varlen_attn_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,  # noqa: ANN001, ANN201
                     scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None,
                     block_table=None, num_splits=None):
    """torch 2.13's signature: grouped-query attention inside the kernel."""
    if enable_gqa:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    return _reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                             window_size=window_size)


@pytest.mark.parametrize("kernel", [varlen_attn_2_11, varlen_attn_2_13], ids=["torch2.11", "torch2.13"])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_front_matches_reference_for_each_signature(kernel, causal: bool) -> None:  # noqa: ANN001
    batch = random_batch(5, capacity=32, align=4, device="cpu")
    q, k, v = qkv(batch.total_tokens, 3, device="cpu", dtype=torch.float32)
    out = varlen_attention(q, k, v, batch.flash_attn_kwargs(causal=causal), causal=causal,
                           kernel=kernel)
    ref = sdpa_packed(q, k, v, batch, causal=causal)
    real = real_mask(batch)
    torch.testing.assert_close(out[real], ref[real], atol=1e-5, rtol=1e-5)


def test_the_2_11_signature_refuses_enable_gqa() -> None:
    """What the old test did on an H100 with torch 2.11 (6 of 6 failed)."""
    batch = random_batch(6, capacity=16, align=1, device="cpu")
    q, k, v = qkv(batch.total_tokens, 4, device="cpu", dtype=torch.float32)
    kw = batch.flash_attn_kwargs()
    with pytest.raises(TypeError, match="enable_gqa"):
        varlen_attn_2_11(q, k, v, kw.cu_seqlens_q, kw.cu_seqlens_k, kw.max_seqlen_q,
                         kw.max_seqlen_k, window_size=(-1, 0), enable_gqa=True)


def test_head_counts_must_divide() -> None:
    batch = random_batch(7, capacity=16, align=1, device="cpu")
    q = torch.randn(batch.total_tokens, 3, 8)
    k = v = torch.randn(batch.total_tokens, 2, 8)
    with pytest.raises(ValueError, match="multiple"):
        varlen_attention(q, k, v, batch.flash_attn_kwargs(), kernel=varlen_attn_2_13)


@pytest.mark.slow
@pytest.mark.parametrize("script, expected", [
    ("bench_gpu.py", ("packed THD (varlen_attn)", "earlier helper")),
    ("bench_gpu_feed.py", ("loader alone, to the device", "Margin: one worker delivers")),
])
def test_gpu_benchmark_code_paths_run_on_cpu(script: str, expected: tuple[str, ...]) -> None:
    """``benchmarks/<script> --cpu-check``: every path of a GPU benchmark, tiny, on CPU (so it cannot
    rot between GPU runs)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / script), "--cpu-check"],
                         cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert all(text in out.stdout for text in expected), out.stdout[-3000:]
