"""Planning on lengths: the seeds' worked examples exactly, then invariants (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streampack.rl import MicroBatchPlan, plan_dynamic_batches, plan_packed_microbatches

ROLL_LENS = [7, 6, 8, 5, 1, 3, 8, 6]  # seed 003: attention_mask.sum(-1)
NEMO_LENS = [2, 4, 7, 6, 3, 4]  # seed 000: rows 0..5 of the input batch


def contents(plan: MicroBatchPlan) -> list[list[list[int]]]:
    return [[ix.tolist() for ix in rank] for rank in plan.microbatches]


def test_roll_worked_example_exactly():
    plan = plan_dynamic_batches(ROLL_LENS, dp_size=2, max_tokens_per_microbatch=10,
                                sequence_length_round=2, round_before_budget=False)
    lens = np.array(ROLL_LENS)
    assert [[lens[ix].tolist() for ix in r] for r in plan.microbatches] == [
        [[1, 5], [6], [8]], [[3, 6], [7], [8]]]
    assert contents(plan) == [[[4, 3], [7], [2]], [[5, 1], [0], [6]]]
    assert plan.padded_lengths == ((6, 8, 8), (6, 8, 8))
    assert plan.padded_tokens == 56  # "reduced to 56" from 8 * 10 = 80


def test_roll_pp_split_exactly():
    plan = plan_dynamic_batches(ROLL_LENS, dp_size=2, max_tokens_per_microbatch=10,
                                sequence_length_round=2, round_before_budget=False, pp_size=2)
    assert contents(plan) == [[[4], [3], [7], [2]], [[5], [1], [0], [6]]]
    assert plan.padded_lengths == ((6, 6, 8, 8), (6, 6, 8, 8))  # split keeps the length


def test_roll_example_under_hard_cap_stays_within_budget():
    plan = plan_dynamic_batches(ROLL_LENS, dp_size=2, max_tokens_per_microbatch=10,
                                sequence_length_round=2, pp_size=2)
    assert max(max(r) for r in plan.padded_sizes) <= 10
    assert plan.num_microbatches % 2 == 0


@pytest.mark.parametrize("round_before_budget", [True, False])
def test_nemo_diagram_mbs16_exactly(round_before_budget):
    plan = plan_dynamic_batches(NEMO_LENS, dp_size=1, max_tokens_per_microbatch=16,
                                sequence_length_round=1, round_before_budget=round_before_budget)
    groups = sorted(sorted(g) for g in contents(plan)[0])
    assert groups == [[0, 1, 4, 5], [2, 3]]  # MBS 0: rows 2, 3; MBS 1: rows 1, 5, 4, 0
    if round_before_budget:  # longest first also gives the diagram's order (ROLL: shortest)
        assert contents(plan) == [[[2, 3], [1, 5, 4, 0]]]
        assert plan.padded_lengths == ((7, 4),)
        assert plan.padded_sizes == ((14, 16),)


def test_overlong_is_refused_with_index_and_length():
    with pytest.raises(ValueError, match=r"sequence 2 of length 11"):
        plan_dynamic_batches([3, 4, 11], dp_size=1, max_tokens_per_microbatch=10,
                             sequence_length_round=1)
    with pytest.raises(ValueError, match=r"sequence 0 of length 9 needs 12"):
        plan_packed_microbatches([9, 1], dp_size=1, max_tokens_per_microbatch=10, align=4)


def test_overlong_allowed_gets_its_own_microbatch():
    plan = plan_dynamic_batches([3, 11, 4], dp_size=1, max_tokens_per_microbatch=10,
                                sequence_length_round=1, allow_overlong=True)
    assert [1] in contents(plan)[0]


def test_too_few_sequences_is_a_clear_error():
    with pytest.raises(ValueError, match="non-empty micro-batches"):
        plan_dynamic_batches([5, 5, 5], dp_size=2, max_tokens_per_microbatch=100,
                             sequence_length_round=1, pp_size=2)
    with pytest.raises(ValueError, match="non-empty micro-batches"):
        plan_packed_microbatches([5], dp_size=2, max_tokens_per_microbatch=100)


def test_bad_arguments():
    with pytest.raises(ValueError, match="dp_size=0"):
        plan_dynamic_batches([1], dp_size=0, max_tokens_per_microbatch=4, sequence_length_round=1)
    with pytest.raises(ValueError, match="sequence 1 has length 0"):
        plan_packed_microbatches([1, 0], dp_size=1, max_tokens_per_microbatch=4)


def test_chunks_keep_training_order():
    lens = [1, 9, 2, 8, 7, 3, 6, 4]
    plan = plan_dynamic_batches(lens, dp_size=2, max_tokens_per_microbatch=32,
                                sequence_length_round=1, chunk_size=4)
    for rank in plan.microbatches:  # every micro-batch lies inside one chunk, chunks in order
        chunk_of = [set((ix // 4).tolist()) for ix in rank]
        assert all(len(c) == 1 for c in chunk_of)
        assert [c.pop() for c in chunk_of] == sorted(min(ix // 4) for ix in rank)


def check_plan(plan: MicroBatchPlan, n: int, pp_size: int = 1) -> None:
    seen = np.concatenate([ix for rank in plan.microbatches for ix in rank])
    assert np.array_equal(np.sort(seen), np.arange(n))  # each sequence exactly once
    counts = {len(rank) for rank in plan.microbatches}
    assert len(counts) == 1 and counts.pop() % pp_size == 0
    assert all(ix.size > 0 for rank in plan.microbatches for ix in rank)
    for rank, lens in zip(plan.microbatches, plan.padded_lengths):
        for ix, length in zip(rank, lens):
            assert length >= plan.seq_lens[ix].max()
            assert length % plan.align == 0 or plan.kind == "packed"
    values = [np.full(ix.size, 0) + ix for rank in plan.microbatches for ix in rank]
    assert np.array_equal(np.concatenate(values)[plan.inverse], np.arange(n))  # restores order


lengths = st.lists(st.integers(1, 300), min_size=1, max_size=120)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=lengths, dp=st.integers(1, 5), pp=st.integers(1, 3), budget=st.integers(300, 2000),
       rnd=st.sampled_from([1, 2, 8, 64]), roll=st.booleans(), chunk=st.none() | st.integers(1, 60))
def test_dynamic_invariants(lens, dp, pp, budget, rnd, roll, chunk):
    try:
        plan = plan_dynamic_batches(lens, dp_size=dp, max_tokens_per_microbatch=budget,
                                    sequence_length_round=rnd, pp_size=pp, chunk_size=chunk,
                                    round_before_budget=not roll)
    except ValueError as e:  # only refusals with a reason: overlong or too few sequences
        assert "more than max_tokens" in str(e) or "non-empty micro-batches" in str(e)
        return
    check_plan(plan, len(lens), pp)
    if not roll:  # the hard cap: what memory sees never exceeds the budget
        assert max(max(r) for r in plan.padded_sizes) <= budget
    else:  # ROLL's soft cap bounds real tokens
        assert all(int(plan.seq_lens[ix].sum()) <= budget
                   for rank in plan.microbatches for ix in rank)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=lengths, dp=st.integers(1, 5), budget=st.integers(300, 2000),
       align=st.sampled_from([1, 4, 16]), min_mb=st.integers(1, 3),
       algorithm=st.sampled_from(["kk", "ffd", "bfd"]))
def test_packed_invariants(lens, dp, budget, align, min_mb, algorithm):
    try:
        plan = plan_packed_microbatches(lens, dp_size=dp, max_tokens_per_microbatch=budget,
                                        min_num_microbatches=min_mb, algorithm=algorithm,
                                        align=align)
    except ValueError as e:
        assert "non-empty micro-batches" in str(e) or "more than max_tokens" in str(e)
        return
    check_plan(plan, len(lens))
    assert plan.num_microbatches >= min_mb
    aligned = -(-plan.seq_lens // align) * align
    for rank, packed in zip(plan.microbatches, plan.padded_lengths):
        for ix, length in zip(rank, packed):
            assert length == int(aligned[ix].sum()) <= budget  # hard cap on the pack


def test_property_tests_are_not_vacuous():
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 300, size=100)
    plan = plan_dynamic_batches(lens, dp_size=4, max_tokens_per_microbatch=1000,
                                sequence_length_round=8, pp_size=2)
    check_plan(plan, 100, 2)
    assert plan.num_microbatches >= 2 and plan.balance < 1.05
    plan = plan_packed_microbatches(lens, dp_size=4, max_tokens_per_microbatch=1000)
    check_plan(plan, 100)
    assert plan.balance < 1.01 and plan.num_microbatches >= 4


@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_partition_primitives_match_contracts(k):
    from streampack.rl import _partition

    values = np.random.default_rng(k).integers(1, 100, size=40)
    parts = _partition.balanced_parts(values, k)
    assert len(parts) == k and all(p.size for p in parts)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(40))
    assert max(values[p].sum() for p in parts) - min(values[p].sum() for p in parts) <= 99
    for algorithm in ("ffd", "bfd"):
        bins = _partition.bins(values, 150, algorithm)
        assert np.array_equal(np.sort(np.concatenate(bins)), np.arange(40))
        assert all(values[b].sum() <= 150 for b in bins)


def test_a_chunk_smaller_than_dp_size_is_named():
    lens = np.array([5, 6, 7, 8, 9, 10, 11])
    with pytest.raises(ValueError, match=r"chunk of sequences 6\.\.6 has 1 sequences, fewer than dp_size=2"):
        plan_dynamic_batches(lens, dp_size=2, max_tokens_per_microbatch=64, sequence_length_round=1,
                             chunk_size=3)
