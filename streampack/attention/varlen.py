"""torch's own FlashAttention-2 varlen kernel, called the same way on every torch that has it.

``torch.nn.attention.varlen.varlen_attn`` (CUDA only) changed signature between releases: torch
2.11 has no ``enable_gqa`` (passing it raised ``TypeError`` on an H100), later ones add it.
:func:`varlen_attention` inspects the installed signature once and expands the KV heads
(``repeat_interleave``) where ``enable_gqa`` is missing.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from streampack.layout.adapters import FlashAttnKwargs


def torch_varlen_attn() -> Callable[..., Any]:
    """The installed ``varlen_attn``; ``ImportError`` naming the torch version when absent."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        raise ImportError(f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn "
                          f"(added in torch 2.10); use flash-attn's flash_attn_varlen_func with "
                          f"batch.flash_attn_kwargs() instead") from e
    return varlen_attn


@functools.cache
def _accepts(kernel: Callable[..., Any], name: str) -> bool:
    return name in inspect.signature(kernel).parameters


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: FlashAttnKwargs, *, causal: bool = True,
                     scale: float | None = None, kernel: Callable[..., Any] | None = None) -> torch.Tensor:
    """Packed attention over the spans of ``kwargs`` (``batch.flash_attn_kwargs()``): ``q`` ``[T, H, D]``,
    ``k``/``v`` ``[T, Hkv, D]``, returns ``[T, H, D]``. ``kernel`` defaults to torch's ``varlen_attn``."""
    kernel = kernel if kernel is not None else torch_varlen_attn()
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"query heads {heads} must be a multiple of key/value heads {kv_heads}")
    extra: dict[str, Any] = {"window_size": (-1, 0) if causal else (-1, -1), "scale": scale}
    if heads != kv_heads:
        if _accepts(kernel, "enable_gqa"):
            extra["enable_gqa"] = True
        else:  # torch 2.11: no grouped-query support in the kernel's signature
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
    return kernel(q, k, v, kwargs.cu_seqlens_q, kwargs.cu_seqlens_k, kwargs.max_seqlen_q, kwargs.max_seqlen_k, **extra)
