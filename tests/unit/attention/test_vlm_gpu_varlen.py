"""Vision ``cu_seqlens`` through torch's FlashAttention-2 varlen kernel (bidirectional, as a ViT
attends) equal attention over each image frame alone -- on a GPU; skipped without CUDA.

This is the flash path of Qwen2-VL's vision tower (``VisionAttention`` hands ``cu_seqlens`` to
the varlen kernel when flash attention is requested); on CPU the tower splits per frame itself
(``tests/unit/layout/test_vlm_equivalence.py``). The CPU case drives the same check through a stand-in with
torch 2.11's ``varlen_attn`` signature (``window_size=(-1, -1)`` = bidirectional), so the
plumbing (segments, window, kwargs) is tested where there is no GPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from streampack.attention import varlen_attention_reference
from streampack.attention.varlen import varlen_attention
from streampack.layout.adapters import FlashAttnKwargs
from streampack.layout.vision import vision_cu_seqlens

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
H, D = 4, 64


def cpu_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1)):
    """torch 2.11's ``varlen_attn`` signature over the per-span CPU reference."""
    assert window_size in ((-1, -1), (-1, 0)) and max_q >= int(torch.diff(cu_seq_q).max())
    return varlen_attention_reference(query, key, value, cu_seq_q, cu_seq_k, causal=window_size == (-1, 0),
                                      scale=scale)


def kwargs_of(cu: torch.Tensor) -> FlashAttnKwargs:
    longest = int(torch.diff(cu).max())
    return FlashAttnKwargs(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)


def check(seed: int, device: str, dtype: torch.dtype, kernel: Callable[..., Any] | None, tol: float, *,
          side: int = 20) -> None:
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 7, (), generator=gen))
    grid = torch.stack([torch.randint(1, 3, (n,), generator=gen), 2 * torch.randint(1, side, (n,), generator=gen),
                        2 * torch.randint(1, side, (n,), generator=gen)], 1)
    cu = vision_cu_seqlens(grid).to(device)
    lengths = torch.diff(cu).tolist()
    assert len(lengths) == int(grid[:, 0].sum())  # one span per frame
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(int(cu[-1]), H, D, device=device, dtype=dtype, generator=g).requires_grad_()
               for _ in range(3))
    out = varlen_attention(q, k, v, kwargs_of(cu), causal=False, kernel=kernel)
    parts = [F.scaled_dot_product_attention(*(x.float().transpose(0, 1)[None] for x in xs))[0].transpose(0, 1)
             for xs in zip(*(t.split(lengths) for t in (q, k, v)))]
    ref = torch.cat(parts)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    w = torch.randn_like(ref)
    grads = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.float(), want.float(), atol=2.5 * tol, rtol=2.5 * tol)
    # not vacuous: one span over all patches (images attending to each other) is far off
    whole = torch.tensor([0, int(cu[-1])], dtype=torch.int32, device=device)
    mixed = varlen_attention(q, k, v, kwargs_of(whole), causal=False, kernel=kernel)
    assert (mixed.float() - ref).abs().amax() > 0.1


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("seed", range(3))
def test_vision_cu_seqlens_through_varlen_attn_equal_per_image_attention(seed: int) -> None:
    check(seed, "cuda", torch.bfloat16, None, 2e-2)


def test_vision_cu_seqlens_through_a_cpu_varlen_stand_in() -> None:
    check(0, "cpu", torch.float32, cpu_varlen_attn, 1e-5, side=6)
