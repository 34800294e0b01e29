"""PackedBatch layout: DESIGN.md's invariants over random inputs, and every input error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streampack import PackedBatch, Sample, alignment, check_invariants, pack_batch


@st.composite
def packs_strategy(draw):
    align = draw(st.sampled_from([1, 2, 4, 8]))
    capacity = align * draw(st.integers(1, 12))
    n_packs = draw(st.integers(1, 3))
    packs = []
    for _ in range(n_packs):
        room = capacity
        pack = []
        while room >= 1 and (not pack or draw(st.booleans())):
            n = draw(st.integers(1, room))
            span = -(-n // align) * align
            if span > room:
                break
            pack.append(draw(st.lists(st.integers(1, 1000), min_size=n, max_size=n)))
            room -= span
        if not pack:
            pack = [[7]]
        packs.append(pack)
    return packs, capacity, align


@given(packs_strategy())
@settings(max_examples=200, deadline=None)
def test_invariants_over_random_layouts(case):
    packs, capacity, align = case
    batch = pack_batch(packs, capacity=capacity, align=align)
    docs = [d for pack in packs for d in pack]
    check_invariants(batch, docs)
    assert batch.num_docs == len(docs)
    assert batch.total_tokens == len(packs) * capacity
    assert batch.num_tokens == sum(map(len, docs))
    # Every real token but each document's last one has its successor as its label.
    assert batch.num_targets == sum(len(d) - 1 for d in docs)


def test_worked_example_from_module_docstring():
    b = pack_batch([[[11, 12, 13], [21, 22]]], capacity=8, align=2)
    assert b.input_ids.tolist() == [11, 12, 13, 0, 21, 22, 0, 0]
    assert b.labels.tolist() == [12, 13, -100, -100, 22, -100, -100, -100]
    assert b.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert b.cu_seqlens.tolist() == [0, 3, 5]
    assert b.cu_seqlens_padded.tolist() == [0, 4, 8]
    assert b.max_seqlen == 4 and b.num_tokens == 5 and b.num_targets == 3
    assert b.seq_idx.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert b.aligned_lengths.tolist() == [4, 2]


def test_multiple_packs_keep_documents_inside_their_pack():
    b = pack_batch([[[1, 2, 3]], [[4], [5, 6]]], capacity=4)
    assert b.cu_seqlens_padded.tolist() == [0, 4, 5, 8]
    assert b.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert b.position_ids.tolist() == [0, 1, 2, 3, 0, 0, 1, 2]


def test_loss_mask_and_own_labels_survive_packing():
    # assistant-only loss (trl#3728): masked tokens are never targets, count is conserved
    doc = Sample(key="chat", tokens=np.array([1, 2, 3, 4, 5]),
                 loss_mask=np.array([0, 0, 1, 1, 1], dtype=bool))
    own = {"input_ids": [7, 8, 9], "labels": [-100, 80, 90]}
    b = pack_batch([[doc, own]], capacity=8)
    assert b.labels.tolist() == [-100, 3, 4, 5, -100, 80, 90, -100]
    assert b.num_targets == 3 + 2


def test_extras_with_trailing_dims_follow_the_layout():
    mrope = np.arange(3 * 3).reshape(3, 3)
    b = pack_batch([[{"input_ids": [1, 2, 3], "mrope": mrope},
                     {"input_ids": [4], "mrope": np.full((1, 3), 9)}]], capacity=8, align=2)
    assert b.extras["mrope"].shape == (8, 3)
    assert b.extras["mrope"][:3].tolist() == mrope.tolist()
    assert b.extras["mrope"][4].tolist() == [9, 9, 9]
    assert int(b.extras["mrope"][3].abs().sum()) == 0


@pytest.mark.parametrize(
    "kwargs, packs, match",
    [
        (dict(capacity=10, align=4), [[[1]]], "capacity=10 must be a multiple of align=4"),
        (dict(capacity=8, align=4), [[[1] * 6, [1] * 3]], "pack 0 holds 12 tokens"),
        (dict(capacity=8, align=4), [[[1] * 9]], "length 9 needs 12 tokens"),
        (dict(capacity=8), [[[]]], "zero length"),
        (dict(capacity=8), [[]], "pack 0 is empty"),
        (dict(capacity=8), [], "at least one pack"),
        (dict(capacity=0), [[[1]]], "capacity=0"),
        (dict(capacity=8), [[{"tokens": [1], "x": [1]}, {"tokens": [2]}]], "extras"),
        (dict(capacity=2**30), [[[1]]] * 2, "overflows the int32"),  # fa#2611
    ],
)
def test_bad_layouts_are_refused_with_the_values(kwargs, packs, match):
    with pytest.raises(ValueError, match=match):
        pack_batch(packs, **kwargs)


def test_alignment_rules():
    assert alignment() == 1
    assert alignment(cp_size=2) == 4
    assert alignment(cp_size=2, tp_size=2) == 8
    assert alignment(tp_size=4) == 4
    assert alignment(tp_size=4, sequence_parallel=False) == 1
    assert alignment(cp_size=2, multiple=16) == 16
    assert alignment(tp_size=3, multiple=8) == 24
    with pytest.raises(ValueError, match="cp_size=0"):
        alignment(cp_size=0)


def test_capacity_power_of_two_plus_one_and_exact_fit():
    # trl#3887: odd capacities; a document exactly equal to the capacity (PaiMP#663)
    for capacity in (2**12 - 1, 2**12 + 1, 8192 * 2 + 1):
        b = pack_batch([[list(range(1, capacity + 1))], [[5, 6]]], capacity=capacity)
        check_invariants(b)
        assert b.cu_seqlens.tolist() == [0, capacity, capacity + 2]


def test_to_and_pin_memory_keep_every_field():
    b = pack_batch([[{"input_ids": [1, 2], "x": np.ones((2, 2), dtype=np.float32)}]], capacity=4)
    moved = b.to("cpu", non_blocking=True)
    assert isinstance(moved, PackedBatch)
    assert torch.equal(moved.input_ids, b.input_ids) and moved.doc_keys == b.doc_keys
    assert moved.extras["x"].shape == (4, 2)
    if torch.cuda.is_available():  # pragma: no cover - GPU only
        assert b.pin_memory().input_ids.is_pinned()


def test_check_invariants_catches_a_corrupted_batch():
    from dataclasses import replace

    b = pack_batch([[[1, 2, 3], [4, 5]]], capacity=6)
    leaked = b.labels.clone()
    leaked[2] = 4  # last token of doc 0 predicting doc 1's first token (titan#4075)
    # labels are derived: a broken derivation is what could leak, so corrupt the cache it fills
    b._derived = replace(b._derived, labels=leaked)
    b.num_targets += 1
    with pytest.raises(AssertionError, match="crosses the boundary"):
        check_invariants(b)
