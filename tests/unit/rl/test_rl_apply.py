"""Applying plans to tensors: per-sequence logprobs computed per micro-batch, restored to
the original order, equal those computed on the original padded batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streampack.layout.batch import check_invariants
from streampack.rl import (
    apply_dynamic_plan,
    apply_packed_plan,
    plan_dynamic_batches,
    plan_packed_microbatches,
    restore_order,
)


def toy_logprobs(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """A deterministic stand-in for log p(next token): ``[..., L] -> [..., L - 1]``."""
    return -((ids[..., :-1] * 7 + ids[..., 1:] * 3 + pos[..., :-1]) % 11).double() / 11


def rollout(n: int = 37, seed: int = 0, left: bool = False):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 60, (n,), generator=g)
    S = int(lens.max()) + 3
    ids = torch.randint(1, 1000, (n, S), generator=g)
    cols = torch.arange(S)
    mask = (cols < lens[:, None]) if not left else (cols >= S - lens[:, None])
    ids = torch.where(mask, ids, torch.full_like(ids, 5))  # pad id 5 in the input
    return ids, mask.long(), lens


def reference(ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for row, m in zip(ids, mask):
        real = row[m.bool()]
        out.append(toy_logprobs(real, torch.arange(real.numel())))
    return out


@pytest.mark.parametrize("left", [False, True])
@pytest.mark.parametrize("convention", ["balanced", "roll"])
def test_dynamic_logprobs_restore(left, convention):
    # ROLL deals sorted[r::dp] and needs the batch to divide by dp_size
    ids, mask, lens = rollout(n=37 if convention == "balanced" else 36, left=left)
    plan = plan_dynamic_batches(lens.numpy(), dp_size=3, max_tokens_per_microbatch=256,
                                sequence_length_round=8, pp_size=2, convention=convention)
    outputs = []
    for rank in range(plan.dp_size):
        per_mb = []
        for mb in apply_dynamic_plan(plan, ids, mask, dp_rank=rank):
            assert mb.input_ids.shape == mb.attention_mask.shape == mb.position_ids.shape
            assert mb.input_ids.shape[1] % 8 == 0
            assert torch.equal(mb.attention_mask.sum(1), mb.seq_lens)
            lp = toy_logprobs(mb.input_ids, mb.position_ids)
            per_mb.append([lp[k, :n - 1] for k, n in enumerate(mb.seq_lens.tolist())])
        outputs.append(per_mb)
    restored = restore_order(outputs, plan)
    ref = reference(ids, mask)
    assert len(restored) == len(ref) and all(torch.equal(a, b) for a, b in zip(restored, ref))


def test_packed_logprobs_restore_and_invariants():
    ids, mask, lens = rollout(n=41, seed=1)
    for algorithm in ("kk", "ffd"):
        plan = plan_packed_microbatches(lens.numpy(), dp_size=2, max_tokens_per_microbatch=200,
                                        align=4, algorithm=algorithm)
        outputs = []
        for rank in range(2):
            batches = apply_packed_plan(plan, ids, mask, dp_rank=rank)
            assert len(batches) == plan.num_microbatches
            per_mb = []
            for batch, ix in zip(batches, plan.microbatches[rank]):
                assert batch.total_tokens == 200
                check_invariants(batch, [ids[i][mask[i].bool()] for i in ix.tolist()])
                lp = toy_logprobs(batch.input_ids, batch.position_ids)
                starts = batch.cu_seqlens_padded[:-1].tolist()
                per_mb.append([lp[s:s + n - 1] for s, n in zip(starts, batch.doc_lengths.tolist())])
            outputs.append(per_mb)
        restored = restore_order(outputs, plan)
        assert all(torch.equal(a, b) for a, b in zip(restored, reference(ids, mask)))


def test_packed_tight_shape_and_loss_mask():
    seqs = [torch.arange(1, n + 1) for n in (5, 3, 9, 2)]
    lm = [torch.tensor([0] * (n // 2) + [1] * (n - n // 2)) for n in (5, 3, 9, 2)]
    plan = plan_packed_microbatches([5, 3, 9, 2], dp_size=1, max_tokens_per_microbatch=12,
                                    align=2)
    batches = apply_packed_plan(plan, seqs, dp_rank=0, loss_mask=lm, fixed_shape=False)
    assert [b.total_tokens for b in batches] == list(plan.padded_lengths[0])
    assert sum(b.num_targets for b in batches) == sum(int(m[1:].sum()) for m in lm)


def test_restore_order_accepts_stacked_tensors():
    lens = np.array([4, 1, 3, 2, 5])
    plan = plan_dynamic_batches(lens, dp_size=2, max_tokens_per_microbatch=10,
                                sequence_length_round=1)
    outputs = [[torch.from_numpy(lens[ix]) * 10 for ix in rank] for rank in plan.microbatches]
    assert [int(v) for v in restore_order(outputs, plan)] == (lens * 10).tolist()


def test_apply_refuses_mismatches():
    ids, mask, lens = rollout(n=6)
    plan = plan_dynamic_batches(lens.numpy(), dp_size=2, max_tokens_per_microbatch=256,
                                sequence_length_round=1)
    with pytest.raises(ValueError, match="dp_rank=2"):
        apply_dynamic_plan(plan, ids, mask, dp_rank=2)
    with pytest.raises(ValueError, match="real tokens, the plan says"):
        apply_dynamic_plan(plan, ids, torch.ones_like(mask), dp_rank=0)
    with pytest.raises(ValueError, match="needs a packed plan"):
        apply_packed_plan(plan, ids, mask, dp_rank=0)
    with pytest.raises(ValueError, match="ranks, the plan 2"):
        restore_order([[]], plan)
