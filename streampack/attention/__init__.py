"""Attention-side helpers for a PackedBatch: consumer adapters, an exact torch reference,
packing-invariant losses and per-rank context-parallel inputs.

No import here pulls flash-attn, Transformer Engine or Megatron; they are GPU-only and
imported lazily where used (only ``packed_seq_params`` tries ``megatron.core``).
"""

from __future__ import annotations

from streampack.attention.context_parallel import (
    CPFlashAttnInputs,
    CPFlashAttnKwargs,
    CPRankInputs,
    cp_flash_attn_inputs,
    cp_rank_inputs,
)
from streampack.attention.loss import (
    LossResult,
    PaddedDocuments,
    global_num_sequences,
    global_num_targets,
    num_supervised_sequences,
    packed_cross_entropy,
    token_logprobs,
    unpack_padded,
    unpack_per_document,
)
from streampack.attention.probe import LeakReport, leak_probe
from streampack.attention.reference import (
    flex_block_mask,
    packed_attention_mask,
    sdpa_packed,
    varlen_attention_reference,
)
from streampack.attention.varlen import varlen_attention
from streampack.layout.adapters import (
    FlashAttnKwargs,
    HFInputs,
    LocalPackedSeqParams,
    SSMKwargs,
    TEKwargs,
    flash_attn_kwargs,
    hf_inputs,
    hf_labels,
    packed_seq_params,
    ssm_kwargs,
    te_kwargs,
    varlen_cu_seqlens,
)

__all__ = ["LeakReport", "leak_probe", "CPFlashAttnInputs", "CPFlashAttnKwargs", "CPRankInputs", "FlashAttnKwargs",
           "HFInputs", "LocalPackedSeqParams", "LossResult", "PaddedDocuments", "SSMKwargs", "TEKwargs",
           "cp_flash_attn_inputs", "cp_rank_inputs", "flash_attn_kwargs", "flex_block_mask", "global_num_sequences",
           "global_num_targets", "hf_inputs", "hf_labels", "num_supervised_sequences", "packed_attention_mask",
           "packed_cross_entropy", "packed_seq_params", "sdpa_packed", "ssm_kwargs", "te_kwargs", "token_logprobs",
           "unpack_padded", "unpack_per_document", "varlen_attention", "varlen_attention_reference",
           "varlen_cu_seqlens"]
