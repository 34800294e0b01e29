"""Plan, apply, run a fake logprob pass and restore the original order on a synthetic rollout.

    python examples/rl_microbatches.py
"""

from __future__ import annotations

import torch

from streampack.rl import (
    apply_dynamic_plan,
    apply_packed_plan,
    plan_dynamic_batches,
    plan_packed_microbatches,
    restore_order,
)

DP_SIZE, BUDGET, ROUND = 4, 4096, 64


def fake_logprobs(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Stand-in for the policy: a deterministic function of (token, next token, position)."""
    return -((ids[..., :-1] * 7 + ids[..., 1:] * 3 + pos[..., :-1]) % 11).float() / 11


def main() -> None:
    g = torch.Generator().manual_seed(0)
    lens = torch.exp(torch.randn(256, generator=g) * 0.9 + 6.0).clamp(8, 4000).long()
    S = int(lens.max())
    ids = torch.randint(1, 32000, (256, S), generator=g)
    mask = (torch.arange(S) < lens[:, None]).long()  # right-padded rollout batch [B, S]
    ref = [fake_logprobs(r[: int(n)], torch.arange(int(n))) for r, n in zip(ids, lens)]
    print(f"rollout: {len(lens)} sequences, {int(lens.sum()):,} real tokens, "
          f"padded batch {len(lens) * S:,} tokens; dp_size={DP_SIZE}, budget={BUDGET}")

    dyn = plan_dynamic_batches(lens.numpy(), dp_size=DP_SIZE, max_tokens_per_microbatch=BUDGET,
                               sequence_length_round=ROUND, pp_size=2)
    outputs = []
    for rank in range(DP_SIZE):  # in training, each rank runs only its own dp_rank
        per_mb = []
        for mb in apply_dynamic_plan(dyn, ids, mask, dp_rank=rank):
            lp = fake_logprobs(mb.input_ids, mb.position_ids)
            per_mb.append([lp[k, : n - 1] for k, n in enumerate(mb.seq_lens.tolist())])
        outputs.append(per_mb)  # in training: all-gathered across the DP group
    assert all(torch.equal(a, b) for a, b in zip(restore_order(outputs, dyn), ref))
    print("dynamic:", {k: round(v, 4) if isinstance(v, float) else v for k, v in dyn.stats().items()})

    packed = plan_packed_microbatches(lens.numpy(), dp_size=DP_SIZE,
                                      max_tokens_per_microbatch=BUDGET, align=ROUND)
    outputs = []
    for rank in range(DP_SIZE):
        per_mb = []
        for batch in apply_packed_plan(packed, ids, mask, dp_rank=rank):
            lp = fake_logprobs(batch.input_ids, batch.position_ids)
            starts = batch.cu_seqlens_padded[:-1].tolist()
            per_mb.append([lp[s:s + n - 1] for s, n in zip(starts, batch.doc_lengths.tolist())])
        outputs.append(per_mb)
    assert all(torch.equal(a, b) for a, b in zip(restore_order(outputs, packed), ref))
    print("packed: ", {k: round(v, 4) if isinstance(v, float) else v
                       for k, v in packed.stats().items()})
    print("restore_order: per-sequence logprobs match the unbatched pass for both plans")


if __name__ == "__main__":
    main()
