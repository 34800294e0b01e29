"""Apply a :class:`~streampack.rl.plan.MicroBatchPlan` to real tensors, and undo it.

Input is a padded batch (``input_ids`` ``[B, S]`` with ``attention_mask`` ``[B, S]``, right or left
padding, each row's real tokens contiguous) or a list of ``B`` 1-D sequences; row ``i`` must hold
exactly ``plan.seq_lens[i]`` real tokens. Example (``seq_lens = [3, 1, 2]``, one dynamic
micro-batch ``indices = [0, 2]`` of padded length 4, ``pad_id = 0``)::

    input_ids       [[a0 a1 a2 0], [c0 c1 0 0]]     int64 [b=2, L=4], right padded
    attention_mask  [[1  1  1  0], [1  1  0 0]]     int64 [2, 4]
    position_ids    [[0  1  2  3], [0  1  2 3]]     int64 [2, 4] (real tokens count from 0)
    indices         [0, 2]                           int64 [2]: original row of each row

:func:`restore_order` takes ``outputs[rank][microbatch]`` (indexable by row) back to a list of
``B`` per-sequence results in original order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from streampack.layout.batch import PackedBatch, pack_batch
from streampack.rl.plan import MicroBatchPlan


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class DynamicMicroBatch:
    """One padded micro-batch of ``b`` sequences, truncated to its own padded length ``L``."""

    input_ids: torch.Tensor
    """int64 ``[b, L]``: each sequence's tokens, then ``pad_id`` (right padding)."""
    attention_mask: torch.Tensor
    """int64 ``[b, L]``: 1 on real tokens, 0 on padding."""
    position_ids: torch.Tensor
    """int64 ``[b, L]``: ``arange(L)`` on every row (real tokens start at 0)."""
    indices: torch.Tensor
    """int64 ``[b]``: original batch index of every row."""
    seq_lens: torch.Tensor
    """int64 ``[b]``: real length of every row."""


class _Rows:
    """Real tokens of row ``i`` of a padded batch or a list of sequences, validated."""

    def __init__(self, plan: MicroBatchPlan, input_ids: Any, attention_mask: Any) -> None:
        self.plan = plan
        if isinstance(input_ids, torch.Tensor) and input_ids.ndim == 2:
            mask = (torch.ones_like(input_ids) if attention_mask is None
                    else torch.as_tensor(attention_mask)).to(torch.bool)
            if mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask shape {tuple(mask.shape)} != input_ids shape "
                                 f"{tuple(input_ids.shape)}")
            self.ids, self.mask, self.rows = input_ids, mask, None
            count = input_ids.shape[0]
        elif isinstance(input_ids, Sequence) and not isinstance(input_ids, (str, bytes)):
            if attention_mask is not None:
                raise ValueError("attention_mask is for a padded [B, S] batch, not a list of sequences")
            self.rows = [torch.as_tensor(r) for r in input_ids]
            count = len(self.rows)
        else:
            raise TypeError(f"input_ids must be a [B, S] tensor or a list of 1-D sequences, "
                            f"got {type(input_ids).__name__}")
        if count != plan.num_sequences:
            raise ValueError(f"the batch has {count} sequences, the plan {plan.num_sequences}")

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.rows is not None:
            row = self.rows[i]
            if row.ndim != 1:
                raise ValueError(f"sequence {i} must be 1-D, got shape {tuple(row.shape)}")
        else:
            real = torch.nonzero(self.mask[i]).flatten()
            start = int(real[0]) if real.numel() else 0
            if real.numel() and int(real[-1]) - start + 1 != real.numel():
                raise ValueError(f"row {i} of attention_mask is not one contiguous block")
            row = self.ids[i, start:start + real.numel()]
        if row.numel() != int(self.plan.seq_lens[i]):
            raise ValueError(f"sequence {i} has {row.numel()} real tokens, the plan says {int(self.plan.seq_lens[i])}")
        return row.to(torch.int64)


def _check(plan: MicroBatchPlan, kind: str, dp_rank: int, caller: str) -> None:
    if plan.kind != kind:
        raise ValueError(f"{caller} needs a {kind} plan, got kind={plan.kind!r}")
    if not 0 <= dp_rank < plan.dp_size:
        raise ValueError(f"{dp_rank=} is outside the plan's dp_size={plan.dp_size}")


def apply_dynamic_plan(plan: MicroBatchPlan, input_ids: Any, attention_mask: Any = None, *,
                       dp_rank: int, pad_id: int = 0) -> list[DynamicMicroBatch]:
    """The micro-batches of ``dp_rank`` in run order, each ``[b, L]`` with its own ``L``."""
    _check(plan, "dynamic", dp_rank, "apply_dynamic_plan")
    rows = _Rows(plan, input_ids, attention_mask)
    out = []
    for ix, length in zip(plan.microbatches[dp_rank], plan.padded_lengths[dp_rank]):
        ids = torch.full((ix.size, length), pad_id, dtype=torch.int64)
        mask = torch.zeros((ix.size, length), dtype=torch.int64)
        for k, i in enumerate(ix.tolist()):
            row = rows[i]
            ids[k, :row.numel()] = row
            mask[k, :row.numel()] = 1
        out.append(DynamicMicroBatch(
            input_ids=ids, attention_mask=mask,
            position_ids=torch.arange(length, dtype=torch.int64).expand(ix.size, length).clone(),
            indices=torch.from_numpy(ix.copy()), seq_lens=torch.from_numpy(plan.seq_lens[ix])))
    return out


def apply_packed_plan(plan: MicroBatchPlan, input_ids: Any, attention_mask: Any = None, *,
                      dp_rank: int, loss_mask: Any = None, fixed_shape: bool = True,
                      pad_id: int = 0, ignore_index: int = -100) -> list[PackedBatch]:
    """The micro-batches of ``dp_rank`` as one-pack :class:`PackedBatch` es, in run order (``doc_keys`` ``"seq{i}"``).
    ``fixed_shape=True``: ``T`` = the budget rounded *down* to ``plan.align`` (every packed length fits); ``False``:
    ``T`` = its packed length. ``loss_mask`` (laid out as ``input_ids``) becomes each document's loss mask."""
    _check(plan, "packed", dp_rank, "apply_packed_plan")
    rows = _Rows(plan, input_ids, attention_mask)
    masks = None if loss_mask is None else _Rows(plan, _loss_rows(loss_mask, rows), None)
    fixed = plan.max_tokens_per_microbatch // plan.align * plan.align
    out = []
    for ix, packed_len in zip(plan.microbatches[dp_rank], plan.padded_lengths[dp_rank]):
        docs = [{"input_ids": rows[i], "key": f"seq{i}",
                 **({} if masks is None else {"loss_mask": masks[i]})} for i in ix.tolist()]
        out.append(pack_batch([docs], capacity=fixed if fixed_shape else packed_len,
                              align=plan.align, pad_id=pad_id, ignore_index=ignore_index))
    return out


def _loss_rows(loss_mask: Any, rows: _Rows) -> list[torch.Tensor]:
    """The loss mask cut like ``input_ids`` (same real positions), as a list of rows."""
    if rows.rows is not None:
        return [torch.as_tensor(m) for m in loss_mask]
    lm = torch.as_tensor(loss_mask)
    if lm.shape != rows.ids.shape:
        raise ValueError(f"loss_mask shape {tuple(lm.shape)} != input_ids shape {tuple(rows.ids.shape)}")
    return [lm[i][rows.mask[i]] for i in range(lm.shape[0])]


def restore_order(outputs: Sequence[Sequence[Any]], plan: MicroBatchPlan) -> list[Any]:
    """Per-sequence results of every rank's micro-batches (``outputs[r][j][k]`` for
    ``plan.microbatches[r][j][k]``) back in the original order."""
    if len(outputs) != plan.dp_size:
        raise ValueError(f"outputs has {len(outputs)} ranks, the plan {plan.dp_size}")
    flat: list[Any] = []
    for r, (rank_out, rank_mbs) in enumerate(zip(outputs, plan.microbatches)):
        if len(rank_out) != len(rank_mbs):
            raise ValueError(f"rank {r} has {len(rank_out)} micro-batch outputs, the plan {len(rank_mbs)}")
        for j, (mb_out, ix) in enumerate(zip(rank_out, rank_mbs)):
            if len(mb_out) != ix.size:
                raise ValueError(f"rank {r} micro-batch {j} has {len(mb_out)} rows, the plan {ix.size} sequences")
            flat.extend(mb_out[k] for k in range(ix.size))
    return [flat[p] for p in plan.inverse.tolist()]
