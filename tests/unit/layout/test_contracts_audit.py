"""Regression tests from a contract audit of pack_batch, the adapters, CP, the leak probe,
the overlong policy and the RL apply path. Each test names the silent failure it pins down."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streampack import (
    Sample,
    apply_overlong,
    check_invariants,
    cp_shard,
    cp_unshard,
    pack_batch,
)
from streampack.attention import (
    hf_inputs,
    hf_labels,
    leak_probe,
    packed_cross_entropy,
    te_kwargs,
)
from streampack.rl import apply_packed_plan, plan_packed_microbatches

# --- pack_batch: per-token fields must match their document, never broadcast --------------

def test_labels_shorter_than_tokens_is_an_error_not_a_broadcast():
    # Before: labels [1, 2] for 3 tokens broadcast into [2, 2] as silent wrong targets.
    with pytest.raises(ValueError, match="labels of document 'pack0/doc0' have 2 entries for 3"):
        pack_batch([[{"input_ids": [1, 2, 3], "labels": [1, 2]}]], capacity=4)


@pytest.mark.parametrize("mask", [[1, 1], [1, 1, 1, 1]])
def test_loss_mask_length_mismatch_names_the_document(mask):
    with pytest.raises(ValueError, match="loss_mask of document 'k' has"):
        pack_batch([[{"input_ids": [1, 2, 3], "loss_mask": mask, "key": "k"}]], capacity=4)


def test_sample_fields_are_validated_too():
    bad = Sample(key="s", tokens=np.array([1, 2, 3]), labels=np.array([1, 2]))
    with pytest.raises(ValueError, match="labels of document 's'"):
        pack_batch([[bad]], capacity=4)
    # a Sample built from plain lists packs like an array one
    batch = pack_batch([[Sample(key="s", tokens=[4, 5, 6])]], capacity=4)
    assert batch.input_ids.tolist() == [4, 5, 6, 0]


@pytest.mark.parametrize("other", [np.ones((1, 1)), np.ones((3,))])
def test_extras_with_different_trailing_shapes_are_refused(other):
    # Before: [1, 1] broadcast into [1, 3]; [3] (L == 3 by chance) broadcast into [3, 3].
    docs = [{"input_ids": [1, 2, 3], "x": np.arange(9.0).reshape(3, 3)},
            {"input_ids": [7] * len(other), "x": other}]
    with pytest.raises(ValueError, match="extra 'x' of document 'pack0/doc1' has per-token shape"):
        pack_batch([docs], capacity=8)


def test_extras_dtype_holds_every_document():
    # Before: the first document's int64 dtype truncated another document's 0.5 to 0.
    docs = [{"input_ids": [1, 2], "x": np.array([1, 2], dtype=np.int64)},
            {"input_ids": [3], "x": np.array([0.5], dtype=np.float32)}]
    batch = pack_batch([docs], capacity=4)
    assert batch.extras["x"].dtype == torch.float64
    assert batch.extras["x"].tolist() == [1.0, 2.0, 0.5, 0.0]


def test_bfloat16_extras_pack():
    x = torch.tensor([[0.5, 1.5], [2.0, -3.0]], dtype=torch.bfloat16)
    batch = pack_batch([[{"input_ids": [1, 2], "x": x}]], capacity=4)
    assert torch.equal(batch.extras["x"][:2], x.float())
    assert batch.extras["x"][2:].abs().sum() == 0


def test_scalar_extra_is_a_clear_error():
    with pytest.raises(ValueError, match="must be per-token"):
        pack_batch([[{"input_ids": [1, 2], "x": 5}]], capacity=4)


# --- token ids: every integer dtype, never a silent cast ----------------------------------

@pytest.mark.parametrize("tokens", [
    np.array([1, 2, 65535], dtype=np.uint16), np.array([1, 2, 3], dtype=np.int32),
    torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([1, 2, 3], dtype=torch.uint16),
    np.array([1.0, 2.0, 3.0]),
])
def test_integer_token_dtypes(tokens):
    # Before: uint16/uint8 ids (compact shards) with a loss mask wrapped ignore_index -100 to
    # 65436 at masked positions, which then counted as supervised targets.
    mask = torch.tensor([True, False, True])
    batch = pack_batch([[{"input_ids": tokens, "loss_mask": mask.to(torch.uint8)}]], capacity=4)
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    assert batch.input_ids.dtype == torch.int32 and batch.input_ids[:3].tolist() == ids.tolist()
    assert batch.labels.tolist() == [-100, int(ids[2]), -100, -100]
    check_invariants(batch, [ids.tolist()])


def test_non_integral_or_overflowing_ids_are_refused():
    with pytest.raises(ValueError, match="must be integer ids"):
        pack_batch([[np.array([1.5, 2.0])]], capacity=4)  # before: packed as [1, 2]
    with pytest.raises(ValueError, match="past int64"):
        pack_batch([[np.array([2**63], dtype=np.uint64)]], capacity=4)  # before: wrapped negative


def test_capacity_must_be_a_real_positive_int():
    with pytest.raises(ValueError, match="capacity=True"):
        pack_batch([[[1]]], capacity=True)
    assert pack_batch([[[1]]], capacity=np.int64(4)).capacity == 4


# --- labels: -100 means "not supervised" whatever ignore_index is ------------------------

def test_hf_ignore_in_sample_labels_with_non_default_ignore_index():
    # Before: with ignore_index=-1, a -100 label counted as a target (num_targets too large,
    # and cross entropy indexing class -100).
    doc = {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}
    batch = pack_batch([[doc, [9, 10]]], capacity=8, align=2, ignore_index=-1)
    assert batch.labels.tolist() == [-1, 7, 8, -1, 10, -1, -1, -1]
    assert batch.num_targets == 3
    check_invariants(batch)
    hf = hf_labels(batch)
    assert hf.tolist() == [-100, -100, 7, 8, -100, 10, -100, -100]
    assert int((hf != -100).sum()) == batch.num_targets
    logits = torch.randn(batch.total_tokens, 16)
    res = packed_cross_entropy(logits, batch)
    ref = torch.nn.functional.cross_entropy(logits[:-1], hf[1:], ignore_index=-100)
    assert torch.allclose(res.loss, ref)


def test_other_negative_labels_are_refused():
    with pytest.raises(ValueError, match="hold -5"):
        pack_batch([[{"input_ids": [1, 2, 3], "labels": [1, -5, 3]}]], capacity=4)


# --- adapters / CP on multi-pack batches ------------------------------------------------

def test_te_padded_identity_and_hf_positions_on_multi_pack_batches():
    # pack 0 ends in trailing pack padding: that IS padding between documents for TE.
    batch = pack_batch([[[1, 2, 3], [4, 5]], [list(range(6, 14))]], capacity=8)
    te = te_kwargs(batch)
    assert te.cu_seqlens_q_padded is not te.cu_seqlens_q
    assert te.cu_seqlens_q_padded.tolist() == [0, 3, 8, 16]
    full = pack_batch([[[1, 2, 3], [4, 5, 6, 7, 8]], [list(range(6, 14))]], capacity=8)
    te_full = te_kwargs(full)
    assert te_full.cu_seqlens_q_padded is te_full.cu_seqlens_q  # nothing padded: same object
    for b in (batch, full, pack_batch([[[1, 2, 3], [4]], [[5, 6, 7]]], capacity=8, align=4)):
        hf = hf_inputs(b)
        pos = hf.position_ids[0]
        starts = torch.nonzero(pos == 0).flatten().tolist() + [b.total_tokens]
        assert starts == hf.cu_seq_lens_q.tolist()  # what HF re-derives from position_ids
        assert hf.max_length_q == max(e - s for s, e in zip(starts, starts[1:]))


def test_cp_multi_pack_extras_round_trip_and_targets():
    docs0 = [{"input_ids": [1, 2, 3], "x": np.arange(6.0).reshape(3, 2)},
             {"input_ids": [4, 5, 6, 7, 8], "x": np.arange(10.0).reshape(5, 2)}]
    docs1 = [{"input_ids": list(range(9)), "x": np.ones((9, 2))}]
    batch = pack_batch([docs0, docs1], capacity=16, align=8)
    parts = [cp_shard(batch, 4, r) for r in range(4)]
    back = cp_unshard([p.extras["x"] for p in parts], batch.cu_seqlens_padded)
    assert torch.equal(back, batch.extras["x"])
    assert sum(p.num_targets_local for p in parts) == batch.num_targets
    torch.manual_seed(0)
    logits = torch.randn(batch.total_tokens, 12, dtype=torch.float64)
    full = packed_cross_entropy(logits, batch).loss
    ranks = sum(torch.nn.functional.cross_entropy(logits[p.indices], p.labels, reduction="sum")
                for p in parts) / batch.num_targets
    assert torch.allclose(full, ranks)


# --- leak probe: NaN is a change, not "no change" ------------------------------------------

def test_leak_probe_sees_nan_crossing_a_boundary():
    batch = pack_batch([[[1, 2, 3], [4, 5, 6]]], capacity=8)

    def leaky(b):  # document 1's outputs become NaN when document 0 changes
        out = b.input_ids.double().unsqueeze(-1)
        if int(b.input_ids[0]) != 1:
            out = out.clone()
            out[3:6] = float("nan")
        return out

    report = leak_probe(leaky, batch, vocab_size=100, doc=0)
    assert report.leaked and report.max_diff_other_docs == float("inf")

    def nan_both(b):  # a NaN present in both runs at the same place is not a change
        out = b.input_ids.double().unsqueeze(-1).clone()
        out[4] = float("nan")
        return out

    assert not leak_probe(nan_both, batch, vocab_size=100, doc=0).leaked


# --- overlong -------------------------------------------------------------------------

@pytest.mark.parametrize("max_len", [0, -1, True])
def test_overlong_refuses_a_non_positive_max_len(max_len):
    with pytest.raises(ValueError, match="max_len"):
        apply_overlong(Sample(key="a", tokens=np.arange(5)), max_len, "split")


# --- RL: packed plan applied to a left/right padded batch with a response mask ------------

def test_apply_packed_plan_aligned_left_padded_with_loss_mask():
    lens = np.array([3, 1, 5, 2, 4, 6, 2, 3])
    B, S = len(lens), 8
    ids = torch.zeros(B, S, dtype=torch.long)
    am = torch.zeros_like(ids)
    lm = torch.zeros_like(ids)
    for i, n in enumerate(lens.tolist()):
        s = S - n if i % 2 else 0  # odd rows left padded
        ids[i, s:s + n] = torch.arange(1, n + 1) + 10 * i
        am[i, s:s + n] = 1
        lm[i, s + n - 1] = 1
    plan = plan_packed_microbatches(lens, dp_size=2, max_tokens_per_microbatch=12, align=4)
    seen = []
    for r in range(2):
        for b, ix in zip(apply_packed_plan(plan, ids, am, dp_rank=r, loss_mask=lm),
                         plan.microbatches[r]):
            docs = [ids[i][am[i].bool()].tolist() for i in ix.tolist()]
            check_invariants(b, docs)
            assert b.total_tokens == 12 and b.doc_keys == tuple(f"seq{i}" for i in ix.tolist())
            # only each sequence's last token is supervised, predicted from the one before it
            want = sum(1 for i in ix.tolist() if lens[i] > 1)
            assert b.num_targets == want
            seen += ix.tolist()
    assert sorted(seen) == list(range(B))
