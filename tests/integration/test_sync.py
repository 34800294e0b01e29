"""``streampack.sync_batches``: equal step counts agreed at run time, for data the plan cannot
count (text before tokenizing), with real gloo processes."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers_data import make_text_docs, write_jsonl_shards

from streampack import sync_batches
from streampack.dataset import PackedDataset
from streampack.nodes.collate import is_filler
from streampack.options import PackOptions, TopologyOptions


def _tokens(text: str) -> list[int]:
    return list(text.encode())


def _make(urls: list[str], rank: int) -> PackedDataset:
    return PackedDataset(urls, capacity=64, epochs=1, tokenizer=_tokens, seed=1, packing=PackOptions(window=4),
                         topology=TopologyOptions(dp_rank=rank, dp_size=2, equal_batches="sync"))


def test_one_process_passes_batches_through(tmp_path):
    urls = write_jsonl_shards(tmp_path, make_text_docs(12), 1)
    ds = PackedDataset(urls, capacity=64, epochs=1, tokenizer=_tokens, packing=PackOptions(window=4),
                       topology=TopologyOptions(equal_batches="sync"))
    other = PackedDataset(urls, capacity=64, epochs=1, tokenizer=_tokens, packing=PackOptions(window=4),
                          topology=TopologyOptions(equal_batches="sync"))
    assert [b.doc_keys for b in sync_batches(ds, ds)] == [b.doc_keys for b in other]
    filler = ds.filler()
    assert is_filler(filler) and filler.total_tokens == 64 and filler.num_targets == 0


def _worker(rank: int, init: str, urls: list[str], results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        own = sum(1 for _ in _make(urls, rank))
        ds = _make(urls, rank)
        steps = list(sync_batches(ds, ds))
        results[rank] = (own, len(steps), sum(is_filler(b) for b in steps))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes
def test_ranks_with_unequal_data_step_together(tmp_path):
    docs = make_text_docs(40, seed=3)
    docs[:10] = [d * 12 for d in docs[:10]]  # one shard of long texts: one rank has far more batches
    urls = write_jsonl_shards(tmp_path, docs, 4)
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(os.path.join(tmp, "init"), urls, results), nprocs=2)
        got = dict(results)
    (own0, steps0, fill0), (own1, steps1, fill1) = got[0], got[1]
    assert own0 != own1, "the case where ranks hold different amounts of data"
    assert steps0 == steps1 == max(own0, own1)
    assert fill0 + fill1 == abs(own0 - own1)
