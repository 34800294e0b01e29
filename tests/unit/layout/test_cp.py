"""CP sharding: TE's token assignment, the seeds' worked examples, and round trips."""

from __future__ import annotations

import random

import pytest
import torch

from streampack import (
    alignment,
    check_invariants,
    cp_partition_indices,
    cp_shard,
    cp_unshard,
    pack_batch,
)

P = 0  # pad id used in the seeds' pictures


def test_transformer_engine_own_example():
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    assert cp_partition_indices(cu, 16, 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert cp_partition_indices(cu, 16, 2, 1).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]


def test_seed_000_context_parallel_example():
    # NeMo-RL: sequences of 5, 8, 1 and 3 tokens, CP=2 -> padded to 4, sharded per sequence
    docs = [[10] * 5, [11] * 8, [12], [13] * 3]
    batch = pack_batch([docs], capacity=24, align=alignment(cp_size=2))
    rank0 = cp_shard(batch, 2, 0).input_ids.tolist()
    rank1 = cp_shard(batch, 2, 1).input_ids.tolist()
    assert rank0 == [10, 10, P, P, 11, 11, 11, 11, 12, P, 13, P]
    assert rank1 == [10, 10, 10, P, 11, 11, 11, 11, P, P, 13, 13]


def test_seed_002_complete_packing_example():
    # ROLL §2.2.3: valid lengths 2, 4, 6, 1; CP_SIZE=2, TP_SIZE=1 -> align 4
    docs = [[10] * 2, [11] * 4, [12] * 6, [13]]
    batch = pack_batch([docs], capacity=20, align=alignment(cp_size=2, tp_size=1))
    assert batch.cu_seqlens_padded.tolist() == [0, 4, 8, 16, 20]
    assert cp_shard(batch, 2, 0).input_ids.tolist() == [10, P, 11, 11, 12, 12, P, P, 13, P]
    assert cp_shard(batch, 2, 1).input_ids.tolist() == [10, P, 11, 11, 12, 12, 12, 12, P, P]


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
@pytest.mark.parametrize("tp", [1, 2])
def test_shard_then_unshard_is_identity(cp, tp):
    rng = random.Random(cp * 10 + tp)
    align = alignment(cp_size=cp, tp_size=tp)
    capacity = align * 16
    packs = []
    for _ in range(3):
        room, pack = capacity, []
        while room >= align and (not pack or rng.random() < 0.7):
            n = rng.randint(1, room)
            if -(-n // align) * align > room:
                continue
            pack.append([rng.randint(1, 99) for _ in range(n)])
            room -= -(-n // align) * align
        packs.append(pack)
    batch = pack_batch(packs, capacity=capacity, align=align)
    check_invariants(batch)
    shards = [cp_shard(batch, cp, r) for r in range(cp)]
    for field in ("input_ids", "labels", "position_ids", "seq_idx"):
        full = getattr(batch, field) if field != "seq_idx" else batch.seq_idx
        assert torch.equal(cp_unshard([getattr(s, field) for s in shards], batch.cu_seqlens_padded), full)
    # Every token on exactly one rank, each rank the same size, targets add up.
    idx = torch.cat([s.indices for s in shards])
    assert sorted(idx.tolist()) == list(range(batch.total_tokens))
    assert {len(s.indices) for s in shards} == {batch.total_tokens // cp}
    assert sum(s.num_targets_local for s in shards) == batch.num_targets
    # Local spans: each rank holds exactly span/cp tokens of every document, contiguously.
    for s in shards:
        local_doc = s.seq_idx
        spans = (s.cu_seqlens_padded_local[1:] - s.cu_seqlens_padded_local[:-1]).tolist()
        assert torch.bincount(local_doc.long(), minlength=batch.num_docs).tolist() == spans
        assert bool((local_doc[1:] >= local_doc[:-1]).all())


def test_cp_refuses_unaligned_documents_and_short_totals():
    batch = pack_batch([[[1, 2, 3], [4, 5]]], capacity=6)  # spans 3 and 3: not multiples of 4
    with pytest.raises(ValueError, match="not a multiple of 2\\*cp_size=4"):
        cp_shard(batch, 2, 0)
    with pytest.raises(ValueError, match="must equal total_tokens=12"):
        cp_partition_indices(torch.tensor([0, 8], dtype=torch.int32), 12, 2, 0)
    with pytest.raises(ValueError, match="cp_rank=2"):
        cp_partition_indices(torch.tensor([0, 8], dtype=torch.int32), 8, 2, 2)
