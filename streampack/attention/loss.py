"""Losses and log-probs over a packed batch, normalised the way unpacked training would be.

Only a token mean over the *whole optimizer step* is packing-invariant, so
:func:`packed_cross_entropy` divides the micro-batch's summed loss by ``num_targets`` summed over
the step's micro-batches and ranks (:func:`global_num_targets`); summing the micro-batch losses
then gives the unpacked token mean. ``reduction="sequence"`` averages each document first.

The token mean *is* ``F.cross_entropy(..., reduction="sum") / num_targets``: one kernel, no host
sync (every count is a Python int of the batch); selecting target rows first cost three host syncs
and 6% of a 300M model's step on an H100 (``benchmarks/bench_gpu.py``). A NaN logit row at an
ignored position still gives a NaN gradient; when a kernel may leave padding rows uninitialised
(Transformer Engine ``thd``), pass ``mask_ignored=True`` (one more pass over ``[T, V]``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from numbers import Integral

import torch
import torch.nn.functional as F

from streampack.layout.batch import PackedBatch

REDUCTIONS = ("token", "sequence")


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class LossResult:
    """A micro-batch's loss and the counts it was normalised by."""

    loss: torch.Tensor | None
    """Scalar ``loss_sum / denominator``; ``None`` when the denominator is 0 (nothing in the
    step is supervised): there is no loss to report, and 0.0 would be a lie."""
    loss_sum: torch.Tensor
    """Scalar numerator: summed token losses (``token``) or summed per-document means
    (``sequence``). Connected to the graph even when it is 0."""
    denominator: int
    """``num_targets`` (token) or ``num_sequences`` (sequence) it was divided by."""
    num_targets: int
    """Supervised tokens in this micro-batch."""
    num_sequences: int
    """Documents of this micro-batch with at least one supervised token."""
    reduction: str
    per_token: torch.Tensor | None = None
    """``[T]`` per-position loss (float32, or float64 for float64 logits), 0 where the label is
    ignored; computed with ``per_token=True`` (and always for ``reduction="sequence"``)."""

    @property
    def has_targets(self) -> bool:
        return self.num_targets > 0


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class PaddedDocuments:
    """Per-document rows of a ``[T, ...]`` tensor, right-padded to ``[n, max_len, ...]``."""

    values: torch.Tensor
    """``[n, max_len, ...]``; rows past a document's length hold ``padding_value``."""
    lengths: torch.Tensor
    """int64 ``[n]``: real length of each document."""
    mask: torch.Tensor
    """bool ``[n, max_len]``: True at real rows."""


def _flat(x: torch.Tensor, total: int, what: str) -> torch.Tensor:
    if x.dim() >= 2 and x.shape[0] == 1 and x.shape[1] == total:
        x = x[0]  # HF-style [1, T, ...]
    if x.shape[0] != total:
        raise ValueError(f"{what} has leading shape {tuple(x.shape[:2])}, expected [{total}, ...] or [1, {total}, ...]")
    return x


def unpack_per_document(x: torch.Tensor, batch: PackedBatch) -> list[torch.Tensor]:
    """Split ``x [T, ...]`` (or ``[1, T, ...]``) into each document's own ``[len_i, ...]`` rows,
    dropping padding (views, in document order)."""
    x = _flat(x, batch.total_tokens, "x")
    starts = batch.cu_seqlens_padded[:-1].tolist()
    return [x[s:s + n] for s, n in zip(starts, batch.doc_lengths.tolist())]


def unpack_padded(x: torch.Tensor, batch: PackedBatch, padding_value: float = 0.0) -> PaddedDocuments:
    """Each document's rows of ``x [T, ...]`` as ``[n, max_len, ...]`` (one gather, no loop)."""
    x = _flat(x, batch.total_tokens, "x")
    lengths = batch.doc_lengths.to(torch.int64).cpu()
    max_len = int(lengths.max()) if len(lengths) else 0
    offsets = torch.arange(max_len)
    mask = offsets[None, :] < lengths[:, None]
    index = batch.cu_seqlens_padded[:-1].to("cpu", torch.int64)[:, None] + offsets[None, :]
    index = torch.where(mask, index, 0).to(x.device)
    values = x[index.reshape(-1)].reshape(len(lengths), max_len, *x.shape[1:])
    mask_dev = mask.to(x.device)
    fill = mask_dev.reshape(*mask_dev.shape, *([1] * (x.dim() - 1)))
    values = torch.where(fill, values, torch.full_like(values, padding_value))
    return PaddedDocuments(values=values, lengths=lengths.to(x.device), mask=mask_dev)


def _loss_input(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, *,
                upcast: bool, mask_ignored: bool) -> torch.Tensor:
    """``[N, V]`` logits as the loss reads them: float32 for bf16/fp16 when ``upcast`` (a bf16 log-softmax loses ~3
    digits; HF and torchtitan upcast too), ignored rows zeroed when ``mask_ignored``."""
    if upcast and logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if mask_ignored:
        logits = torch.where((labels != ignore_index).unsqueeze(-1), logits, 0)
    return logits


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, *,
                   upcast: bool = True, mask_ignored: bool = False) -> torch.Tensor:
    """``log p(labels[t] | logits[t])`` for already-shifted labels (``logits [..., V]``, ``labels [...]``); 0 where
    ``labels == ignore_index``. float32 for half-precision logits (with ``upcast``), else their own dtype. No host sync:
    it is ``-F.cross_entropy(..., reduction="none")``."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    flat_labels = labels.reshape(-1).to(logits.device)
    flat = _loss_input(logits.reshape(-1, logits.shape[-1]), flat_labels, ignore_index,
                       upcast=upcast, mask_ignored=mask_ignored)
    nll = F.cross_entropy(flat, flat_labels, ignore_index=ignore_index, reduction="none")
    return (-nll).reshape(labels.shape)


def num_supervised_sequences(batch: PackedBatch) -> int:
    """Documents with at least one label that is not ``ignore_index`` (``batch.num_target_docs``)."""
    return batch.num_target_docs


def _count(value: object, name: str) -> int:
    """A Python int count: a tensor would need ``int(tensor)``, a host sync on a GPU."""
    if isinstance(value, torch.Tensor) or isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be a Python int (global_num_targets / global_num_sequences "
                        f"return one), got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name}={value} must be >= 0")
    return int(value)


def packed_cross_entropy(logits: torch.Tensor, batch: PackedBatch, num_targets: int | None = None, *,
                         reduction: str = "token", num_sequences: int | None = None, per_token: bool = False,
                         upcast: bool = True, mask_ignored: bool = False) -> LossResult:
    """Next-token cross entropy of ``logits [T, V]`` (or ``[1, T, V]``) against ``batch.labels``, with no host sync.
    ``reduction="token"``: ``sum / num_targets`` (pass the step's :func:`global_num_targets`, then *sum* the
    micro-batch losses); ``"sequence"``: each document's mean, summed, over ``num_sequences``
    (:func:`global_num_sequences` for a step). ``per_token=True`` also returns the ``[T]`` losses;
    ``upcast`` computes half-precision logits in float32; ``mask_ignored`` zeroes ignored rows first."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"{reduction=} must be one of {REDUCTIONS}")
    if reduction == "token" and num_sequences is not None:
        raise ValueError("num_sequences only applies to reduction='sequence'")
    if reduction == "sequence" and num_targets is not None:
        raise ValueError("num_targets only applies to reduction='token'")
    logits = _flat(logits, batch.total_tokens, "logits")
    labels = batch.labels.to(logits.device)
    x = _loss_input(logits, labels, batch.ignore_index, upcast=upcast, mask_ignored=mask_ignored)
    if reduction == "token":
        denominator = batch.num_targets if num_targets is None else _count(num_targets, "num_targets")
        token_loss = None
        if per_token:
            token_loss = F.cross_entropy(x, labels, ignore_index=batch.ignore_index, reduction="none")
            loss_sum = token_loss.sum()
        else:
            loss_sum = F.cross_entropy(x, labels, ignore_index=batch.ignore_index, reduction="sum")
    else:
        denominator = (batch.num_target_docs if num_sequences is None
                       else _count(num_sequences, "num_sequences"))
        token_loss = F.cross_entropy(x, labels, ignore_index=batch.ignore_index, reduction="none")
        loss_sum = _sequence_sum(token_loss, labels != batch.ignore_index, batch)
    return LossResult(loss=loss_sum / denominator if denominator > 0 else None, loss_sum=loss_sum,
                      denominator=denominator, num_targets=batch.num_targets, num_sequences=batch.num_target_docs,
                      reduction=reduction, per_token=token_loss)


def _sequence_sum(token_loss: torch.Tensor, keep: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Sum over documents of each document's mean token loss (documents without targets add 0)."""
    docs = batch.seq_idx.to(token_loss.device, torch.int64)
    sums = token_loss.new_zeros(batch.num_docs).index_add(0, docs, token_loss)
    counts = token_loss.new_zeros(batch.num_docs).index_add(0, docs, keep.to(token_loss.dtype))
    return (sums / counts.clamp(min=1)).sum()


def collective_device(group: object | None) -> torch.device:
    """Where a tensor for a collective over ``group`` must live: this GPU under NCCL, else the CPU."""
    import torch.distributed as dist

    nccl = "nccl" in str(dist.get_backend(group))
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def _all_reduce_sum(value: int, group: object | None) -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return int(t.item())


def _local_sum(items: Iterable[PackedBatch | int], count: str) -> int:
    """The ints of ``items`` plus each batch's ``count`` attribute."""
    return sum(item if isinstance(item, int) else int(getattr(item, count)) for item in items)


def global_num_targets(batches: Sequence[PackedBatch | int], group: object | None = None) -> int:
    """Supervised tokens over this rank's micro-batches of a step, summed over ``group``
    (all-reduce) when ``torch.distributed`` is initialized. Pass the data-parallel group; under
    context parallelism count each *unsharded* batch once (CP ranks share its targets)."""
    return _all_reduce_sum(_local_sum(batches, "num_targets"), group)


def global_num_sequences(batches: Sequence[PackedBatch | int], group: object | None = None) -> int:
    """Supervised documents over this rank's micro-batches, summed over ``group``."""
    return _all_reduce_sum(_local_sum(batches, "num_target_docs"), group)
