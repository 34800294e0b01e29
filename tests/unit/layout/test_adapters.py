"""Contract tests of every consumer adapter: dtypes, devices, identities, span layouts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streampack import PackedBatch, pack_batch
from streampack.attention import (
    FlashAttnKwargs,
    HFInputs,
    LocalPackedSeqParams,
    TEKwargs,
    flash_attn_kwargs,
    hf_inputs,
    packed_seq_params,
    ssm_kwargs,
    te_kwargs,
    varlen_cu_seqlens,
)


@st.composite
def layouts(draw: st.DrawFn) -> PackedBatch:
    """Random packs: align in {1,2,4,8}, capacity a multiple of align, some packs exactly full."""
    align = draw(st.sampled_from([1, 2, 4, 8]))
    capacity = align * draw(st.integers(1, 6))
    packs = []
    for _ in range(draw(st.integers(1, 3))):
        room, pack = capacity, []
        while room and (not pack or draw(st.booleans())):
            n = draw(st.integers(1, room))
            pack.append(list(range(1, n + 1)))
            room -= -(-n // align) * align
        packs.append(pack)
    return pack_batch(packs, capacity=capacity, align=align)


def _starts(cu: torch.Tensor) -> set[int]:
    return set(cu[:-1].tolist())


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_flash_attn_spans(batch: PackedBatch) -> None:
    kw = flash_attn_kwargs(batch)
    cu = kw.cu_seqlens_q
    assert cu.dtype == torch.int32 and cu.is_contiguous() and cu.device == batch.input_ids.device
    assert kw.cu_seqlens_k is cu
    assert type(kw.max_seqlen_q) is int and type(kw.max_seqlen_k) is int
    spans = (cu[1:] - cu[:-1]).tolist()
    assert int(cu[0]) == 0 and int(cu[-1]) == batch.total_tokens and min(spans) > 0
    assert kw.max_seqlen_q == max(spans)
    # every document starts a span of exactly its aligned length (padding inside it) ...
    starts = batch.cu_seqlens_padded[:-1].tolist()
    span_of = dict(zip(cu[:-1].tolist(), spans))
    assert [span_of[s] for s in starts] == batch.aligned_lengths.tolist()
    # ... and every other span is a pack's trailing padding, past the real tokens
    extra = _starts(cu) - set(starts)
    real_end = set((batch.cu_seqlens_padded[:-1] + batch.aligned_lengths).tolist())
    assert extra <= real_end
    assert all(bool((batch.labels[s:s + span_of[s]] == batch.ignore_index).all()) for s in extra)
    assert all(bool((batch.input_ids[s:s + span_of[s]] == batch.pad_id).all()) for s in extra)


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_bidirectional_spans_isolate_every_padding_run(batch: PackedBatch) -> None:
    cu = varlen_cu_seqlens(batch, causal=False)
    span_of = dict(zip(cu[:-1].tolist(), (cu[1:] - cu[:-1]).tolist()))
    starts = batch.cu_seqlens_padded[:-1].tolist()
    assert [span_of[s] for s in starts] == batch.doc_lengths.tolist()


def test_flash_attn_worked_example() -> None:
    batch = pack_batch([[[1, 2, 3], [4, 5]]], capacity=8, align=2)
    kw = batch.flash_attn_kwargs()
    assert isinstance(kw, FlashAttnKwargs)
    assert kw.cu_seqlens_q.tolist() == [0, 4, 6, 8] and kw.max_seqlen_q == 4

    def kernel(*, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):  # noqa: ANN001, ANN202
        return max_seqlen_q

    assert kernel(**kw) == 4
    assert set(kw.as_dict()) == {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"}


def test_te_padded_tensors_identity_when_nothing_is_padded() -> None:
    batch = pack_batch([[[1, 2, 3], [4, 5, 6, 7, 8]], [[9] * 8]], capacity=8)
    te = batch.te_kwargs()
    assert isinstance(te, TEKwargs)
    assert te.cu_seqlens_q_padded is te.cu_seqlens_q
    assert te.cu_seqlens_kv_padded is te.cu_seqlens_q and te.cu_seqlens_kv is te.cu_seqlens_q


def test_te_padded_tensors_when_padded() -> None:
    batch = pack_batch([[[1, 2, 3], [4, 5]]], capacity=8, align=2)
    te = te_kwargs(batch)
    assert te.cu_seqlens_q_padded is not te.cu_seqlens_q
    assert te.cu_seqlens_kv_padded is te.cu_seqlens_q_padded and te.cu_seqlens_kv is te.cu_seqlens_q
    assert te.cu_seqlens_q.tolist() == [0, 3, 5] and te.cu_seqlens_q_padded.tolist() == [0, 4, 8]
    for t in (te.cu_seqlens_q, te.cu_seqlens_q_padded):
        assert t.dtype == torch.int32 and t.is_contiguous() and t.device == batch.input_ids.device
    assert type(te.max_seqlen_q) is int and te.max_seqlen_q == te.max_seqlen_kv == 4
    assert te.qkv_format == "thd" and te.attn_mask_type == "padding_causal"
    assert te_kwargs(batch, causal=False).attn_mask_type == "padding"


def test_packed_seq_params_fields() -> None:
    batch = pack_batch([[[1, 2, 3], [4, 5]]], capacity=8, align=2)
    psp = batch.packed_seq_params()
    te = te_kwargs(batch)
    names = ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
             "cu_seqlens_kv_padded", "max_seqlen_q", "max_seqlen_kv")
    for name in names:
        a, b = getattr(psp, name), te[name]
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        assert isinstance(psp, LocalPackedSeqParams)
        assert tuple(psp) == names
    assert packed_seq_params(batch).cu_seqlens_q_padded.tolist() == [0, 4, 8]


def _docs_batch(ignore_index: int = -100) -> tuple[list[dict], PackedBatch]:
    docs = [
        {"input_ids": [11, 12, 13, 14, 15]},
        {"input_ids": [21, 22, 23], "loss_mask": [0, 1, 1]},
        {"input_ids": [31, 32, 33, 34, 35, 36], "loss_mask": [0, 0, 1, 1, 0, 1]},
        {"input_ids": [41]},
    ]
    batch = pack_batch([docs[:2], docs[2:]], capacity=12, align=4, ignore_index=ignore_index)
    return docs, batch


@pytest.mark.parametrize("ignore_index", [-100, -1])
def test_hf_labels_unshifted_with_ignore_at_doc_starts(ignore_index: int) -> None:
    docs, batch = _docs_batch(ignore_index)
    h = batch.hf_inputs()
    assert isinstance(h, HFInputs)
    T = batch.total_tokens
    for name in ("input_ids", "position_ids", "labels", "seq_idx"):
        assert getattr(h, name).shape == (1, T), name
    labels = h.labels[0]
    assert labels.dtype == torch.int64
    for start in batch.cu_seqlens_padded[:-1].tolist():
        assert int(labels[start]) == -100, f"label at document start {start}"
    for doc, start in zip(docs, batch.cu_seqlens_padded[:-1].tolist()):
        ids = doc["input_ids"]
        mask = doc.get("loss_mask", [1] * len(ids))
        want = [-100] + [t if m else -100 for t, m in zip(ids[1:], mask[1:])]
        assert labels[start:start + len(ids)].tolist() == want
    real = torch.zeros(T, dtype=torch.bool)
    for s, n in zip(batch.cu_seqlens_padded[:-1].tolist(), batch.doc_lengths.tolist()):
        real[s:s + n] = True
    assert bool((labels[~real] == -100).all()), "padding carries a label"
    # HF's loss shifts left by one: that must give back the PackedBatch's own targets
    shifted = torch.cat([labels[1:], torch.tensor([-100])])
    packed = torch.where(batch.labels == ignore_index, -100, batch.labels)
    assert torch.equal(shifted, packed)
    assert int((labels != -100).sum()) == batch.num_targets


def test_hf_spans_positions_and_seq_idx_agree() -> None:
    _, batch = _docs_batch()
    h = hf_inputs(batch)
    cu = h.cu_seq_lens_q
    assert cu.dtype == torch.int32 and h.cu_seq_lens_k is cu
    assert torch.equal(cu, flash_attn_kwargs(batch).cu_seqlens_q)
    assert type(h.max_length_q) is int and h.max_length_q == h.max_length_k == int((cu[1:] - cu[:-1]).max())
    pos, seq = h.position_ids[0], h.seq_idx[0]
    assert seq.dtype == torch.int32
    assert set(torch.nonzero(pos == 0).squeeze(-1).tolist()) == _starts(cu)
    changes = set((torch.nonzero(seq[1:] != seq[:-1]).squeeze(-1) + 1).tolist())
    assert changes == _starts(cu) - {0}
    assert bool((seq[1:] >= seq[:-1]).all())
    assert h.use_cache is False and h["use_cache"] is False
    assert torch.equal(h.input_ids[0], batch.input_ids)


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_seq_idx_resets_exactly_at_cu_seqlens(batch: PackedBatch) -> None:
    seq = ssm_kwargs(batch).seq_idx
    assert seq.shape == (1, batch.total_tokens) and seq.dtype == torch.int32
    seq = seq[0]
    changes = (torch.nonzero(seq[1:] != seq[:-1]).squeeze(-1) + 1).tolist()
    assert changes == batch.cu_seqlens_padded[1:-1].tolist()
    assert seq[0] == 0 and seq[-1] == batch.num_docs - 1
    for i, (s, n) in enumerate(zip(batch.cu_seqlens_padded[:-1].tolist(),
                                   batch.doc_lengths.tolist())):
        assert bool((seq[s:s + n] == i).all())


def test_records_are_mappings_with_fixed_keys() -> None:
    _, batch = _docs_batch()
    for record in (flash_attn_kwargs(batch), te_kwargs(batch), hf_inputs(batch), ssm_kwargs(batch)):
        d = record.as_dict()
        assert list(record) == list(d) == [f.name for f in dataclasses.fields(record)]
        assert len(record) == len(d) and dict(**record).keys() == d.keys()
        with pytest.raises(KeyError):
            record["nope"]


def test_records_rebuild_like_dicts_and_move_with_shared_tensors() -> None:
    """Frameworks rebuild mappings as ``type(m)({...})`` (HF Trainer, accelerate, Lightning);
    the keyword-only records used to raise TypeError there."""
    _, batch = _docs_batch()
    for record in (flash_attn_kwargs(batch), te_kwargs(batch), hf_inputs(batch), ssm_kwargs(batch)):
        rebuilt = type(record)({k: v for k, v in record.items()})
        assert type(rebuilt) is type(record) and list(rebuilt) == list(record)
        moved = record.to("meta")
        assert type(moved) is type(record)
        assert all(v.device.type == "meta" for v in moved.values() if isinstance(v, torch.Tensor))
    kw = flash_attn_kwargs(batch).to("meta")
    assert kw.cu_seqlens_k is kw.cu_seqlens_q  # moved once, still one tensor
    h = hf_inputs(batch)
    assert type(h)(h, use_cache=True).use_cache is True and h.use_cache is False
    with pytest.raises(TypeError, match="needs 'cu_seqlens_k'"):
        FlashAttnKwargs(cu_seqlens_q=kw.cu_seqlens_q, max_seqlen_q=1, max_seqlen_k=1)
    with pytest.raises(TypeError, match="no field"):
        FlashAttnKwargs({**kw, "window_size": (-1, 0)})
