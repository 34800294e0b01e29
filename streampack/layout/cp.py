"""Context-parallel sharding of a THD batch, token for token as Transformer Engine does it.

Rank ``r`` of ``W`` takes, from each document whose padded span is ``L`` tokens at offset ``s`` (``c = L / 2W``), ``[s +
r·c, s + (r+1)·c)`` then the mirrored ``[s + (2W−1−r)·c, s + (2W−r)·c)``, so causal attention costs the same on every
rank (``thd_get_partitioned_indices``; TE's own case ``cu_seqlens_padded=[0, 8, 16]``, ``W=2`` gives rank 0
``[0,1,6,7,8,9,14,15]``). Labels are shifted before sharding, so a rank never needs its neighbour's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from streampack.layout.batch import PackedBatch


def cp_partition_indices(cu_seqlens_padded: torch.Tensor, total_tokens: int, cp_size: int,
                         cp_rank: int) -> torch.Tensor:
    """int64 ``[total_tokens / cp_size]``: the global token indices rank ``cp_rank`` holds."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"{cp_rank=} must be in [0, {cp_size=})")
    cu = cu_seqlens_padded.to("cpu", torch.int64)
    if int(cu[-1]) != total_tokens:
        # TE silently overlaps partitions and drops tokens in this case; refuse instead.
        raise ValueError(f"cu_seqlens_padded[-1]={int(cu[-1])} must equal {total_tokens=}")
    if cp_size == 1:
        return torch.arange(total_tokens, device=cu_seqlens_padded.device)
    spans = cu[1:] - cu[:-1]
    bad = spans % (2 * cp_size) != 0
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"document {i} has padded length {int(spans[i])}, not a multiple of "
                         f"2*cp_size={2 * cp_size}; build the batch with align=2*cp_size*tp_size")
    chunk = spans // (2 * cp_size)
    first = cu[:-1] + cp_rank * chunk
    second = cu[:-1] + (2 * cp_size - 1 - cp_rank) * chunk
    starts = torch.stack([first, second], dim=1).reshape(-1)
    lengths = chunk.repeat_interleave(2)
    # arange within each run: global offset of the run start + position inside it
    run_start = torch.repeat_interleave(starts, lengths)
    ends = torch.cumsum(lengths, 0)
    local = torch.arange(int(ends[-1]) if len(ends) else 0) - torch.repeat_interleave(ends - lengths, lengths)
    return (run_start + local).to(cu_seqlens_padded.device)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class CPShard:
    """What CP rank ``cp_rank`` of ``cp_size`` feeds its model: its ``T / cp_size`` tokens plus
    the global boundary metadata attention kernels need (TE divides by ``cp_size`` itself)."""

    cp_size: int
    cp_rank: int
    indices: torch.Tensor
    """int64 ``[T/cp]``: global token index of each local token."""
    input_ids: torch.Tensor
    """int64 ``[T/cp]`` (widened from the batch's int32 ids, as consumers of a shard have always taken them)."""
    labels: torch.Tensor
    """int64 ``[T/cp]``: the batch's derived labels at the local tokens."""
    position_ids: torch.Tensor
    """Global positions of the local tokens (so RoPE sees each token's true position)."""
    seq_idx: torch.Tensor
    """int32 ``[T/cp]``: document of each local token."""
    cu_seqlens: torch.Tensor
    """int32 global real lengths (what TE/Megatron take under CP)."""
    cu_seqlens_padded: torch.Tensor
    """int32 global padded offsets."""
    cu_seqlens_padded_local: torch.Tensor
    """int32 ``cu_seqlens_padded / cp_size``: the document spans inside this rank's tokens."""
    max_seqlen: int
    num_targets: int
    """Targets of the whole batch (all ranks): the token-mean loss denominator."""
    num_targets_local: int
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


def cp_shard(batch: PackedBatch, cp_size: int, cp_rank: int) -> CPShard:
    """The slice of ``batch`` that context-parallel rank ``cp_rank`` of ``cp_size`` holds."""
    idx = cp_partition_indices(batch.cu_seqlens_padded, batch.total_tokens, cp_size, cp_rank)
    labels = batch.labels[idx]
    return CPShard(cp_size=cp_size, cp_rank=cp_rank, indices=idx, input_ids=batch.input_ids[idx].long(), labels=labels,
                   position_ids=batch.position_ids[idx], seq_idx=batch.seq_idx[idx], cu_seqlens=batch.cu_seqlens,
                   cu_seqlens_padded=batch.cu_seqlens_padded,
                   cu_seqlens_padded_local=torch.div(batch.cu_seqlens_padded, cp_size,
                                                     rounding_mode="floor").to(torch.int32),
                   max_seqlen=batch.max_seqlen, num_targets=batch.num_targets,
                   num_targets_local=int((labels != batch.ignore_index).sum()),
                   extras={k: v[idx] for k, v in batch.extras.items()})


def cp_unshard(parts: Sequence[torch.Tensor], cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`cp_shard` for per-token outputs: ``parts[r]`` is rank ``r``'s
    ``[T/cp, ...]`` tensor; returns ``[T, ...]`` in document order (``cp_size = len(parts)``)."""
    cp_size = len(parts)
    if cp_size == 0:
        raise ValueError("cp_unshard needs at least one part")
    total = sum(int(p.shape[0]) for p in parts)
    out = parts[0].new_empty((total, *parts[0].shape[1:]))
    for rank, part in enumerate(parts):
        idx = cp_partition_indices(cu_seqlens_padded, total, cp_size, rank).to(part.device)
        if idx.shape[0] != part.shape[0]:
            raise ValueError(f"part {rank} has {part.shape[0]} tokens, expected {idx.shape[0]}")
        out[idx] = part
    return out
