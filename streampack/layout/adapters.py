"""One :class:`~streampack.layout.batch.PackedBatch`, each attention consumer's own convention.

Every adapter returns a record that is also a ``Mapping``, so it splats straight into the consumer
(``flash_attn_varlen_func(q, k, v, **kw, causal=True)``); nothing here imports flash-attn or
Transformer Engine. No adapter syncs the host with the device: the spans travel with the batch,
``max_*`` values are Python ints, and device-side values use only ops whose output shape the host
knows (``tests/unit/attention/test_sync_free.py``). Padding sits after the real tokens of its span, so it never
changes a real token's output under causal attention; its labels are ``ignore_index``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, Protocol

import torch

from streampack.layout.spans import span_index

HF_IGNORE_INDEX = -100
"""What HF ``ForCausalLMLoss`` ignores; :func:`hf_inputs` maps ``batch.ignore_index`` to it."""


class PackedBatch(Protocol):
    """What the adapters read of a :class:`streampack.layout.batch.PackedBatch` (which imports
    this module for its front-door methods, so the class itself cannot be imported here)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    varlen_cu_seqlens: torch.Tensor
    varlen_max_seqlen: int
    varlen_cu_seqlens_bidirectional: torch.Tensor
    varlen_max_seqlen_bidirectional: int
    ignore_index: int

    @property
    def total_tokens(self) -> int: ...
    @property
    def has_padding(self) -> bool: ...
    @property
    def seq_idx(self) -> torch.Tensor: ...


class KwargsRecord(Mapping[str, Any]):
    """Mixin for dataclasses whose fields are exactly a consumer's keyword arguments: splattable, and
    built like a dict (``type(record)({...})``) as HF Trainer, accelerate and Lightning rebuild a mapping
    after moving its tensors. Not frozen, for Lightning; equality is identity."""

    __slots__ = ()

    def __init__(self, values: Mapping[str, Any] | None = None, /, **kwargs: Any) -> None:
        given = {**(values if values is not None else {}), **kwargs}
        for f in fields(self):  # type: ignore[arg-type]
            if f.name in given:
                value = given.pop(f.name)
            elif f.default is not MISSING:
                value = f.default
            else:
                raise TypeError(f"{type(self).__name__} needs {f.name!r}")
            object.__setattr__(self, f.name, value)
        if given:
            raise TypeError(f"{type(self).__name__} has no field(s) {sorted(given)}")

    def _names(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self))  # type: ignore[arg-type]

    def __getitem__(self, key: str) -> Any:
        if key not in self._names():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__

    def as_dict(self) -> dict[str, Any]:
        """A shallow ``dict`` copy (tensors are shared, not cloned)."""
        return {name: getattr(self, name) for name in self._names()}

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Any:
        """A copy with every tensor field on ``device`` (other fields unchanged)."""
        moved: dict[int, torch.Tensor] = {}
        out = {}
        for name, value in self.as_dict().items():
            if isinstance(value, torch.Tensor):
                if id(value) not in moved:
                    moved[id(value)] = value.to(device, non_blocking=non_blocking)
                value = moved[id(value)]
            out[name] = value
        return type(self)(out)


_RECORD = {"init": False, "slots": True, "kw_only": True, "eq": False}


@dataclass(**_RECORD)
class FlashAttnKwargs(KwargsRecord):
    """Keyword arguments of ``flash_attn_varlen_func`` (also torch's ``varlen_attn``, whose
    names differ: ``cu_seq_q=kw.cu_seqlens_q, max_q=kw.max_seqlen_q, ...``)."""

    cu_seqlens_q: torch.Tensor
    """int32 ``[m+1]``, contiguous, on the batch's device: span offsets (see module doc)."""
    cu_seqlens_k: torch.Tensor
    """The same tensor object as ``cu_seqlens_q`` (self-attention)."""
    max_seqlen_q: int
    """Longest span, a Python int (a tensor would force a device sync inside the kernel)."""
    max_seqlen_k: int


@dataclass(**_RECORD)
class TEKwargs(KwargsRecord):
    """Keyword arguments of Transformer Engine ``DotProductAttention.forward`` for ``thd``."""

    cu_seqlens_q: torch.Tensor
    """int32 ``[n+1]``: cumulative *real* lengths (``batch.cu_seqlens``)."""
    cu_seqlens_kv: torch.Tensor
    """The same object as ``cu_seqlens_q``."""
    cu_seqlens_q_padded: torch.Tensor
    """int32 ``[n+1]``: span offsets including padding (``batch.cu_seqlens_padded``); the
    *same object* as ``cu_seqlens_q`` when nothing is padded, because TE decides "padding
    between sequences" by identity and padding disables its FlashAttention backend."""
    cu_seqlens_kv_padded: torch.Tensor
    max_seqlen_q: int
    """Longest padded span, a Python int (TE computes it with a GPU sync otherwise)."""
    max_seqlen_kv: int
    qkv_format: str = "thd"
    attn_mask_type: str = "padding_causal"
    """``thd`` needs a padding mask type in TE (its THD backends and its CP path assert it).
    Plain ``"causal"`` is only equivalent when ``cu_seqlens_q_padded is cu_seqlens_q`` (no
    padding anywhere) and the chosen backend accepts it; prefer ``"padding_causal"``."""


@dataclass(**_RECORD)
class LocalPackedSeqParams(KwargsRecord):
    """Field-for-field stand-in for Megatron's ``PackedSeqParams`` when megatron-core is absent."""

    qkv_format: str
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    cu_seqlens_q_padded: torch.Tensor
    cu_seqlens_kv_padded: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int


@dataclass(**_RECORD)
class HFInputs(KwargsRecord):
    """Keyword arguments of an HF causal LM, as ``DataCollatorWithFlattening`` emits them (``[1, T]`` but
    the cu's). ``use_cache=False`` on purpose: sdpa/eager/flex models detect packing from
    ``position_ids`` only without a KV cache and ``attention_mask``; else documents attend to each other."""

    input_ids: torch.Tensor
    """int64 ``[1, T]``."""
    position_ids: torch.Tensor
    """int64 ``[1, T]``: restart at 0 at every span of ``cu_seq_lens_q`` (alignment padding
    continues its document's positions; a pack's trailing padding restarts at 0)."""
    labels: torch.Tensor
    """int64 ``[1, T]``, NOT shifted (HF shifts inside its loss): ``labels[t]`` is the target
    predicted at ``t-1``; ``-100`` at every document start, at padding and where masked."""
    cu_seq_lens_q: torch.Tensor
    """int32 ``[m+1]``: same spans as :func:`flash_attn_kwargs`."""
    cu_seq_lens_k: torch.Tensor
    max_length_q: int
    max_length_k: int
    seq_idx: torch.Tensor
    """int32 ``[1, T]``: span index of every token (for Mamba-style layers in HF models)."""
    use_cache: bool = False


@dataclass(**_RECORD)
class SSMKwargs(KwargsRecord):
    """Boundary input of state-space / linear-attention kernels (Mamba2
    ``mamba_chunk_scan_combined``, ``causal_conv1d_fn``): without it state leaks across docs."""

    seq_idx: torch.Tensor
    """int32 ``[1, T]``: document index of every token; padding belongs to its span's document,
    so it changes value exactly at ``batch.cu_seqlens_padded[1:-1]``."""


def varlen_cu_seqlens(batch: PackedBatch, *, causal: bool = True) -> torch.Tensor:
    """int32 ``[m+1]`` span offsets for kernels without a padded variant, as the batch carries
    them: causal or bidirectional (every run of padding its own span; :mod:`streampack.layout.spans`)."""
    return batch.varlen_cu_seqlens if causal else batch.varlen_cu_seqlens_bidirectional


def _device_int32(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device=device, dtype=torch.int32).contiguous()  # no-op when already so


def flash_attn_kwargs(batch: PackedBatch, *, causal: bool = True) -> FlashAttnKwargs:
    """``cu_seqlens_q/k`` and ``max_seqlen_q/k`` for ``flash_attn_varlen_func`` (pass
    ``causal=True`` to the kernel yourself) or torch's ``varlen_attn(window_size=(-1, 0))``."""
    cu = _device_int32(varlen_cu_seqlens(batch, causal=causal), batch.input_ids.device)
    max_len = batch.varlen_max_seqlen if causal else batch.varlen_max_seqlen_bidirectional
    return FlashAttnKwargs(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                           max_seqlen_k=max_len)


def te_kwargs(batch: PackedBatch, *, causal: bool = True) -> TEKwargs:
    """Transformer Engine ``thd`` arguments; under context parallelism pass them unchanged
    (global ``cu_seqlens``; TE divides by ``cp_size`` itself) with the rank's local tokens."""
    device = batch.input_ids.device
    real = _device_int32(batch.cu_seqlens, device)
    # identity, not equality, is what TE checks; `has_padding` is a Python comparison of the
    # batch's token counts, so this costs no device sync
    padded = _device_int32(batch.cu_seqlens_padded, device) if batch.has_padding else real
    return TEKwargs(cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                    max_seqlen_q=int(batch.max_seqlen), max_seqlen_kv=int(batch.max_seqlen),
                    attn_mask_type="padding_causal" if causal else "padding")


def packed_seq_params(batch: PackedBatch, *, causal: bool = True) -> Any:
    """Megatron ``PackedSeqParams`` (the tensors of :func:`te_kwargs`), or a :class:`LocalPackedSeqParams`
    without megatron-core; use ``padding_causal`` in Megatron's config too."""
    te = te_kwargs(batch, causal=causal)
    values = {k: te[k] for k in (f.name for f in fields(LocalPackedSeqParams))}
    try:
        from megatron.core.packed_seq_params import PackedSeqParams
    except ImportError:
        return LocalPackedSeqParams(**values)
    return PackedSeqParams(**values)


def hf_labels(batch: PackedBatch) -> torch.Tensor:
    """int64 ``[T]`` unshifted labels: ``out[t] = batch.labels[t-1]``, ``-100`` at ``t = 0`` and wherever
    ``batch.labels`` ignores (so at every document start)."""
    labels = batch.labels
    shifted = torch.cat([labels.new_full((1,), HF_IGNORE_INDEX), labels[:-1]])
    if batch.ignore_index != HF_IGNORE_INDEX:
        shifted = torch.where(shifted == batch.ignore_index, HF_IGNORE_INDEX, shifted)
    return shifted


def hf_inputs(batch: PackedBatch) -> HFInputs:
    """``[1, T]`` inputs for HF transformers with packing; ``.loss`` is the token mean over ``num_targets``."""
    device = batch.input_ids.device
    cu = _device_int32(batch.varlen_cu_seqlens, device)
    total = batch.total_tokens
    index = span_index(cu, total)
    positions = torch.arange(total, device=device) - cu.to(torch.int64)[index.to(torch.int64)]
    # int64 ids: what HF's generate / embedding code paths and today's callers expect of ``input_ids``
    return HFInputs(input_ids=batch.input_ids.long().unsqueeze(0), position_ids=positions.unsqueeze(0),
                    labels=hf_labels(batch).unsqueeze(0), cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                    max_length_q=batch.varlen_max_seqlen, max_length_k=batch.varlen_max_seqlen,
                    seq_idx=index.unsqueeze(0))


def ssm_kwargs(batch: PackedBatch) -> SSMKwargs:
    """``seq_idx`` for Mamba / linear-attention kernels, ``[1, T]`` int32."""
    return SSMKwargs(seq_idx=batch.seq_idx.to(torch.int32).unsqueeze(0).contiguous())
