"""torchtitan's data convention for packed batches, with document boundaries that are not guessed from EOS tokens.

torchtitan reads ``(input_dict, labels)`` (``input_dict["input"]`` ``[B, S]``, other keys passed to
``forward``, labels shifted with ``-100``). For ``attn_type="varlen"`` / ``"flex"`` its Llama models
build document masks from EOS positions (with a host sync per forward): wrong for a split
overlong sample (no EOS) and for alignment padding between documents
(``tests/integration/test_integration_torchtitan.py``). Here :func:`titan_collate` carries the spans,
:func:`post_dataloading_process` (torchtitan's hook of that name) turns them into its
``attention_masks`` without a host sync, and :func:`titan_dataloader` is torchtitan's own
``ParallelAwareDataloader`` over a PackedDataset. ``import torchtitan`` needs ``triton``.
"""

from __future__ import annotations

from typing import Any

import torch

from streampack.layout.adapters import HF_IGNORE_INDEX
from streampack.layout.batch import PackedBatch

SPANS_KEY = "streampack_varlen_cu_seqlens"
"""``input_dict`` key of the spans (int32 ``[m+1]``; a tensor, so torchtitan moves it)."""
MAX_KEY = "streampack_varlen_max_seqlen"
"""``input_dict`` key of the longest span (a Python int)."""
LAYOUT_KEY = "streampack_layout"
"""``input_dict`` key of ``(cu_seqlens, cu_seqlens_padded)`` for flex block masks."""


def titan_collate(batch: PackedBatch) -> tuple[dict[str, Any], torch.Tensor]:
    """``(input_dict, labels)`` in torchtitan's convention: ``[1, T]`` ``input``, per-document
    ``positions`` and ``labels`` (shifted, ``-100`` ignored), plus the spans for
    :func:`post_dataloading_process`."""
    labels = batch.labels
    if batch.ignore_index != HF_IGNORE_INDEX:
        labels = torch.where(labels == batch.ignore_index, HF_IGNORE_INDEX, labels)
    inputs = {"input": batch.input_ids.long().unsqueeze(0), "positions": batch.position_ids.unsqueeze(0),
              SPANS_KEY: batch.varlen_cu_seqlens, MAX_KEY: batch.varlen_max_seqlen,
              LAYOUT_KEY: torch.stack([batch.cu_seqlens, batch.cu_seqlens_padded])}
    return inputs, labels.unsqueeze(0)


def varlen_metadata(cu_seqlens: torch.Tensor, max_seqlen: int) -> Any:
    """torchtitan's ``VarlenMetadata`` for the spans (what ``attn_type="varlen"`` takes)."""
    from torchtitan.models.attention import VarlenMetadata

    return VarlenMetadata(cu_seq_q=cu_seqlens, cu_seq_k=cu_seqlens, max_q=max_seqlen, max_k=max_seqlen)


def post_dataloading_process(trainer: Any, input_dict: dict[str, Any], labels: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any], dict[str, Any]]:
    """torchtitan's ``Trainer.post_dataloading_process`` for :func:`titan_collate` batches (assign it on a
    Trainer subclass): ``(inputs, labels, extra_inputs, extra_kwargs)`` with ``positions`` in
    ``extra_inputs`` and the document masks in ``extra_kwargs["attention_masks"]``."""
    input_dict = dict(input_dict)
    cu, max_len, layout = input_dict.pop(SPANS_KEY), input_dict.pop(MAX_KEY), input_dict.pop(LAYOUT_KEY)
    inputs = input_dict.pop("input")
    attn_type = getattr(trainer.model_args, "attn_type", "sdpa")
    parallel = getattr(trainer, "parallel_dims", None)
    if parallel is not None and getattr(parallel, "cp_enabled", False):
        raise NotImplementedError("context parallelism: shard with streampack.attention.cp_rank_inputs "
                                  "instead of torchtitan's prepare_context_parallel_input")
    if attn_type == "varlen":
        masks = varlen_metadata(cu.to(inputs.device, torch.int32), max_len)
    elif attn_type == "flex":
        masks = flex_block_mask(layout.to(inputs.device))
    else:
        raise ValueError(f"attn_type={attn_type!r} attends across the whole packed sequence; "
                         f"use 'varlen' (CUDA) or 'flex' so documents do not see each other")
    return inputs, labels, input_dict, {"attention_masks": masks}


def flex_block_mask(layout: torch.Tensor) -> Any:
    """A FlexAttention ``BlockMask`` (batch dimension 1) from ``stack([cu_seqlens,
    cu_seqlens_padded])`` as :func:`titan_collate` carries it."""
    from types import SimpleNamespace

    from streampack.attention.reference import flex_block_mask as block_mask

    return block_mask(SimpleNamespace(cu_seqlens=layout[0], cu_seqlens_padded=layout[1]))


def titan_dataloader(dataset: Any, *, dp_rank: int, dp_world_size: int, **kwargs: Any) -> Any:
    """torchtitan's ``ParallelAwareDataloader`` (state keyed by DP rank) yielding :func:`titan_collate`
    batches; ``dp_rank`` / ``dp_world_size`` other than the dataset's are a ``ValueError`` naming both."""
    resolved = (getattr(dataset, "dp_rank", None), getattr(dataset, "dp_size", None))
    if None not in resolved and resolved != (dp_rank, dp_world_size):
        raise ValueError(f"titan_dataloader({dp_rank=}, {dp_world_size=}) but the dataset resolved "
                         f"dp_rank={resolved[0]}, dp_size={resolved[1]}: pass the data-parallel rank and size of "
                         "torchtitan's parallel_dims to the PackedDataset too (topology=TopologyOptions(dp_rank=..., "
                         "dp_size=...) or TopologyOptions(dp_group=...)), or its data would be another rank's")
    from torchtitan.components.dataloader import ParallelAwareDataloader  # after the check: it takes ~10 s

    return ParallelAwareDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size,
                                   batch_size=None, collate_fn=titan_collate, **kwargs)
