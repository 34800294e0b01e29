"""A batch on the device plus any adapter or loss call never synchronises the host with it.

On CPU two detectors stand in for a GPU. The batch is moved to the ``meta`` device, which has
no data: every op that needs values on the host (``item``/``int``/``tolist``, ``nonzero``,
boolean-mask indexing, ``unique``, ``equal``, ``repeat_interleave`` without ``output_size``,
device-to-host copies) raises there. A dispatch mode records, by name, the ops that synchronise
on CUDA, and host-to-device copies (blocking ones synchronise the stream). On a GPU the same
calls run under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import helpers_layouts as layouts
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from streampack import PackedBatch, pack_batch
from streampack.attention import (
    global_num_sequences,
    global_num_targets,
    hf_labels,
    packed_cross_entropy,
    ssm_kwargs,
    token_logprobs,
    varlen_cu_seqlens,
)

aten = torch.ops.aten
SYNCING = {aten._local_scalar_dense, aten.nonzero, aten._unique, aten._unique2, aten.unique_dim,
           aten.unique_consecutive, aten.equal, aten.is_nonzero, aten.masked_select,
           aten.bincount, aten.histc, aten.allclose}
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
COPIES = {aten._to_copy, aten.copy_}


def _device(x: Any) -> torch.device | None:
    return x.device if isinstance(x, torch.Tensor) else None


class SyncRecorder(TorchDispatchMode):
    """Records ops that synchronise the host with a CUDA device (or would, on one)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in SYNCING:
            self.calls.append(str(func))
        elif packet in INDEXING:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                   for i in indices):
                self.calls.append(f"{func} with a boolean mask (nonzero inside)")
        elif (packet is aten.repeat_interleave and func is not aten.repeat_interleave.self_int
              and kwargs.get("output_size") is None):
            self.calls.append(f"{func} without output_size")  # sizes its output on the host
        out = func(*args, **kwargs)
        if packet in COPIES:
            source = _device(args[1] if packet is aten.copy_ else args[0])
            target = _device(args[0] if packet is aten.copy_ else out)
            if source is not None and target is not None and source != target:
                self.calls.append(f"{func} {source.type} -> {target.type}")
        return out


def record(fn: Callable[[], Any]) -> list[str]:
    with SyncRecorder() as rec:
        fn()
    return rec.calls


def exercise(batch: PackedBatch, vocab: int = 128) -> None:
    """Every adapter and loss path, forward and backward, as a training step calls them."""
    for causal in (True, False):
        kw = batch.flash_attn_kwargs(causal=causal)
        assert kw.cu_seqlens_q.device == batch.input_ids.device
        te = batch.te_kwargs(causal=causal)
        assert (te.cu_seqlens_q_padded is te.cu_seqlens_q) == (not batch.has_padding)
        varlen_cu_seqlens(batch, causal=causal)
    batch.packed_seq_params()
    h = batch.hf_inputs()
    assert h.position_ids.shape == h.seq_idx.shape == (1, batch.total_tokens)
    hf_labels(batch)
    ssm_kwargs(batch)
    batch.seq_idx, batch.doc_lengths, batch.aligned_lengths, batch.fill  # noqa: B018
    device = batch.input_ids.device
    n = global_num_targets([batch, batch])
    global_num_sequences([batch])
    logits = torch.randn(batch.total_tokens, vocab, device=device, requires_grad=True)
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        for res in (packed_cross_entropy(x, batch, num_targets=n),
                    packed_cross_entropy(x[None], batch, per_token=True, mask_ignored=True),
                    packed_cross_entropy(x, batch, reduction="sequence"),
                    packed_cross_entropy(x, batch, upcast=False)):
            if res.loss is not None:
                res.loss.backward()
        token_logprobs(x, batch.labels, batch.ignore_index).sum().backward()


BATCHES = {
    "align1": lambda: layouts.random_batch(0, capacity=32, align=1),
    "align4": lambda: layouts.random_batch(1, capacity=32, align=4),
    "align8_full": lambda: pack_batch([[[1] * 16], [[2] * 8, [3] * 8]], capacity=16, align=8),
    "loss_mask": lambda: pack_batch([[{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]},
                                      {"input_ids": [5, 6], "loss_mask": [0, 0]}]],
                                    capacity=8, align=2),
    "no_targets": lambda: pack_batch([[{"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}]],
                                     capacity=4),
    # explicit labels: stored as int32 target_ids, the labels derived from them on the device
    "labels": lambda: pack_batch([[{"input_ids": [1, 2, 3, 4], "labels": [-100, 7, 8, -100]}, [5, 6]]],
                                 capacity=8, align=2),
}


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_adapters_and_losses_run_on_the_meta_device(name: str) -> None:
    """No data on the device means no value can be read back: nothing here may sync."""
    batch = BATCHES[name]().to("meta")
    calls = record(lambda: exercise(batch))
    assert calls == []


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_recorder_sees_no_syncing_op_on_cpu(name: str) -> None:
    """The same calls on CPU tensors issue no op that would synchronise on CUDA."""
    batch = BATCHES[name]()
    assert record(lambda: exercise(batch)) == []


def test_the_detectors_catch_the_old_syncs() -> None:
    """Guard against a vacuous pass: each pattern the old adapters and loss used is caught."""
    batch = layouts.random_batch(2, capacity=16, align=4)
    logits = torch.randn(batch.total_tokens, 5)
    keep = batch.labels != batch.ignore_index
    old = {
        "torch.unique of span offsets": lambda: torch.unique(batch.cu_seqlens_padded),
        "int(keep.sum())": lambda: int(keep.sum()),
        "boolean gather of [T, V] logits": lambda: logits[keep],
        "index_put with keep.nonzero()": lambda: torch.zeros(batch.total_tokens).index_put(
            (keep.nonzero().squeeze(-1),), torch.ones(int(keep.sum()))),
        "bincount": lambda: torch.bincount(batch.seq_idx.long()),
        "repeat_interleave without output_size": lambda: torch.repeat_interleave(
            torch.arange(batch.num_docs), (batch.cu_seqlens_padded[1:] - batch.cu_seqlens_padded[:-1]).long()),
        "torch.equal": lambda: torch.equal(batch.cu_seqlens, batch.cu_seqlens_padded),
    }
    meta = batch.to("meta")
    for what, fn in old.items():
        assert record(fn), f"the recorder missed {what}"
    with pytest.raises((RuntimeError, NotImplementedError)):
        meta.cu_seqlens.tolist()
    with pytest.raises((RuntimeError, NotImplementedError)):
        torch.unique(meta.cu_seqlens_padded)
    cpu_to_meta = record(lambda: torch.arange(3).to("meta"))
    assert cpu_to_meta and "cpu -> meta" in cpu_to_meta[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(BATCHES))
def test_no_sync_on_a_real_gpu(name: str) -> None:
    batch = BATCHES[name]().pin_memory().to("cuda", non_blocking=True)
    exercise(batch)  # warm-up: allocator growth and lazy module loads are not per-step costs
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        exercise(batch)
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(BATCHES))
def test_deriving_labels_and_positions_does_not_sync_on_a_real_gpu(name: str) -> None:
    """``exercise`` derives once and then reads the cache: derive again, from scratch, under the sync check."""
    from streampack.layout.derive import derive

    batch = BATCHES[name]().pin_memory().to("cuda", non_blocking=True)
    stored = (batch.input_ids, batch.cu_seqlens, batch.cu_seqlens_padded, batch.loss_mask, batch.target_ids,
              batch.ignore_index)
    derive(*stored)  # warm-up
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = derive(*stored)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert torch.equal(got.labels.cpu(), BATCHES[name]().labels)
